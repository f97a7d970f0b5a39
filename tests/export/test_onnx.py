"""ONNX export: onnxruntime and OpenVINO (HostRunner) against the PyTorch session, every op of
both graphs supported by OpenVINO's CPU device, and the exp-free compressor."""

from pathlib import Path

import onnx
import onnx.inliner
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kvtopo.kernels.quant import unpack
from kvtopo.runtime.codecs import MidSegment, fit_bases
from kvtopo.runtime.lifecycle import BudgetExceeded
from kvtopo.runtime.layer_cache import best_tokens
from kvtopo.export.host_runner import HostRunner
from kvtopo.runtime.policies import ScoreInputs, make_policy

from export_common import (CONFIG, assert_host_runner_matches_session, assert_openvino_supports_every_op,
                           export_module, export_package)

EXPONENTIAL_OPS = {"Exp", "Softmax", "LogSoftmax", "Sigmoid", "Tanh", "Erf"}
PROMPT, NEW = 256, 32


def _op_types(model: onnx.ModelProto) -> set[str]:
    inlined = onnx.inliner.inline_local_functions(model)
    types = set()

    def walk(graph):
        for node in graph.node:
            types.add(node.op_type)
            for attr in node.attribute:
                if attr.g.node:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)
    walk(inlined.graph)
    return types


@pytest.mark.parametrize("name", ["llama", "qwen3-moe"])
def test_host_runner_matches_session(name, onnx_export, session_references):
    out, paths = onnx_export(name, CONFIG, PROMPT + NEW)
    for key in ("decode_step", "compressor"):
        onnx.checker.check_model(onnx.load(paths[key]), full_check=True)
        assert not any(op.domain not in ("", "ai.onnx") for op in onnx.load(paths[key]).opset_import)
    assert_openvino_supports_every_op(paths)

    runners = assert_host_runner_matches_session(session_references, name, out, CONFIG, PROMPT, NEW)
    for runner in runners.values():
        assert_every_phase_and_partial_eviction(runner)
    runner = runners["onnxruntime"]
    # The graphs hold one basis set per layer: the export records no refits, and a config that
    # would refit within the exported max_context is refused rather than run differently.
    assert runner.config.refit_after is None
    with pytest.raises(ValueError, match="refit_after"):
        HostRunner(out, config=CONFIG.replace(refit_after=64))
    # Its compressor ranks one page at a time: joint eviction over an append is refused likewise.
    assert runner.config.eviction_scope == "page"
    with pytest.raises(ValueError, match="eviction_scope"):
        HostRunner(out, config=CONFIG.replace(refit_after=None, eviction_scope="append"))
    # Its decode step's Recent capacity is fixed: pages waiting there for a prompt's end likewise.
    assert runner.config.prompt_hold_tokens == 0
    with pytest.raises(ValueError, match="prompt_hold_tokens"):
        HostRunner(out, config=CONFIG.replace(refit_after=None, eviction_scope="page", prompt_hold_tokens=256))


def test_host_runner_refuses_bad_input_and_goes_no_further_after_a_chunk_stored_in_part(onnx_export):
    """Before: a [2, T] batch ran as one sequence of 2T tokens, id -1 as id V - 1, float ids
    truncated; max_pages was ignored; and a chunk a budget stopped left some layers holding it, so
    the next forward crashed inside the lifecycle."""
    out, _ = onnx_export("llama", CONFIG, PROMPT + NEW)
    runner = HostRunner(out)
    vocab = runner.layout.vocab_size
    for bad, reason in (([[1, 2], [3, 4]], "batch 1"), ([], "at least one token"), ([-1, 2], "outside the vocabulary"),
                        ([vocab], "outside the vocabulary"), ([1.9, 2.0], "integer token ids")):
        with pytest.raises(ValueError, match=reason):
            runner.forward(bad)
    with pytest.raises(ValueError, match="at least 1"):
        runner.generate([1, 2, 3], max_new_tokens=0)
    with pytest.raises(ValueError, match="max_pages"):
        HostRunner(out, config=runner.config.replace(max_pages=4))
    strict = HostRunner(out, config=runner.config.replace(target_ratio=None, layer_budget_bytes=9000, over_budget="raise"))
    ids = torch.randint(0, vocab, (200,), generator=torch.Generator().manual_seed(1)).numpy()
    with pytest.raises(BudgetExceeded):
        for start in range(0, 200, 64):
            strict.forward(ids[start:start + 64], prompt_end=200)
    with pytest.raises(RuntimeError, match="stored in part.*BudgetExceeded.*reset"):
        strict.forward(ids[:1])
    strict.reset()
    assert strict.forward(ids[:8]).shape == (8, vocab)


def assert_every_phase_and_partial_eviction(runner):
    """Every phase really occurred, and eviction kept Mid pages partly. (A prompt's chunks share the
    byte cap by tokens, budgeted at the prompt's end as the session does: before that, the first
    chunks' pages were kept whole and the last ones' not at all.)"""
    phases = {p.phase.value for layer in runner.layers for p in layer.pages}
    assert phases == {"initial", "mid", "recent", "terminal"}, runner.executor.runtime
    kept = [p.kept for layer in runner.layers for p in layer.pages if p.kept is not None]
    assert any(0 < k < CONFIG.page_size for k in kept), kept


