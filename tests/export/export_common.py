"""Shared by the export tests: import `export/` as kvtopo.export (or from the repo root
until pyproject lists it), and the small-page Config under which Recent and Mid pages occur."""

import importlib
import sys
from pathlib import Path

from kvtopo.config import Config

ROOT = Path(__file__).resolve().parents[2]


def export_package():
    try:
        return importlib.import_module("kvtopo.export")
    except ImportError:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        return importlib.import_module("export")


# Small pages so a 256-token prompt has Initial, Mid, Recent and Terminal pages; a byte budget
# that keeps some Mid pages whole, evicts others entirely and one partly (score + selection).
CONFIG = Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=None, layer_budget_bytes=24000,
                prefill_chunk_size=64)



def export_module(name: str):
    """A submodule of the export package (kvtopo.export.<name> or export.<name>)."""
    return importlib.import_module(export_package().__name__ + "." + name)
