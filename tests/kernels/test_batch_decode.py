"""One decode call for a batch of sequences (``decode_attention_batch``) equals each sequence on
its own: every row within the float32 bound of the float64 reference on that sequence's stored
codes, and close to the one-sequence call, for batches whose sequences differ in length and in
which phases they hold (with or without Mid, projected or unprojected Mid, Mid epochs, empty
Recent), with GQA, softcap, one or two threads, and without the C kernel (torch fallback)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo.kernels import cpu_decode, fast_decode
from kvtopo.kernels.decode_reference import reference_decode

from decode_bound import capped_bound
from segments import synthetic_segments


@st.composite
def batches(draw):
    """Sequences sharing one layer's shape and Recent encoding, each with its own phases."""
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 4]))
    d = draw(st.sampled_from([32, 64]))
    page = draw(st.sampled_from([4, 8]))
    recent_bits, mid_bits = draw(st.sampled_from([4, 8])), draw(st.sampled_from([2, 4, 8]))
    sequences = []
    for _ in range(draw(st.integers(1, 5))):
        exact = draw(st.sampled_from([0, 1, 5, 17]))
        recent_pages = draw(st.integers(0, 2))
        mid_rows = tuple(draw(st.lists(st.integers(0, page), min_size=0, max_size=30))) or (0,)
        if exact + recent_pages + sum(mid_rows) == 0:
            exact = 1
        sequences.append(dict(
            kv_heads=kv_heads, group=group, dk=d, dv=d, exact=exact, recent_pages=recent_pages, page_size=page,
            mid_page_rows=mid_rows, recent_bits=recent_bits, mid_bits=mid_bits,
            projected=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
            exact_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16]))))
    return sequences


def _queries(segs, hq: int, d: int, seed: int, gain: float = 1.0):
    return gain * torch.randn(len(segs), hq, d, generator=torch.Generator().manual_seed(seed))


def _with_epoch(segs, seed: int):
    """The segments with one more (earlier) Mid epoch, as topo keeps after a refit."""
    epoch = synthetic_segments(kv_heads=segs.kv_heads, group=1, dk=64, dv=64, exact=0, recent_pages=0,
                               mid_page_rows=(8, 5) * 40, seed=seed).mid
    return dataclasses.replace(segs, retired=(epoch,))


def _check_rows(q, segs, out, scale, softcap):
    for b, s in enumerate(segs):
        ref = reference_decode(q[b], s, scale, softcap=softcap)
        err = (out[b].double() - ref).abs().max().item()
        bound = capped_bound(q[b], s, scale, softcap)
        assert err <= bound, (b, err, bound)
        alone = fast_decode.decode_attention(q[b], s, scale, softcap=softcap)
        torch.testing.assert_close(out[b], alone, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


@settings(max_examples=40, deadline=None)
@given(cases=batches(), threads=st.sampled_from([1, 2]), softcap=st.sampled_from([None, 5.0]))
def test_batch_rows_match_float64_reference_and_single_calls(cases, threads, softcap):
    segs = [synthetic_segments(**case) for case in cases]
    q = _queries(segs, cases[0]["kv_heads"] * cases[0]["group"], cases[0]["dk"], cases[0]["seed"], gain=3.0)
    scale = cases[0]["dk"] ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = fast_decode.decode_attention_batch(q, segs, scale, softcap=softcap)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (len(segs), q.shape[1], cases[0]["dv"]) and torch.isfinite(out).all()
    _check_rows(q, segs, out, scale, softcap)


def _mixed_batch():
    """Long and short sequences: several 1024-row splits, one page of Mid, no Mid, a Mid epoch."""
    common = dict(kv_heads=2, group=4, dk=64, dv=64, page_size=8)
    segs = [
        synthetic_segments(**common, exact=9, recent_pages=2, mid_page_rows=(8, 7, 8) * 100, seed=1),
        synthetic_segments(**common, exact=3, recent_pages=0, mid_page_rows=(5,), seed=2, projected=False),
        synthetic_segments(**common, exact=33, recent_pages=1, mid_page_rows=(0,), seed=3),
        _with_epoch(synthetic_segments(**common, exact=1, recent_pages=2, mid_page_rows=(8,) * 200, seed=4,
                                       projected=False), seed=5),
    ]
    return segs, _queries(segs, 8, 64, seed=6, gain=3.0), 0.125


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_mixed_lengths_and_codings(softcap):
    segs, q, scale = _mixed_batch()
    out = fast_decode.decode_attention_batch(q, segs, scale, softcap=softcap)
    _check_rows(q, segs, out, scale, softcap)


def test_rows_are_independent_of_their_batch():
    """A sequence's row does not depend on which sequences share its batch (padding is masked)."""
    segs, q, scale = _mixed_batch()
    out = fast_decode.decode_attention_batch(q, segs, scale)
    pair = fast_decode.decode_attention_batch(q[[3, 1]], [segs[3], segs[1]], scale)
    torch.testing.assert_close(pair, out[[3, 1]], rtol=1e-6, atol=1e-6)


def test_fallback_without_c_kernel_equals_c_kernel(monkeypatch):
    assert cpu_decode.c_kernel_available()
    segs, q, scale = _mixed_batch()
    fast = fast_decode.decode_attention_batch(q, segs, scale, softcap=20.0)
    monkeypatch.setattr(cpu_decode, "mid_kernel", lambda: None)
    slow = fast_decode.decode_attention_batch(q, segs, scale, softcap=20.0)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5 * slow.abs().max().item())


