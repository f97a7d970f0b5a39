"""Shared by the export tests: the export package and the small-page Config under which Recent
and Mid pages occur."""

import importlib

from kvtopo.config import Config


def export_package():
    return importlib.import_module("kvtopo.export")


def export_module(name: str):
    """A submodule of the export package, e.g. export_module("f16") -> kvtopo.export.f16."""
    return importlib.import_module("kvtopo.export." + name)


# Small pages so a 256-token prompt has Initial, Mid, Recent and Terminal pages; a byte budget
# that keeps some Mid pages whole, evicts others entirely and one partly (score + selection).
CONFIG = Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=None, layer_budget_bytes=24000,
                prefill_chunk_size=64)

