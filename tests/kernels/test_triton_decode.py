"""Triton decode kernels (run by the Triton interpreter on CPU) match a float64 reference.

The reference decodes the *same stored data* (codes and statistics) to explicit K/V in float64
and takes one softmax over all segments, so the only differences are float32 rounding in the
kernels. Error bound (checked elementwise, per example), with u = 2**-24 the float32 unit
roundoff, L = max over (query head, token) of scale * sum_i |q_i k_i| (the logit's absolute
mass), N the tokens attended and V = max |v|:
  * each logit is a float32 dot of length d (plus dequantization, one rounding per code, and
    for Mid the projection q @ B, another length-d dot): error <= (2d + 8) u L;
  * a logit error delta changes every softmax weight by a factor within exp(+-2 delta), so the
    output moves by <= (exp(2 delta) - 1) V ~ 2 delta V;
  * the weighted sums (online softmax over blocks, split merge) add <= (N + 64) u V.
  So |out - ref| <= 4 u ((2d + 8) L + N + 64) V, with a factor 2 of slack over the first-order
  sum. Observed errors are ~1e-7 relative, far inside it.
Every output element is written: the output buffer and every scratch buffer are filled with NaN
first, and the result must be finite.
"""

from __future__ import annotations

import dataclasses
import math

from triton_interpreter import fresh_interpreter_run, in_process  # before anything imports triton

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtopo.kernels import triton_decode
from kvtopo.kernels.decode_inputs import MidCodes
from kvtopo.kernels.decode_reference import reference_decode, reference_history
from kvtopo.runtime import decode_view

from decode_bound import capped_bound, error_bound
from segments import synthetic_segments

test_in_fresh_interpreter_process = fresh_interpreter_run(__file__)

@st.composite
def segment_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 4, 8]))
    d = draw(st.sampled_from([64, 128]))
    page = draw(st.sampled_from([4, 8, 16]))
    exact = draw(st.sampled_from([0, 1, 3, 7, 33]))
    recent_pages = draw(st.integers(0, 2))
    mid_rows = tuple(draw(st.lists(st.integers(0, page), min_size=0, max_size=4)))
    if exact + recent_pages + sum(mid_rows) == 0:
        exact = 1
    k_ranks = tuple(draw(st.lists(st.integers(0, 20), min_size=kv_heads, max_size=kv_heads)))
    v_ranks = tuple(draw(st.lists(st.integers(0, 20), min_size=kv_heads, max_size=kv_heads)))
    return dict(
        kv_heads=kv_heads, group=group, dk=d, dv=d, exact=exact, recent_pages=recent_pages, page_size=page,
        mid_page_rows=mid_rows or (0,), k_ranks=k_ranks, v_ranks=v_ranks,
        recent_bits=draw(st.sampled_from([2, 4, 8])), mid_bits=draw(st.sampled_from([2, 4, 8])),
        exact_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 2**16)),
    )


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)


def run_kernel(q, segs, scale, softcap=None):
    hq = q.shape[0]
    dv = (segs.exact[1].shape[-1] if segs.exact is not None else
          segs.recent.dv if segs.recent is not None else
          segs.mid.v_vectors.shape[1] if segs.mid.projected else segs.mid.value_width)
    out = torch.full((hq, dv), float("nan"))
    result = triton_decode.triton_decode_attention(q, segs, scale, out=out, softcap=softcap)
    assert result is out
    return out


@in_process
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=segment_cases(), splits=st.sampled_from([None, 1, 3, 7]))
def test_kernels_match_float64_reference(case, splits, poisoned, monkeypatch):
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", splits)
    segs = synthetic_segments(**case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(case["kv_heads"] * case["group"], case["dk"], generator=g)
    scale = case["dk"] ** -0.5
    out = run_kernel(q, segs, scale)
    assert torch.isfinite(out).all(), "some output element was not written"
    ref = reference_decode(q, segs, scale)
    err = (out.double() - ref).abs().max().item()
    assert err <= error_bound(q, segs, scale), (err, error_bound(q, segs, scale))


@in_process
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_single_mid_page_only(bits, poisoned):
    """Only a Mid segment of one page (odd row count), every bit width."""
    segs = synthetic_segments(kv_heads=2, group=4, dk=64, dv=64, exact=0, recent_pages=0,
                                          mid_page_rows=(7,), mid_bits=bits, seed=bits)
    q = torch.randn(8, 64)
    out = run_kernel(q, segs, 0.125)
    ref = reference_decode(q, segs, 0.125)
    assert (out.double() - ref).abs().max().item() <= error_bound(q, segs, 0.125)


@in_process
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=segment_cases(), splits=st.sampled_from([None, 1, 3, 7]), softcap=st.sampled_from([None, 5.0, 50.0]))
def test_unprojected_kernels_match_float64_reference(case, splits, softcap, poisoned, monkeypatch):
    """Unprojected Mid (KIVI-style codes, per-token value statistics) in the mixes of segments
    test_kernels_match_float64_reference draws, capped or not."""
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", splits)
    segs = synthetic_segments(**case, projected=False)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(case["kv_heads"] * case["group"], case["dk"], generator=g)
    scale = case["dk"] ** -0.5
    out = run_kernel(q, segs, scale, softcap)
    assert torch.isfinite(out).all(), "some output element was not written"
    ref = reference_decode(q, segs, scale, softcap=softcap)
    bound = capped_bound(q, segs, scale, softcap)
    assert (out.double() - ref).abs().max().item() <= bound