def test_recent_codes_of_one_batch_may_differ_in_encoding(monkeypatch):
    """The kernel reads each sequence's Recent codes on their own; the torch fallback decodes a
    batch's Recent codes at once, so there they must share their encoding."""
    common = dict(kv_heads=1, group=1, dk=32, dv=32, exact=1, recent_pages=1, mid_page_rows=(0,))
    segs = [synthetic_segments(**common, recent_bits=8), synthetic_segments(**common, recent_bits=4)]
    q = torch.randn(2, 1, 32)
    _check_rows(q, segs, fast_decode.decode_attention_batch(q, segs, 0.2), 0.2, None)
    monkeypatch.setattr(cpu_decode, "mid_kernel", lambda: None)
    with pytest.raises(ValueError, match="share bits"):
        fast_decode.decode_attention_batch(q, segs, 0.2)


def test_kernel_merge_equals_float64_merge():
    """``merge_parts`` (the kernel's merge of a batch's partials) against the log-sum-exp merge
    in float64: parts covering the whole batch or one sequence's rows, empty (-inf) rows whose
    out is garbage, and a row that no part sees (zeros)."""
    kernel = cpu_decode.mid_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    batch, hq, dv = 3, 4, 8
    whole = [(torch.randn(batch, hq, dv, generator=gen), 5 * torch.randn(batch, hq, generator=gen)) for _ in range(2)]
    whole[1][1][0, :2] = -float("inf")
    whole[1][0][0, :2] = float("nan")  # an empty part's out is never read
    own = [(b, torch.randn(hq, dv, generator=gen), 5 * torch.randn(hq, generator=gen)) for b in (0, 2, 2)]
    for _, lse in whole:
        lse[1, 3] = -float("inf")  # sequence 1, head 3: no part sees it
    merged = torch.empty(batch * hq, dv)
    kernel.merge_parts([o for o, _ in whole] + [o for _, o, _ in own], [l for _, l in whole] + [l for _, _, l in own],
                       [0] * len(whole) + [b * hq for b, _, _ in own], merged)
    lse = torch.stack([l.double() for _, l in whole] + [_on_rows(l, b, batch).double() for b, _, l in own])
    out = torch.stack([o.double().nan_to_num() for o, _ in whole] + [_on_rows(o, b, batch).double() for b, o, _ in own])
    weight = torch.exp(lse - lse.amax(0).nan_to_num(neginf=0.0)).nan_to_num()
    expected = (weight[..., None] * out).sum(0) / weight.sum(0)[..., None]
    expected[1, 3] = 0.0
    torch.testing.assert_close(merged.view(batch, hq, dv).double(), expected, rtol=1e-5, atol=1e-6)


