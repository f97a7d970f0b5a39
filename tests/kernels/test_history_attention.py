"""A prefill chunk's attention to the stored history (``history_attention`` on CPU: tiles of
stored tokens dequantized one at a time) matches the float64 reference over the same codes, for
every kind of segment, tiles smaller than every segment, several query tokens and softcapping;
and a compressed session's chunked prefill reads its history this way (never decoding it whole)
with the result of the torch reference over the decoded history."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvtopo
from kvtopo.kernels import history_attention as history_module
from kvtopo.kernels.compressed_attention import merge_partials
from kvtopo.kernels.decode_inputs import DecodeSegments, PagedExact
from kvtopo.kernels.decode_reference import reference_history
from kvtopo.kernels.history_attention import history_attention
from kvtopo.models import zoo
from kvtopo.runtime import session as session_module
from kvtopo.runtime.layer_cache import LayerCache

from segments import synthetic_segments


def _paged_beside(segs: DecodeSegments, page: int, tokens: int, seed: int) -> DecodeSegments:
    """segs with `tokens` exact tokens in a page pool (slots out of order) before its explicit ones."""
    heads, _, dk = segs.exact[0].shape
    dv = segs.exact[1].shape[-1]
    g = torch.Generator().manual_seed(seed)
    pages = -(-tokens // page)
    slots = torch.randperm(pages + 3, generator=g)[:pages].to(torch.int32)
    pool_k = torch.randn(pages + 3, heads, page, dk, generator=g)
    pool_v = torch.randn(pages + 3, heads, page, dv, generator=g)
    return dataclasses.replace(segs, exact_pages=PagedExact(pool_k, pool_v, slots, tokens))


CASES = {
    "projected": dict(kv_heads=2, group=4, dk=32, dv=32, exact=5, recent_pages=2, page_size=4,
                      mid_page_rows=(4, 1, 3, 4, 2), seed=1),
    "unprojected": dict(kv_heads=3, group=3, dk=16, dv=16, exact=3, recent_pages=1, page_size=4,
                        mid_page_rows=(4, 4, 2, 3), projected=False, seed=2),
    "mid_only": dict(kv_heads=1, group=8, dk=16, dv=16, exact=0, recent_pages=0, page_size=4,
                     mid_page_rows=(4, 3, 4), seed=3),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("tile", [3, 1024])
def test_history_matches_float64_reference(case, tokens, softcap, tile, monkeypatch):
    monkeypatch.setattr(history_module, "TILE_TOKENS", tile)
    segs = synthetic_segments(**CASES[case])
    if segs.exact is not None:
        segs = _paged_beside(segs, page=4, tokens=10, seed=tokens)
    retired = synthetic_segments(**{**CASES[case], "exact": 0, "recent_pages": 0, "seed": 9}).mid
    segs = dataclasses.replace(segs, retired=(retired,))  # an earlier Mid epoch, coded
    heads = segs.kv_heads * CASES[case]["group"]
    q = torch.randn(heads, tokens, CASES[case]["dk"], generator=torch.Generator().manual_seed(tokens))
    out, lse = history_attention(q, segs, 0.3, softcap)
    ref_out, ref_lse = reference_history(q, segs, 0.3, softcap=softcap)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert (out.double() - ref_out).abs().max().item() < 2e-5 * ref_out.abs().max().item()
    assert (lse.double() - ref_lse).abs().max().item() < 2e-5 * ref_lse.abs().max().item()


def test_empty_history_is_refused():
    with pytest.raises(ValueError, match="empty history"):
        history_attention(torch.randn(4, 2, 16), DecodeSegments(), 0.25)


@pytest.mark.parametrize("config", [kvtopo.Config(), kvtopo.Config(target_ratio=None, mid_bits=4)])
def test_chunked_prefill_reads_the_history_as_stored(config, monkeypatch):
    """A 4-chunk compressed prefill: every chunk after the first attends its history through
    history_attention (LayerCache.segments, the whole history decoded, never runs), and its
    output equals the torch reference over the decoded history (the previous way)."""
    torch.manual_seed(0)
    model = zoo.build("llama").eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 384))
    compiled = kvtopo.compile(model, inductor=False)
    checked = []
    attend_stored = session_module.Session._attend_one

    def compare(self, cache, seq, q, k, v, scale, softcap, sinks=None, prompt_end=0):
        if cache.length(seq) and q.shape[1] > 1:
            segments = cache.segments(seq)
            parts = session_module._history_partials(q, segments, scale, softcap)
            causal = session_module.chunk_causal_mask(0, q.shape[1], device=q.device)
            before = merge_partials(parts + [session_module.partial_dense(q, k, v, scale, causal, softcap)])
            with monkeypatch.context() as inner:
                inner.setattr(LayerCache, "segments", _never)
                out = attend_stored(self, cache, seq, q, k, v, scale, softcap, sinks, prompt_end)
            checked.append((out.float() - before).abs().max().item() / before.abs().max().item())
            return out
        return attend_stored(self, cache, seq, q, k, v, scale, softcap, sinks, prompt_end)

    monkeypatch.setattr(session_module.Session, "_attend_one", compare)
    with kvtopo.session(config) as s:
        kvtopo.generate(compiled, ids, 1, prefill_chunk_size=96, progress=False)
        assert s.stats().ratio_vs_fp16 > 1.1  # the history was compressed
    assert len(checked) == 3 * model.config.num_hidden_layers
    assert max(checked) < 1e-5


def _never(self, seq):
    raise AssertionError("the history was decoded whole")
