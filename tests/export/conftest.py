"""Session-wide caches of the export tests' two expensive steps: exporting a zoo model, and
running the compiled model in a PyTorch session for the reference the runtimes are held to.
Each costs tens of seconds on CPU, and several files check the same export or the same
reference, so each is done once per test run and shared (the tests only read what they get)."""

import pytest
import torch

from kvtopo.export.check import session_reference
from kvtopo.models import zoo

from export_common import export_package


@pytest.fixture(scope="session")
def onnx_export(tmp_path_factory):
    """export_onnx of a zoo model: (name, config, max_context, profile=None) -> (directory, paths).
    Written once per key: e.g. the zoo Llama's export carries both the host-runner agreement and
    the compressor checks on random pages (its compressor.onnx is the one those checks need)."""
    exports = {}

    def export(name: str, config, max_context: int, profile: str | None = None):
        key = (name, config, max_context, profile)
        if key not in exports:
            out = tmp_path_factory.mktemp(f"{name}_onnx")
            paths = export_package().export_onnx(zoo.build(name), out, config=config, max_context=max_context,
                                                 profile=profile)
            exports[key] = out, paths
        return exports[key]
    return export


@pytest.fixture(scope="session")
def session_references():
    """The PyTorch session's greedy run of a zoo model (a fresh, seeded build, so it equals the
    exported one) after a random prompt (seed 1): (name, session config, prompt, new) -> (ids,
    check.session_reference's (tokens, logits, KV bytes)). Computed once per key: onnxruntime,
    OpenVINO and IREE exports of the same model and config are all held to the same run."""
    references = {}

    def reference(name: str, config, prompt: int, new: int):
        key = (name, config, prompt, new)
        if key not in references:
            model = zoo.build(name)
            ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
            references[key] = ids, session_reference(model, ids, new, config)
        return references[key]
    return reference
