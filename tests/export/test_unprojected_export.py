"""Export of an unprojected Mid (the topo policy with key_energy=None, value_energy=None, and
`kivi`): KIVI-style codes of the kept tokens' channels, keys with statistics per page and
channel, values per token and head, as `runtime.codecs.MidSegment` codes them. The exported
compressor against the runtime's codes and statistics on random pages; onnxruntime and OpenVINO
(HostRunner) against the PyTorch session, with and without a byte budget that evicts."""

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from kvtopo.kernels.quant import unpack
from kvtopo.runtime.codecs import MidSegment
from kvtopo.runtime.layer_cache import best_tokens
from kvtopo.runtime.policies import ScoreInputs, make_policy

from export_common import CONFIG, assert_host_runner_matches_session, export_module, graph_config

PROMPT, NEW = 256, 32
UNPROJECTED = CONFIG.replace(key_energy=None, value_energy=None)
# Unprojected pages cost more than projected ones: at 22 KB per layer the zoo Llama's Mid pages are
# kept partly.
CONFIGS = {"evicting": UNPROJECTED.replace(layer_budget_bytes=22000),
           "no-budget": UNPROJECTED.replace(layer_budget_bytes=None),
           # kivi: the same Mid codes, no eviction, Recent pages exact.
           "kivi": UNPROJECTED.replace(policy="kivi", layer_budget_bytes=None)}
HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.mark.parametrize("which", list(CONFIGS))
def test_unprojected_host_runner_matches_session(which, onnx_export, session_references):
    config = CONFIGS[which]
    out, paths = onnx_export("llama", config, PROMPT + NEW)
    layout = export_module("layout").CacheLayout.from_json(open(paths["layout"]).read())
    assert not layout.mid_projected and layout.mid_valid_only
    inputs = {i.name: i.type.tensor_type.shape.dim for i in onnx.load(paths["decode_step"]).graph.input}
    assert "mid_v_scale_0" in inputs and not [n for n in inputs if n.startswith(("key_", "value_"))]
    # Mid rows and pages are dynamic axes: the host feeds what is held, not the capacity.
    assert all(inputs[f"{n}_0"][axis].dim_param for n, (axis, _) in export_module("decode_step").mid_axes(layout).items())

    for runner in assert_host_runner_matches_session(session_references, "llama", out, config, PROMPT, NEW).values():
        pages = [p for layer in runner.layers for p in layer.pages]
        assert {p.phase.value for p in pages} == {"initial", "mid", "recent", "terminal"}
        assert any(p.recent is not None for p in pages) == (which != "kivi")
        kept = [p.kept for p in pages if p.kept is not None]
        if which == "evicting":
            assert any(0 < k < config.page_size for k in kept), kept  # the prompt's chunks share the cap by tokens
        else:
            assert set(kept) == {config.page_size}, kept
        layer = runner.layers[0]
        assert layer.mid_len > 0 and not layer.bases
        # Value statistics per row: a row past the pages' kept tokens holds none.
        assert (layer.mid["mid_v_scale"][:, : layer.mid_len] > 0).all()
        fed = layer._mid_inputs()
        assert fed["mid_k_codes"].shape[1] == fed["mid_v_scale"].shape[1] == layer.mid_len < layout.mid_capacity
        assert fed["mid_k_scale"].shape[1] == layer.mid_pages


def test_unprojected_mla_host_runner_matches_session(onnx_export, session_references):
    """DeepSeek-V3 (MLA): the latent + RoPE key coded per channel, values read from the codes."""
    config = UNPROJECTED.replace(layer_budget_bytes=22000)  # Mid pages kept partly
    out, paths = onnx_export("deepseek-v3", config, PROMPT + NEW)
    inputs = {i.name for i in onnx.load(paths["decode_step"]).graph.input}
    assert "mid_k_codes_0" in inputs and not [n for n in inputs if n.startswith(("mid_v", "key_", "value_"))]
    # onnxruntime only (OpenVINO runs the same ops in the Llama cases above), to keep the test short.
    for runner in assert_host_runner_matches_session(session_references, "deepseek-v3", out, config, PROMPT, NEW,
                                                     runtimes=("onnxruntime",)).values():
        kept = [p.kept for layer in runner.layers for p in layer.pages if p.kept is not None]
        assert any(0 < k < config.page_size for k in kept), kept  # the prompt's chunks share the cap by tokens


@pytest.fixture(scope="module")
def unprojected_compressor(onnx_export):
    """The zoo Llama's unprojected export's page compressor (HEADS, KV_HEADS, DIM, scale 0.25: the
    shapes of the pages below; the byte budget is not the compressor's: it is fed `keep`), the
    file the no-budget host-runner case runs: (layout, the module, the file's path)."""
    _, paths = onnx_export("llama", CONFIGS["no-budget"], PROMPT + NEW)
    layout = export_module("layout").CacheLayout.from_json(Path(paths["layout"]).read_text())
    assert (layout.heads, layout.kv_heads, layout.head_dim, layout.scales[0]) == (HEADS, KV_HEADS, DIM, 0.25)
    return layout, export_module("onnx_export").compressor_module(layout), paths["compressor"]


