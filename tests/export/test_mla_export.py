"""MLA (DeepSeek-V3) export: onnxruntime and OpenVINO (HostRunner) against the PyTorch session, the keys-only
page compressor against the runtime's shared-value Mid segment, and a clear refusal of models
mixing MLA and plain attention layers."""

import onnx
import pytest
import torch

from kvtopo.config import Config
from kvtopo.kernels.quant import unpack
from kvtopo.models import zoo
from kvtopo.runtime.codecs import MidSegment, fit_bases
from kvtopo.runtime.layer_cache import best_tokens
from kvtopo.runtime.policies import ScoreInputs, make_policy

from export_common import CONFIG, assert_host_runner_matches_session, assert_openvino_supports_every_op, export_module

PROMPT, NEW = 256, 32
LATENT, ROPE = 32, 8  # the deepseek-v3 zoo model's kv_lora_rank and qk_rope_head_dim

CONFIGS = {
    # Recent windows short enough that a 256 + 32-token run has pages in every phase.
    "lossless": Config.lossless(page_size=16, recent_tokens=64, prefill_chunk_size=64),
    "default": Config(recent_tokens=64),  # Config()'s coding
    # Small pages and a byte budget under which Mid pages are kept partly
    # (on this model's 40-dim latent: the exact pages and metadata alone hold ~20 KB).
    "budget": CONFIG.replace(layer_budget_bytes=22000),
}


@pytest.mark.parametrize("which", list(CONFIGS))
def test_mla_host_runner_matches_session(which, onnx_export, session_references):
    config = CONFIGS[which]
    out, paths = onnx_export("deepseek-v3", config, PROMPT + NEW)
    decode = onnx.load(paths["decode_step"])
    assert not any(op.domain not in ("", "ai.onnx") for op in decode.opset_import)
    # The cache is the latent + RoPE key, one kv-head per layer; no values, no per-head K/V.
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in decode.graph.input}
    assert inputs["exact_k_0"][0] == 1 and inputs["exact_k_0"][2] == LATENT + ROPE, inputs["exact_k_0"]
    assert not [n for n in inputs if n.startswith(("exact_v", "recent_v", "mid_v", "value_"))]
    assert [o.name for o in decode.graph.output] == ["logits", "new_k_0", "new_k_1", "queries_0", "queries_1"]
    if which == "default":
        assert_openvino_supports_every_op(paths)

    for runner in assert_host_runner_matches_session(session_references, "deepseek-v3", out, config, PROMPT,
                                                     NEW).values():
        pages = [p for layer in runner.layers for p in layer.pages]
        assert {p.phase.value for p in pages} == {"initial", "mid", "recent", "terminal"}
        kept = [p.kept for p in pages if p.kept is not None]
        if which == "lossless":
            assert all(p.keys is not None for p in pages)  # nothing encoded
        else:
            assert any(p.recent is not None and p.recent.values is None for p in pages)  # Recent codes of the keys only
        if which == "budget":
            assert any(0 < k < config.page_size for k in kept), kept  # the prompt's chunks share the cap by tokens


@pytest.fixture(scope="module")
def shared_compressor(tmp_path_factory):
    onnx_export = export_module("onnx_export")
    layout = export_module("layout").CacheLayout.build(
        CONFIG, 256, layer_names=["l0"], scales=[0.25], heads=4, kv_heads=1, head_dim=20, value_head_dim=16,
        vocab_size=32, shared_value_dim=16)
    module, args, ep = onnx_export.compressor_program(layout)
    path = tmp_path_factory.mktemp("mla_compressor") / "compressor.onnx"
    onnx_export._to_onnx(ep, args, path, list(module.INPUTS), list(module.OUTPUTS))
    return layout, module, path


@pytest.mark.parametrize("keep", [3, 11, 16])
def test_shared_value_compressor_matches_runtime(shared_compressor, keep):
    import onnxruntime as ort

    layout, module, path = shared_compressor
    assert [i.name for i in onnx.load(str(path)).graph.input] == list(module.INPUTS)
    g = torch.Generator().manual_seed(keep)
    P, R = layout.page_size, layout.rank_capacity
    keys = torch.randn(1, P, 20, generator=g) * 2 + torch.randn(1, 1, 20, generator=g)
    bases = fit_bases(torch.randn(1, 200, 20, generator=g) @ torch.randn(20, 20, generator=g), 0.9)
    queries = (torch.randn(4, layout.observation_window, 20, generator=g) * 3).half().float()
    feeds = {"keys": keys, "queries": queries, "num_queries": torch.tensor(queries.shape[1]),
             "keep": torch.tensor(keep), "scale": torch.tensor(0.25),
             "key_vectors": torch.nn.functional.pad(bases.vectors, (0, R - bases.vectors.shape[-1])),
             "key_mean": bases.mean}
    out = dict(zip(module.OUTPUTS, ort.InferenceSession(str(path)).run(None, {k: v.numpy() for k, v in feeds.items()})))

    # What runtime.layer_cache does for an MLA layer: score keys, keep the top `keep`, code keys only.
    policy = make_policy(CONFIG)
    segment = MidSegment(policy.mid_encoding(), bases, None, torch.float32, shared_value_dim=16)
    scores = policy.score(ScoreInputs(keys, keys[..., :16], queries.half(), 0.25))
    kept = best_tokens(scores, keep)
    segment.append_page(keys.gather(1, kept[..., None].expand(-1, -1, 20)), None)
    assert segment.values.count == 0

    rank = bases.ranks[0]
    assert (out["kept"][:, :keep] == kept.numpy()).all()
    codes = unpack(torch.from_numpy(out["key_codes"]), 4, R)[0, :keep, :rank]
    assert torch.equal(codes, unpack(segment.keys.rows, segment.keys.bits, segment.keys.length))
    assert torch.equal(torch.from_numpy(out["key_scale"])[0, :rank], segment.keys.scale.float()[0])
    assert out["stats_f16"].shape == (1,)


def test_mixed_mla_and_plain_layers_are_refused():
    decode_step = export_module("decode_step")
    model = zoo.build("deepseek-v3")
    captured = decode_step.capture(model)
    captured.sites.append(captured.sites[0].site)  # the same layer seen as plain per-head attention
    with pytest.raises(NotImplementedError, match="same shapes"):
        decode_step.layout_for(model, captured, CONFIG, 64)
