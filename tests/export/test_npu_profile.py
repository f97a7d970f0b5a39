"""The "npu" export profile: fully static graphs (batch 1, one token per decode-step call, fixed
cache capacities) with float16 at their boundaries. No ONNX input/output dimension and no MLIR
entry signature type is dynamic; OpenVINO sees only static input shapes; HostRunner runs the
profile on onnxruntime, OpenVINO and IREE (float16 buffers in, float16 outputs) and gives the
float32 PyTorch session's greedy tokens, logits within a measured tolerance."""

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kvtopo.export.host_runner import HostRunner
from kvtopo.models import zoo

from export_common import CONFIG, assert_openvino_supports_every_op, export_module, export_package, graph_config

PROMPT, NEW = 64, 16  # 80 tokens: Initial, Mid, Recent and Terminal pages at page_size 16
# The float32 session the profile is compared with: what the graphs do (one token per call, so
# the session prefills one token per forward too: bases are fitted on the same tokens).
SESSION_CONFIG = graph_config(CONFIG).replace(prefill_chunk_size=1)
# Measured on the zoo Llama, 64-token prompt + 16 steps: 4.3e-3 on all three runtimes (float16
# exact K/V, Recent/Mid statistics, bases and queries, and the float16 logits themselves; the
# float32 path is within 2e-3). Twice that, so a worse rounding (float16 compute inside) fails.
LOGIT_TOLERANCE = 8e-3


@pytest.fixture(scope="module")
def llama(session_references):
    """(prompt, the float32 session's reference) on the zoo Llama: what the ONNX and the IREE
    exports of the profile are both held to."""
    return session_references("llama", SESSION_CONFIG, PROMPT, NEW)


def _assert_profile_matches_session(llama, out, runtimes):
    ids, reference = llama
    ref_tokens, ref_logits, ref_bytes = reference
    for a in export_module("check").compare_with_session(None, out, runtimes, ids, NEW, reference=reference):
        runner = a.runner
        assert runner.config == SESSION_CONFIG
        assert runner.layout.profile == "npu" and runner.layout.tokens == 1
        buffers = runner.layers[0].feeds()[0]
        assert buffers["exact_k"].dtype == buffers["key_vectors"].dtype == buffers["mid_k_scale"].dtype == np.float16
        assert buffers["mid_k_codes"].dtype == np.uint8
        assert a.same_tokens or a.parted_at_a_tie, a.describe()
        assert a.max_logit_error < LOGIT_TOLERANCE, a.describe()
        assert a.bytes_held == ref_bytes, a.describe()  # the float32 session's accounting: same evictions
        assert {p.phase.value for layer in runner.layers for p in layer.pages} == {"initial", "mid", "recent",
                                                                                  "terminal"}
        runner.reset()
        assert runner.forward(ids[0, :1].numpy()).dtype == np.float16  # float16 logits out


def test_onnx_profile_is_static_and_matches_session(llama, onnx_export):
    out, paths = onnx_export("llama", CONFIG, PROMPT + NEW, "npu")
    dynamic_dims = export_module("onnx_export").dynamic_dims
    for graph in ("decode_step", "compressor"):
        proto = onnx.load(paths[graph])
        assert dynamic_dims(proto) == [], graph
        values = [*proto.graph.input, *proto.graph.output]
        types = {v.name: (v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in values}
        # No float32 tensor at the boundary but the compressor's 0-d softmax scale; uint8 codes stay.
        assert {n for n, (t, rank) in types.items() if t == TensorProto.FLOAT} <= {"scale"}, graph
        assert any(t == TensorProto.FLOAT16 for t, _ in types.values()), graph
        assert any(t == TensorProto.UINT8 for t, _ in types.values()), graph
    assert onnx.load(paths["decode_step"]).graph.input[0].type.tensor_type.shape.dim[1].dim_value == 1

    assert_openvino_supports_every_op(paths)
    import openvino as ov

    core = ov.Core()
    for graph in ("decode_step", "compressor"):
        ov_model = core.read_model(paths[graph])
        assert all(p.get_partial_shape().is_static for p in [*ov_model.inputs, *ov_model.outputs]), graph
    _assert_profile_matches_session(llama, out, ("onnxruntime", "openvino"))

    runner = HostRunner(out)
    with pytest.raises(ValueError, match="exactly 1 token"):
        runner.forward(np.array([1, 2]))
    with pytest.raises(ValueError, match="prefill_chunk_size=1"):
        HostRunner(out, config=SESSION_CONFIG.replace(prefill_chunk_size=64))
    runner.position = PROMPT + NEW
    with pytest.raises(RuntimeError, match="max_context"):
        runner.forward(np.array([1]))


def test_iree_profile_is_static_and_matches_session(llama, tmp_path):
    pytest.importorskip("iree.compiler", reason="iree-base-compiler is not installed")
    pytest.importorskip("iree.runtime", reason="iree-base-runtime is not installed")
    paths = export_package().export_iree(zoo.build("llama"), tmp_path, config=CONFIG, max_context=PROMPT + NEW,
                                         profile="npu")
    mlir = export_module("mlir_export")
    for graph in ("decode_step", "compressor"):
        text = open(paths[f"{graph}.torch"]).read()
        assert mlir.dynamic_signature(text, graph) == [], graph
        signature = mlir.signature(text, graph)
        assert ",f16>" in signature and set(re.findall(r"vtensor<\[[\d,]*\],f32>", signature)) <= {"vtensor<[],f32>"}
    _assert_profile_matches_session(llama, tmp_path, ("iree",))


def test_static_checks_find_dynamic_dimensions():
    """The checks the profile's exports run can fail: a symbolic ONNX dim, an unknown rank, a `?`."""
    dynamic_dims = export_module("onnx_export").dynamic_dims
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    assert dynamic_dims(helper.make_model(graph)) == ["x[1]", "y[*]"]
    mlir = export_module("mlir_export")
    text = ("module {\n  func.func @decode_step(%arg0: !torch.vtensor<[1,?],si64>, %arg1: tensor<2x3xf16>) -> "
            "(tensor<1x?xf16>, !torch.vtensor<[2],f16>) {\n  %0 = tensor.empty(%d) : tensor<?xf16>\n")
    assert mlir.dynamic_signature(text, "decode_step") == ["!torch.vtensor<[1,?],si64>", "tensor<1x?xf16>"]
    with pytest.raises(ValueError, match="no function"):
        mlir.dynamic_signature(text, "compressor")
    with pytest.raises(ValueError, match="profile='gpu' is invalid"):
        export_package().export_onnx("llama", "out", profile="gpu")


def test_cli_profile_npu_smoke_runs(tmp_path, capsys):
    from kvtopo.cli import main

    code = main(["export", "onnx", "llama", "--out", str(tmp_path), "--max-context", "40", "--profile", "npu",
                 "--target", "onnxruntime", "--smoke-prompt", "16", "--smoke-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "onnxruntime: same tokens as the PyTorch session over 4 new tokens" in out
    layout = export_module("layout").CacheLayout.from_json((tmp_path / "layout.json").read_text())
    assert (layout.profile, layout.tokens, layout.max_context) == ("npu", 1, 40)
