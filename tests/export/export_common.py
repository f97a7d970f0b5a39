"""Shared by the export tests: the export package and the small-page Config under which Recent
and Mid pages occur."""

import importlib

from kvtopo.config import Config
from kvtopo.export.host_runner import HostRunner


def export_package():
    return importlib.import_module("kvtopo.export")


def export_module(name: str):
    """A submodule of the export package, e.g. export_module("f16") -> kvtopo.export.f16."""
    return importlib.import_module("kvtopo.export." + name)


# Small pages so a 256-token prompt has Initial, Mid, Recent and Terminal pages; a byte budget
# that keeps some Mid pages whole, evicts others entirely and one partly (score + selection).
# Mid projected onto fitted bases (opt-in since Config's default became unprojected codes, which
# test_unprojected_export.py covers), so that the projected path stays tested.
CONFIG = Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=None, layer_budget_bytes=24000,
                prefill_chunk_size=64, key_energy=0.9, value_energy=0.9)


def graph_config(config: Config) -> Config:
    """What the exported graphs do with `config` (the export's own rule, `_exported_config`): the
    session config a host runner must match."""
    return export_package()._exported_config(config)


# The runtimes that execute the ONNX files (the MLIR runs on IREE: test_iree.py).
ONNX_RUNTIMES = ("onnxruntime", "openvino")
LOGIT_TOLERANCE = {"onnxruntime": 2e-3, "openvino": 2e-2, "iree": 2e-3}


def assert_host_runner_matches_session(session_references, name: str, export_dir, config: Config, prompt: int,
                                       new: int, runtimes=ONNX_RUNTIMES) -> dict[str, HostRunner]:
    """Greedy generation of `new` tokens after a random `prompt`-token prompt through each of
    `runtimes` (HostRunner over `export_dir`, an export of zoo model `name` under `config`) and
    through the compiled model in a PyTorch session (the `session_references` fixture's run)
    agree: same tokens, logits within LOGIT_TOLERANCE, the same KV bytes held (the session's free pool slots
    aside). Returns the runners by runtime, for checks of what they hold."""
    exported = graph_config(config)
    ids, reference = session_references(name, exported, prompt, new)
    runners = {}
    for a in export_module("check").compare_with_session(None, export_dir, runtimes, ids, new, reference=reference):
        assert a.runner.config == exported
        assert a.same_tokens or a.parted_at_a_tie, a.describe()
        # float32 runtime vs PyTorch (other summation orders) over 32 steps of a random-weight
        # model, same kept tokens on both sides: up to 1.3e-3 measured (onnxruntime, qwen3-moe).
        # OpenVINO's CPU kernels depend on the machine: 9.8e-3 on qwen3-moe on an AVX-512 BF16
        # EPYC with float32 inference precision pinned, under 2e-3 on the machines before.
        assert a.max_logit_error < LOGIT_TOLERANCE[a.runtime], a.describe()
        assert a.bytes_held == a.session_bytes, a.describe()
        runners[a.runtime] = a.runner
    return runners


def assert_openvino_supports_every_op(paths) -> None:
    """OpenVINO's CPU plugin takes every op of both ONNX graphs: none rejected, none left to
    another device."""
    import openvino as ov

    core = ov.Core()
    for graph in ("decode_step", "compressor"):
        model = core.read_model(paths[graph])
        ops = {op.get_friendly_name() for op in model.get_ops()}
        supported = core.query_model(model, "CPU")
        assert ops and ops <= set(supported), (graph, sorted(ops - set(supported))[:20])
        assert set(supported.values()) == {"CPU"}, graph