@pytest.fixture(scope="module")
def compressor_file(onnx_export):
    """The zoo Llama export's page compressor (4 heads, 2 kv-heads, head dim 16, scale 0.25: the
    shapes of the pages below), the file test_host_runner_matches_session runs: (layout, the
    module, the file's path)."""
    _, paths = onnx_export("llama", CONFIG, PROMPT + NEW)
    layout = export_module("layout").CacheLayout.from_json(Path(paths["layout"]).read_text())
    assert (layout.heads, layout.kv_heads, layout.head_dim, layout.scales[0]) == (4, 2, 16, 0.25)
    return layout, export_module("onnx_export").compressor_module(layout), paths["compressor"]


def _runtime_compress(keys, values, queries, keep, scale, kb, vb):
    """What runtime.layer_cache does to a page entering Mid: policy score, top-k, MidSegment."""
    policy = make_policy(CONFIG)
    segment = MidSegment(policy.mid_encoding(), kb, vb, torch.float32)
    if keep < keys.shape[1]:
        scores = policy.score(ScoreInputs(keys, values, queries.half(), scale))
        kept = best_tokens(scores, keep)
    else:
        kept = torch.arange(keys.shape[1]).expand(keys.shape[0], -1)
    segment.append_page(keys.gather(1, kept[..., None].expand(-1, -1, 16)), values.gather(1, kept[..., None].expand(-1, -1, 16)))
    k, v = segment.keys, segment.values
    return kept, unpack(k.rows, k.bits, k.length), unpack(v.rows, v.bits, v.length), k.scale.float(), v.scale.float()


def _per_head(codes_packed, bases, keep):
    """Compressor codes [Hkv, P, R/2] (per head, padded) -> the runtime's [keep, sum of ranks]."""
    codes = unpack(torch.from_numpy(codes_packed), 4, codes_packed.shape[-1] * 2)[:, :keep]  # [Hkv, keep, R]
    return torch.cat([codes[h, :, :r] for h, r in enumerate(bases.ranks)], dim=1)


@pytest.mark.parametrize("seed", range(6))
def test_compressor_matches_runtime(compressor_file, seed):
    import onnxruntime as ort

    layout, module, path = compressor_file
    g = torch.Generator().manual_seed(seed)
    P, R = layout.page_size, layout.rank_capacity
    keys = torch.randn(2, P, 16, generator=g) * 2 + torch.randn(2, 1, 16, generator=g)
    values = torch.randn(2, P, 16, generator=g)
    history_k, history_v = torch.randn(2, 200, 16, generator=g) @ torch.randn(16, 16, generator=g), torch.randn(2, 200, 16, generator=g)
    kb, vb = fit_bases(history_k, 0.9), fit_bases(history_v, 0.9)
    # Observation queries as the session holds them (float16), keep = 1 .. P.
    queries = (torch.randn(4, layout.observation_window, 16, generator=g) * 3).half().float()
    keep = [1, 5, 9, 12, 15, P][seed]
    pad = lambda b: torch.nn.functional.pad(b.vectors, (0, R - b.vectors.shape[-1]))  # noqa: E731
    feeds = {"keys": keys, "values": values, "queries": queries, "num_queries": torch.tensor(queries.shape[1]),
             "keep": torch.tensor(keep), "scale": torch.tensor(0.25), "key_vectors": pad(kb), "key_mean": kb.mean,
             "value_vectors": pad(vb), "value_mean": vb.mean}
    sess = ort.InferenceSession(str(path))
    out = sess.run(None, {k: v.numpy() for k, v in feeds.items()})
    eager = [t.numpy() for t in module(*feeds.values())]
    kept, k_codes, v_codes, k_scale, v_scale = _runtime_compress(keys, values, queries, keep, 0.25, kb, vb)

    for got in (out, eager):
        assert (got[0][:, :keep] == kept.numpy()).all()
        assert torch.equal(_per_head(got[1], kb, keep), k_codes)
        assert torch.equal(_per_head(got[4], vb, keep), v_codes)
        cols = lambda s, b: torch.cat([torch.from_numpy(s)[h, :r] for h, r in enumerate(b.ranks)])  # noqa: E731
        assert torch.equal(cols(got[2], kb), k_scale[0]) and torch.equal(cols(got[5], vb), v_scale[0])


def test_compressor_ties_go_to_lower_index(compressor_file):
    layout, module, _ = compressor_file
    kept = export_module("compressor").select_kept(torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0]]), torch.tensor(4))
    assert kept.tolist() == [[0, 1, 2, 4, 0, 0]]


def test_compressor_onnx_is_exponential_free(compressor_file):
    _, _, path = compressor_file
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    types = _op_types(model)
    assert not types & EXPONENTIAL_OPS, types & EXPONENTIAL_OPS
    assert {"MatMul", "Relu", "ReduceMax"} <= types, types  # the score really is in the graph


class _DropoutAttention(nn.Module):
    """An attention kvtopo refuses (training dropout): export must say so."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 32)
        self.qkv = nn.Linear(32, 96)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        q, k, v = self.qkv(self.embed(input_ids)).view(1, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return (F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).sum(1),)


def test_refused_sites_are_listed(tmp_path):
    kx = export_package()
    with pytest.raises(ValueError, match="refused") as err:
        kx.export_onnx(_DropoutAttention().eval(), tmp_path, config=CONFIG, max_context=64)
    assert "dropout" in str(err.value)