def _runtime_codes(keys, values, queries, keep):
    """What runtime.layer_cache does to a page entering an unprojected Mid: policy score, top-k,
    MidSegment without bases -> kept [Hkv, keep], per-head codes and statistics."""
    policy = make_policy(UNPROJECTED)
    if keep < keys.shape[1]:
        kept = best_tokens(policy.score(ScoreInputs(keys, values, queries.half(), 0.25)), keep)
    else:
        kept = torch.arange(keys.shape[1]).expand(keys.shape[0], -1)
    segment = MidSegment(policy.mid_encoding(), None, None, torch.float32)
    rows = lambda x: x.gather(1, kept[..., None].expand(-1, -1, DIM))  # noqa: E731
    segment.append_page(rows(keys), rows(values))
    k, v = segment.keys, segment.values
    # Runtime rows are [n, Hkv, d]; statistics [1, Hkv, d] (keys) and [n, Hkv, 1] (values).
    return (kept, unpack(k.rows, k.bits, DIM).transpose(0, 1), k.scale[0].float(), k.offset[0].float(),
            unpack(v.rows, v.bits, DIM).transpose(0, 1), v.scale[..., 0].T.float(), v.offset[..., 0].T.float(),
            [k.scale.dtype == torch.float16, v.scale.dtype == torch.float16])


@pytest.mark.parametrize("seed", range(6))
def test_unprojected_compressor_matches_runtime(unprojected_compressor, seed):
    import onnxruntime as ort

    layout, module, path = unprojected_compressor
    g = torch.Generator().manual_seed(seed)
    P = layout.page_size
    keys = torch.randn(KV_HEADS, P, DIM, generator=g) * 2 + torch.randn(KV_HEADS, 1, DIM, generator=g)
    values = torch.randn(KV_HEADS, P, DIM, generator=g)
    if seed == 2:  # narrow slices far from zero: float16 statistics widen the scale, and are kept
        values = 5 + 0.03 * values
    if seed == 3:  # values beyond float16's range: float32 statistics
        values = values * 1e5
    queries = (torch.randn(HEADS, layout.observation_window, DIM, generator=g) * 3).half().float()
    keep = [1, 5, 9, 12, 15, P][seed]
    feeds = {"keys": keys, "values": values, "queries": queries, "num_queries": torch.tensor(queries.shape[1]),
             "keep": torch.tensor(keep), "scale": torch.tensor(0.25)}
    out = ort.InferenceSession(str(path)).run(None, {k: v.numpy() for k, v in feeds.items()})
    eager = [t.numpy() for t in module(*feeds.values())]
    kept, k_codes, k_scale, k_offset, v_codes, v_scale, v_offset, f16 = _runtime_codes(keys, values, queries, keep)
    assert f16 == [True, seed != 3]  # one row (keep 1, seed 0: range 0) keeps float16 too

    for got in (out, eager):
        t = [torch.from_numpy(x) for x in got]
        assert torch.equal(t[0][:, :keep], kept)
        assert torch.equal(unpack(t[1], 4, DIM)[:, :keep], k_codes) and torch.equal(t[2], k_scale)
        assert torch.equal(t[3], k_offset)
        assert torch.equal(unpack(t[4], 4, DIM)[:, :keep], v_codes)
        assert torch.equal(t[5][:, :keep], v_scale) and torch.equal(t[6][:, :keep], v_offset)
        assert (t[5][:, keep:] == 0).all() and (unpack(t[4], 4, DIM)[:, keep:] == 0).all()
        assert t[7].tolist() == f16


def test_unprojected_npu_profile_matches_session(onnx_export, session_references):
    """The "npu" profile (static, float16 boundary, one token per call) with an unprojected Mid:
    onnxruntime and OpenVINO give the float32 session's tokens (test_npu_profile's tolerance)."""
    from test_npu_profile import LOGIT_TOLERANCE

    from kvtopo.export.check import compare_with_session

    prompt, new = 64, 16
    config = CONFIGS["no-budget"]
    session_config = graph_config(config).replace(prefill_chunk_size=1)
    out, _ = onnx_export("llama", config, prompt + new, "npu")
    ids, reference = session_references("llama", session_config, prompt, new)
    for a in compare_with_session(None, out, ("onnxruntime", "openvino"), ids, new, reference=reference):
        assert a.runner.config == session_config and a.runner.layers[0].mid_len > 0
        assert a.runner.layers[0].mid["mid_v_scale"].dtype == np.float16
        assert (a.same_tokens or a.parted_at_a_tie) and a.max_logit_error < LOGIT_TOLERANCE, a.describe()
        assert a.bytes_held == reference[2], a.describe()