def _on_rows(part: torch.Tensor, b: int, batch: int) -> torch.Tensor:
    """One sequence's part [Hq, ...] placed at row b of a batch, -inf / 0 elsewhere."""
    fill = -float("inf") if part.dim() == 1 else 0.0
    placed = part.new_full((batch, *part.shape), fill)
    placed[b] = part
    return placed


def _with_statistics(segs, dtype):
    """The segments with every Mid and Recent statistic rounded to float16, held as `dtype`."""
    def cast(codes, names):
        return dataclasses.replace(codes, **{n: getattr(codes, n).half().to(dtype) for n in names})

    out = []
    for s in segs:
        mids = ("k_scale", "k_offset", "v_scale", "v_offset")
        out.append(dataclasses.replace(
            s, mid=cast(s.mid, mids) if s.mid is not None else None,
            retired=tuple(cast(m, mids) for m in s.retired),
            recent=cast(s.recent, mids) if s.recent is not None else None))
    return out


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_float16_statistics_are_read_as_their_float32_values(softcap):
    """The store keeps statistics in float16 and the kernel reads them so (widening as it goes):
    the same output, bit for bit, as the same values handed over in float32."""
    segs, q, scale = _mixed_batch()
    half = _with_statistics(segs, torch.float16)
    assert half[0].mid.k_scale.dtype == torch.float16 and half[3].retired[0].v_scale.dtype == torch.float16
    out = fast_decode.decode_attention_batch(q, half, scale, softcap=softcap)
    assert torch.equal(out, fast_decode.decode_attention_batch(q, _with_statistics(segs, torch.float32), scale,
                                                               softcap=softcap))
    _check_rows(q, half, out, scale, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_begin_step_equals_its_torch_ops(dtype):
    """``begin_step`` (a decode batch's writes in one call) against the torch ops it replaces:
    tokens copied into pool rows, rows and counts advanced, the query scaled into float32 and
    kept as float16, bit for bit; a row outside the pool is refused before anything is written."""
    kernel = cpu_decode.mid_kernel()
    gen = torch.Generator().manual_seed(3)
    B, hq, hkv, d, rows = 3, 6, 2, 16, 40
    q = torch.randn(B, 1, hq, d, generator=gen).to(dtype).transpose(1, 2)  # as a model hands it: strided
    k, v = (torch.randn(B, 1, hkv, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(2))
    pool_k, pool_v = (torch.randn(rows, d, generator=gen).to(dtype) for _ in range(2))
    next_rows = torch.tensor([[0, 7], [12, 30], [39, 5]])
    ints, exact_at = torch.tensor([4, 9, 2, 8, 1]), torch.tensor([0, 3, 4])
    qs, ring, scale = torch.empty(B, hq, d), torch.empty(B, hq, d, dtype=torch.float16), 0.3
    want_k, want_v, want_ints = pool_k.clone(), pool_v.clone(), ints.clone()
    want_k.index_copy_(0, next_rows.reshape(-1), k.reshape(B * hkv, d))
    want_v.index_copy_(0, next_rows.reshape(-1), v.reshape(B * hkv, d))
    want_ints.index_add_(0, exact_at, torch.ones(B, dtype=torch.long))
    want_qs = torch.empty(B, hq, d).copy_(q[:, :, 0]).mul_(scale)
    want_ring = torch.empty_like(ring).copy_(q[:, :, 0])
    kernel.begin_step(q, scale, qs, k, v, pool_k, pool_v, next_rows, ints, exact_at, ring)
    for got, want in ((pool_k, want_k), (pool_v, want_v), (ints, want_ints), (qs, want_qs), (ring, want_ring)):
        assert torch.equal(got, want)
    assert torch.equal(next_rows, torch.tensor([[1, 8], [13, 31], [40, 6]]))
    before = pool_k.clone(), pool_v.clone(), ints.clone()
    with pytest.raises(RuntimeError, match="outside the pool"):  # row 40 of 40
        kernel.begin_step(q, scale, qs, k, v, pool_k, pool_v, next_rows, ints, exact_at, None)
    assert all(torch.equal(a, b) for a, b in zip((pool_k, pool_v, ints), before))
