"""Shared by the export tests: the export package and the small-page Config under which Recent
and Mid pages occur."""

import importlib

import numpy as np
import torch

import kvtopo
from kvtopo.config import Config
from kvtopo.runtime.host_runner import HostRunner


def export_package():
    return importlib.import_module("kvtopo.export")


def export_module(name: str):
    """A submodule of the export package, e.g. export_module("f16") -> kvtopo.export.f16."""
    return importlib.import_module("kvtopo.export." + name)


# Small pages so a 256-token prompt has Initial, Mid, Recent and Terminal pages; a byte budget
# that keeps some Mid pages whole, evicts others entirely and one partly (score + selection).
CONFIG = Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=None, layer_budget_bytes=24000,
                prefill_chunk_size=64)


def assert_host_runner_matches_session(model, export_dir, config: Config, prompt: int, new: int,
                                       runtime: str = "onnxruntime") -> HostRunner:
    """Greedy generation of `new` tokens after a random `prompt`-token prompt through `runtime`
    (HostRunner over `export_dir`) and through the compiled model in a PyTorch session agree:
    same tokens, logits within 2e-3, the same KV bytes held (the session's free pool slots
    aside). Returns the runner, for checks of what it holds."""
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    runner = HostRunner(export_dir, runtime=runtime)
    tokens, logits = runner.generate(ids[0].numpy(), new, return_logits=True)
    kvtopo.compile(model, inductor=False)
    assert runner.config == config.replace(refit_after=None, eviction_scope="page")  # what the graphs do
    with kvtopo.session(runner.config) as session:
        ref_tokens, ref_logits = kvtopo.generate(model, ids, new, return_logits=True)
        stats = session.stats()
    assert tokens.tolist() == ref_tokens[0].tolist()
    # float32 runtime vs PyTorch (other summation orders) over 32 steps of a random-weight
    # model, same kept tokens on both sides: up to 1.3e-3 measured (onnxruntime, qwen3-moe).
    error = np.abs(logits - ref_logits[0].numpy()).max()
    assert error < 2e-3, f"{runtime}: logits differ from the session's by up to {error:.2e}"
    assert runner.nbytes() == stats.total_bytes - stats.per_kind["free"]
    return runner
