"""Compressed-domain attention equals attention on explicitly reconstructed K/V, and segments
merge into exactly one softmax over the concatenated cache (float64 references)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo.kernels import compressed_attention
from kvtopo.kernels.compressed_attention import (
    LowRankHeads,
    merge_partials,
    partial_causal,
    partial_dense,
    partial_lowrank,
    stack_heads,
)
from kvtopo.kernels.directions import Basis, principal_basis, project
from kvtopo.kernels.quant import dequantize, quantize

D, DV = 16, 12


def reference(q, k, v, scale, mask=None):
    """float64 attention with GQA by repeat_interleave: out [Hq, T, dv], lse [Hq, T]."""
    g = q.shape[0] // k.shape[0]
    k = k.double().repeat_interleave(g, 0)
    v = v.double().repeat_interleave(g, 0)
    logits = scale * q.double() @ k.transpose(1, 2)
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)  # all-masked rows: 0
    return p @ v, lse


def assert_matches(actual, expected, rel=1e-5):
    out, lse = actual
    ref_out, ref_lse = expected
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=rel, atol=rel * ref_out.abs().max().item())
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], rtol=rel, atol=rel)


def random_side(g, kv_heads, n, dim, ranks):
    """Per-head orthonormal bases of the given ranks, means and coefficients."""
    bases, coefficients = [], []
    for r in ranks:
        vectors = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0][:, :r]
        bases.append(Basis(vectors=vectors.contiguous(), mean=torch.randn(dim, generator=g)))
        coefficients.append(3.0 * torch.randn(n, r, generator=g))
    return coefficients, bases


def reconstructed(coefficients, bases):
    """Explicit K or V [Hkv, N, dim] in float64 from the same coefficients."""
    return torch.stack([c.double() @ b.vectors.double().T + b.mean.double() for c, b in zip(coefficients, bases)])


@settings(max_examples=40, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    t=st.integers(1, 5),
    n=st.integers(1, 40),
    key_ranks=st.lists(st.integers(0, D), min_size=3, max_size=3),
    value_ranks=st.lists(st.integers(0, DV), min_size=3, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_lowrank_equals_attention_on_reconstructed_kv(kv_heads, groups, t, n, key_ranks, value_ranks, seed):
    g = torch.Generator().manual_seed(seed)
    kc, kb = random_side(g, kv_heads, n, D, key_ranks[:kv_heads])
    vc, vb = random_side(g, kv_heads, n, DV, value_ranks[:kv_heads])
    q = torch.randn(kv_heads * groups, t, D, generator=g)
    scale = 1 / math.sqrt(D)
    actual = partial_lowrank(q, stack_heads(kc, kb), stack_heads(vc, vb), scale)
    assert_matches(actual, reference(q, reconstructed(kc, kb), reconstructed(vc, vb), scale))


def test_padding_coefficients_are_ignored():
    g = torch.Generator().manual_seed(1)
    kc, kb = random_side(g, 2, 30, D, [3, 9])
    vc, vb = random_side(g, 2, 30, DV, [7, 1])
    keys, values = stack_heads(kc, kb), stack_heads(vc, vb)
    assert keys.coefficients.shape == (2, 30, 9) and values.coefficients.shape == (2, 30, 7)
    assert torch.all(keys.vectors[0, :, 3:] == 0) and torch.all(values.vectors[1, :, 1:] == 0)

    def with_garbage(side, ranks):
        c = side.coefficients.clone()
        for h, r in enumerate(ranks):
            c[h, :, r:] = 1e3 * torch.randn(c.shape[1], c.shape[2] - r, generator=g)
        return LowRankHeads(coefficients=c, vectors=side.vectors, mean=side.mean)

    q = torch.randn(4, 3, D, generator=g)
    clean = partial_lowrank(q, keys, values, 0.25)
    dirty = partial_lowrank(q, with_garbage(keys, [3, 9]), with_garbage(values, [7, 1]), 0.25)
    torch.testing.assert_close(dirty, clean, rtol=1e-6, atol=1e-6)


def test_stack_heads_rejects_mismatched_inputs():
    g = torch.Generator().manual_seed(2)
    c, b = random_side(g, 2, 10, D, [2, 3])
    with pytest.raises(ValueError, match="head 1"):
        stack_heads([c[0], c[1][:, :2]], b)
    with pytest.raises(ValueError, match="one basis per head"):
        stack_heads(c, b[:1])


def test_stored_bytes_are_the_true_ranks_and_pipeline_matches_reconstruction():
    """Runtime flow: per-head basis, 4-bit coefficients stored at true rank, dequantize, attend."""
    g = torch.Generator().manual_seed(3)
    n, kv_heads, groups = 64, 2, 2
    k = torch.randn(kv_heads, n, 4, generator=g) @ torch.randn(4, D, generator=g) + torch.randn(kv_heads, n, D, generator=g) * torch.tensor([0.05, 0.5]).view(2, 1, 1)
    v = torch.randn(kv_heads, n, DV, generator=g)
    stored, nbytes = {}, 0
    for side, x, bits, reduce_dim in (("k", k, 4, 0), ("v", v, 2, -1)):
        bases = [principal_basis(x[h], 0.9) for h in range(kv_heads)]
        codes = [quantize(project(x[h], b), bits, reduce_dim) for h, b in enumerate(bases)]
        nbytes += sum(c.nbytes for c in codes)
        stored[side] = ([dequantize(c) for c in codes], bases)
    key_ranks = [b.rank for b in stored["k"][1]]
    value_ranks = [b.rank for b in stored["v"][1]]
    assert key_ranks[0] < key_ranks[1]  # the noisier head needs more directions
    expected_bytes = sum(n * math.ceil(r / 2) + 2 * 2 * r for r in key_ranks) + sum(
        n * math.ceil(r / 4) + 2 * 2 * n for r in value_ranks
    )
    assert nbytes == expected_bytes

    q = torch.randn(kv_heads * groups, 3, D, generator=g)
    actual = partial_lowrank(q, stack_heads(*stored["k"]), stack_heads(*stored["v"]), 0.25)
    assert_matches(actual, reference(q, reconstructed(*stored["k"]), reconstructed(*stored["v"]), 0.25))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_dense_with_causal_chunk_mask(groups):
    g = torch.Generator().manual_seed(groups)
    kv_heads, past, t = 2, 5, 4
    q = torch.randn(kv_heads * groups, t, D, generator=g)
    k = torch.randn(kv_heads, past + t, D, generator=g)
    v = torch.randn(kv_heads, past + t, DV, generator=g)
    mask = torch.ones(t, past + t, dtype=torch.bool)
    mask[:, past:] = torch.ones(t, t, dtype=torch.bool).tril()
    assert_matches(partial_dense(q, k, v, 0.3, mask), reference(q, k, v, 0.3, mask))
    assert_matches(partial_dense(q, k, v, 0.3), reference(q, k, v, 0.3))


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dv", [D, DV])  # equal head sizes: aten's CPU flash attention; else the blocked softmax
@pytest.mark.parametrize("t", [1, 37])
def test_causal_chunk_and_unmasked_history_against_float64(groups, dv, t):
    """partial_causal (a chunk over itself) and unmasked partial_dense (a chunk over history),
    through whichever CPU path takes them, against float64."""
    g = torch.Generator().manual_seed(groups * t + dv)
    kv_heads = 2
    q = torch.randn(kv_heads * groups, t, D, generator=g) * 2
    k, v = torch.randn(kv_heads, t, D, generator=g) * 2, torch.randn(kv_heads, t, dv, generator=g)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    assert_matches(partial_causal(q, k, v, 0.3), reference(q, k, v, 0.3, causal))
    history_k, history_v = torch.randn(kv_heads, 50, D, generator=g), torch.randn(kv_heads, 50, dv, generator=g)
    assert_matches(partial_dense(q, history_k, history_v, 0.3), reference(q, history_k, history_v, 0.3))
    with pytest.raises(ValueError, match="as many keys as queries"):
        partial_causal(q, history_k, history_v, 0.3)


@pytest.mark.parametrize("dtype, rel", [(torch.bfloat16, 2.0 ** -7), (torch.float16, 2.0 ** -10)])
@pytest.mark.parametrize("keys_dtype", ["same", "float32"])  # exact pages / a dequantized Mid tile
@pytest.mark.parametrize("t, n", [(40, 300), (64, 320)])  # key counts off and on FLASH_KEY_GRANULE
def test_reduced_precision_queries_against_float64(dtype, rel, keys_dtype, t, n, monkeypatch):
    """A bfloat16 / float16 model's chunk: the CPU flash partials run in its dtype and come back
    float32, within that dtype's rounding of the float64 attention over the same keys and values
    rounded to it (exact pages are stored in it already; a float32 Mid tile is rounded, as the
    model's own attention would hold it)."""
    g = torch.Generator().manual_seed(7)
    kv_heads, groups = 3, 3
    q = (torch.randn(kv_heads * groups, t, D, generator=g) * 2).to(dtype)
    flash_calls = []  # (dtype, key count) of every flash call: reduced precision meets whole granules only
    flash = compressed_attention._cpu_flash
    monkeypatch.setattr(compressed_attention, "_cpu_flash",
                        lambda q, k, *rest: flash_calls.append((rest[-1], k.shape[1])) or flash(q, k, *rest))
    k, v = torch.randn(kv_heads, n, D, generator=g) * 2, torch.randn(kv_heads, n, D, generator=g)
    if keys_dtype == "same":
        k, v = k.to(dtype), v.to(dtype)
    out, lse = partial_dense(q, k, v, 0.3)
    k, v = k.to(dtype), v.to(dtype)
    ref_out, ref_lse = reference(q, k, v, 0.3)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=rel, atol=rel * ref_out.abs().max().item())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=rel, atol=rel)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    out, lse = partial_causal(q, k[:, :t], v[:, :t], 0.3)
    ref_out, ref_lse = reference(q, k[:, :t], v[:, :t], 0.3, causal)
    torch.testing.assert_close(out.double(), ref_out, rtol=rel, atol=rel * ref_out.abs().max().item())
    torch.testing.assert_close(lse.double(), ref_lse, rtol=rel, atol=rel)
    assert {call_dtype for call_dtype, _ in flash_calls} == ({dtype} if n % compressed_attention.FLASH_KEY_GRANULE == 0 else {dtype, torch.float32})
    assert all(count % compressed_attention.FLASH_KEY_GRANULE == 0 for call_dtype, count in flash_calls if call_dtype == dtype)