@in_process
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("exact", [0, 3])
def test_unprojected_mid_matches_float64_reference(bits, softcap, exact, poisoned):
    """Unprojected Mid with pages of 0 and 1 rows, GQA group 4, alone or after exact/Recent."""
    segs = synthetic_segments(kv_heads=2, group=4, exact=exact, recent_pages=exact // 3,
                              mid_page_rows=(8, 1, 0, 5, 1), mid_bits=bits, seed=bits, projected=False)
    q = 4.0 * torch.randn(8, 64, generator=torch.Generator().manual_seed(bits))
    out = run_kernel(q, segs, 0.125, softcap)
    assert torch.isfinite(out).all()
    ref = reference_decode(q, segs, 0.125, softcap=softcap)
    assert (out.double() - ref).abs().max().item() <= capped_bound(q, segs, 0.125, softcap)


@in_process
def test_unprojected_mid_launches_the_triton_kernel(monkeypatch):
    """Unprojected Mid is attended by ``_mid_split_kernel`` (one launch over its kv-heads), and
    nothing dequantizes it for the torch reference."""
    segs = synthetic_segments(kv_heads=2, group=4, exact=0, recent_pages=0, mid_page_rows=(8, 1, 0, 5),
                              projected=False)
    q = torch.randn(8, 64)
    ref, bound = reference_decode(q, segs, 0.125), error_bound(q, segs, 0.125)
    launches = []
    kernel = triton_decode._mid_split_kernel

    class RecordLaunch:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    def fallback(*args, **kwargs):
        raise AssertionError("unprojected Mid took the torch fallback")

    monkeypatch.setattr(triton_decode, "_mid_split_kernel", RecordLaunch())
    monkeypatch.setattr(triton_decode, "partial_lowrank", fallback)
    monkeypatch.setattr(MidCodes, "decode", fallback)
    out = run_kernel(q, segs, 0.125)
    assert len(launches) == 1 and launches[0][0] == 2
    assert (out.double() - ref).abs().max().item() <= bound


@in_process
def test_empty_splits_write_zero_weight(poisoned, monkeypatch):
    """More splits than token blocks: the empty splits must write lse=-inf and 0, not garbage."""
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", 9)
    segs = synthetic_segments(kv_heads=1, group=4, exact=3, recent_pages=1, page_size=4,
                                          mid_page_rows=(2, 1))
    q = torch.randn(4, 64)
    qs = (0.125 * q).reshape(1, 1, 4, 64)
    o, lse, seq = triton_decode._dense_rows(qs, [0], segs.exact, None, [segs.exact[0].shape[1]], None)
    assert o.shape[0] == 9 and torch.isfinite(o).all() and (seq == 0).all()  # 9 splits, one sequence
    assert torch.isinf(lse[1:]).all() and (o[1:] == 0).all()
    out = run_kernel(q, segs, 0.125)
    ref = reference_decode(q, segs, 0.125)
    assert (out.double() - ref).abs().max().item() <= error_bound(q, segs, 0.125)


@in_process
@pytest.mark.parametrize("chunks", [[300], [64, 256, 256]])
def test_matches_runtime_store(chunks):
    """Segments taken from a real session's store (topo: int8 Recent, 4-bit projected Mid; with
    chunks that make it refit, an earlier Mid epoch with its own bases too)."""
    import kvtopo
    from kvtopo.kernels.compressed_attention import merge_partials, partial_dense
    from kvtopo.runtime.session import _history_partials

    torch.manual_seed(0)
    hkv, hq, d, n = 2, 8, 64, sum(chunks)
    k = torch.randn(hkv, n, d) @ torch.randn(d, d) * 0.3
    v = torch.randn(hkv, n, d)
    q_all = torch.randn(1, hq, n, d)
    cfg = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None, refit_after=64,
                        key_energy=0.9, value_energy=0.9)
    with kvtopo.session(cfg) as s:
        start = 0
        for size in chunks:
            end = start + size
            s.attend("l", q_all[:, :, start:end], k[None, :, start:end], v[None, :, start:end], None, d**-0.5)
            start = end
        cache = s.layers["l"]
        q, kn, vn = torch.randn(hq, 1, d), torch.randn(hkv, 1, d), torch.randn(hkv, 1, d)
        segs = decode_view.decode_segments(cache, 0, kn, vn)
        assert segs.mid is not None and segs.recent is not None
        assert len(segs.retired) == (len(chunks) > 1)
        out = run_kernel(q[:, 0], segs, d**-0.5)
        ref = merge_partials(_history_partials(q, cache.segments(0), d**-0.5, None)
                             + [partial_dense(q, kn, vn, d**-0.5)])[:, 0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert math.isfinite(out.sum().item())


# -- a batch of sequences in one launch per kind (triton_decode_batch) ---------------------------


@in_process
@pytest.mark.parametrize("projected", [True, False])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_batch_is_one_launch_per_kind_and_matches_float64(projected, softcap, poisoned, monkeypatch):
    """Four sequences with different histories (lengths, ranks, empty phases, earlier Mid
    epochs): one exact launch, one Recent launch, one Mid launch for all of them, and each
    sequence's row equals its float64 reference."""
    shapes = [dict(exact=5, recent_pages=2, mid_page_rows=(8, 3, 5), seed=1),
              dict(exact=1, recent_pages=0, mid_page_rows=(2,), seed=2, k_ranks=(7, 1), v_ranks=(2, 9)),
              dict(exact=33, recent_pages=1, mid_page_rows=(0,), seed=3),
              dict(exact=2, recent_pages=1, mid_page_rows=(8, 8, 8, 8, 1), seed=4)]
    segs = [synthetic_segments(kv_heads=2, group=4, page_size=8, projected=projected, **shape) for shape in shapes]
    earlier = synthetic_segments(kv_heads=2, group=4, exact=0, recent_pages=0, mid_page_rows=(4, 6), seed=5,
                                 projected=projected).mid
    segs[0] = dataclasses.replace(segs[0], retired=(earlier,))
    launches = {"dense": 0, "mid": 0}
    for name, attr in (("dense", "_dense_split_kernel"), ("mid", "_mid_split_kernel")):
        kernel = getattr(triton_decode, attr)

        class Counted:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launches[name] += 1
                return kernel[grid]

        monkeypatch.setattr(triton_decode, attr, Counted())
    q = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))
    out = triton_decode.triton_decode_batch(q, segs, 0.125, softcap)
    assert launches == {"dense": 2, "mid": 1}
    assert out.shape == (4, 8, 64) and torch.isfinite(out).all()
    for b, sb in enumerate(segs):
        ref = reference_decode(q[b], sb, 0.125, softcap=softcap)
        assert (out[b].double() - ref).abs().max().item() <= capped_bound(q[b], sb, 0.125, softcap)


@in_process
def test_float16_statistics_give_their_float32_result():
    """The Mid kernel reads statistics through their addresses as float32; the store keeps them
    in float16, which the launch widens first: the same output as the float32 values."""
    segs = synthetic_segments(kv_heads=1, group=4, exact=1, recent_pages=1, mid_page_rows=(4,))
    names = ("k_scale", "k_offset", "v_scale", "v_offset")
    rounded = {n: getattr(segs.mid, n).half() for n in names}
    half = dataclasses.replace(segs, mid=dataclasses.replace(segs.mid, **rounded))
    wide = dataclasses.replace(segs, mid=dataclasses.replace(segs.mid, **{n: x.float() for n, x in rounded.items()}))
    assert segs.recent.k_scale.dtype == torch.float16  # Recent pages keep quantize's float16 statistics
    q = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(triton_decode.triton_decode_attention(q, half, 0.125),
                       triton_decode.triton_decode_attention(q, wide, 0.125))


@in_process
def test_mid_codes_of_another_dtype_are_refused():
    """The Mid kernel reads code rows through their addresses as uint8: other dtypes would be
    misread, so they are refused."""
    segs = synthetic_segments(kv_heads=1, group=4, exact=1, recent_pages=0, mid_page_rows=(4,))
    wrong = dataclasses.replace(segs, mid=dataclasses.replace(segs.mid, k_rows=segs.mid.k_rows.int()))
    with pytest.raises(ValueError, match="uint8 rows"):
        triton_decode.triton_decode_attention(torch.randn(4, 64), wrong, 0.125)


# -- a prefill chunk over the stored history (history_partials) --------------------------------


@in_process
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=segment_cases(), tokens=st.sampled_from([2, 5, 9]), splits=st.sampled_from([None, 3]),
       projected=st.booleans(), softcap=st.sampled_from([None, 20.0]))
def test_history_partials_match_float64_reference(case, tokens, splits, projected, softcap, poisoned, monkeypatch):
    """T query tokens per head: G * T rows per kv-head, tiled in several row blocks (16 rows in
    the interpreter), each row against every stored token; out and lse against float64."""
    if splits:
        monkeypatch.setattr(triton_decode, "FORCE_SPLITS", splits)
    segs = synthetic_segments(**case, projected=projected)
    hq = case["kv_heads"] * case["group"]
    q = torch.randn(hq, tokens, case["dk"], generator=torch.Generator().manual_seed(case["seed"]))
    out, lse = triton_decode.history_partials(q, segs, 0.125, softcap)
    ref_out, ref_lse = reference_history(q, segs, 0.125, softcap=softcap)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and torch.isfinite(out).all()
    bound = capped_bound(q, segs, 0.125, softcap)  # over every row (the bound reads q's rows, any shape)
    assert (out.double() - ref_out).abs().max().item() <= bound
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-5 * (1 + ref_lse.abs().max().item())