def test_empty_segments_give_minus_inf_and_zeros():
    q = torch.randn(4, 3, D)
    for out, lse in (
        partial_dense(q, torch.zeros(2, 0, D), torch.zeros(2, 0, DV), 0.25),
        partial_lowrank(
            q,
            LowRankHeads(torch.zeros(2, 0, 3), torch.zeros(2, D, 3), torch.zeros(2, D)),
            LowRankHeads(torch.zeros(2, 0, 3), torch.zeros(2, DV, 3), torch.ones(2, DV)),
            0.25,
        ),
    ):
        assert out.shape == (4, 3, DV) and torch.all(out == 0)
        assert lse.shape == (4, 3) and torch.all(lse == -math.inf)

    mask = torch.tensor([[False, False], [True, False], [True, True]])
    out, lse = partial_dense(q, torch.randn(2, 2, D), torch.randn(2, 2, DV), 0.25, mask)
    assert torch.all(out[:, 0] == 0) and torch.all(lse[:, 0] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, 1:]))


def test_query_heads_must_be_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="multiple"):
        partial_dense(torch.randn(3, 1, D), torch.randn(2, 4, D), torch.randn(2, 4, DV), 1.0)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_mixed_segments_merge_to_one_softmax_over_the_concatenation(groups):
    """Initial (exact) + Mid (low-rank) + Recent (int8) + empty + chunk (causal) == one softmax."""
    g = torch.Generator().manual_seed(10 + groups)
    kv_heads, t = 2, 3
    hq = kv_heads * groups
    scale = 1 / math.sqrt(D)
    q = 2.0 * torch.randn(hq, t, D, generator=g)

    sink_k, sink_v = torch.randn(kv_heads, 4, D, generator=g), torch.randn(kv_heads, 4, DV, generator=g)
    kc, kb = random_side(g, kv_heads, 50, D, [5, 11])
    vc, vb = random_side(g, kv_heads, 50, DV, [8, 2])
    recent_k = dequantize(quantize(torch.randn(kv_heads, 16, D, generator=g), 8, -1))
    recent_v = dequantize(quantize(torch.randn(kv_heads, 16, DV, generator=g), 8, -1))
    chunk_k, chunk_v = torch.randn(kv_heads, t, D, generator=g), torch.randn(kv_heads, t, DV, generator=g)
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    parts = [
        partial_dense(q, sink_k, sink_v, scale),
        partial_lowrank(q, stack_heads(kc, kb), stack_heads(vc, vb), scale),
        partial_dense(q, recent_k, recent_v, scale),
        partial_dense(q, torch.zeros(kv_heads, 0, D), torch.zeros(kv_heads, 0, DV), scale),
        partial_dense(q, chunk_k, chunk_v, scale, causal),
    ]
    merged = merge_partials(parts)

    all_k = torch.cat([sink_k.double(), reconstructed(kc, kb), recent_k.double(), chunk_k.double()], 1)
    all_v = torch.cat([sink_v.double(), reconstructed(vc, vb), recent_v.double(), chunk_v.double()], 1)
    past = all_k.shape[1] - t
    mask = torch.cat([torch.ones(t, past, dtype=torch.bool), causal], 1)
    ref_out, _ = reference(q, all_k, all_v, scale, mask)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), ref_out, rtol=1e-5, atol=1e-5 * ref_out.abs().max().item())


def test_merge_rows_no_segment_sees_are_zero():
    q = torch.randn(2, 2, D)
    mask = torch.tensor([[False, False], [True, True]])
    k, v = torch.randn(1, 2, D), torch.randn(1, 2, DV)
    empty = partial_dense(q, torch.zeros(1, 0, D), torch.zeros(1, 0, DV), 1.0)
    merged = merge_partials([partial_dense(q, k, v, 1.0, mask), empty])
    assert torch.all(merged[:, 0] == 0)
    torch.testing.assert_close(merged[:, 1].double(), reference(q, k, v, 1.0)[0][:, 1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])
