"""The CPU decode path (fused C kernel over Mid codes, torch for exact/Recent) matches float64.

Same reference and error bound as tests/kernels/test_triton_decode.py (float32 rounding only:
the reference decodes the same codes and statistics in float64); here the Mid logits fold the
page statistics into the query (q_r * scale_r) and the values apply them once per page to code
sums, which reorders the float32 sums but stays within the same first-order bound.
Also checked: the torch fallback (no C compiler) gives the same result, and ``attend_cache`` on
a real session's store equals what ``Session._attend_one`` computes for a decode step, for the
topo policy (projected, quantized Mid: the C kernel) and baselines (KIVI: unprojected codes,
Palu: float coefficients, full: exact only).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtopo
from kvtopo.kernels import cpu_decode
from kvtopo.kernels.compressed_attention import merge_partials, partial_dense
from kvtopo.kernels.decode_reference import reference_decode
from kvtopo.runtime import decode_view
from kvtopo.runtime.session import _history_partials

from decode_bound import error_bound
from segments import decode_on_threads, synthetic_segments


@st.composite
def segment_cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))  # 3: SmolLM2; 6: weighed as two groups of 3
    d = draw(st.sampled_from([64, 128]))
    page = draw(st.sampled_from([4, 8, 32]))
    exact = draw(st.sampled_from([0, 1, 5, 33]))
    recent_pages = draw(st.integers(0, 2))
    mid_rows = tuple(draw(st.lists(st.integers(0, page), min_size=0, max_size=40)))
    if exact + recent_pages + sum(mid_rows) == 0:
        exact = 1
    k_ranks = tuple(draw(st.lists(st.integers(0, 40), min_size=kv_heads, max_size=kv_heads)))
    v_ranks = tuple(draw(st.lists(st.integers(0, 40), min_size=kv_heads, max_size=kv_heads)))
    return dict(
        kv_heads=kv_heads, group=group, dk=d, dv=d, exact=exact, recent_pages=recent_pages, page_size=page,
        mid_page_rows=mid_rows or (0,), k_ranks=k_ranks, v_ranks=v_ranks,
        recent_bits=draw(st.sampled_from([2, 4, 8])), mid_bits=draw(st.sampled_from([2, 4, 8])),
        exact_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 2**16)),
    )


def test_c_kernel_builds():
    assert cpu_decode.c_kernel_available(), "no C compiler? the CPU path falls back to torch (slow)"


def test_build_failure_warns_once_with_the_compiler_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken_kernel.cpp"
    broken.write_text("int main() { return undeclared_name; }\n")
    monkeypatch.setattr(cpu_decode, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))  # leaves the real build alone
    cpu_decode._build.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"(?s)broken_kernel\.cpp failed.*undeclared_name"):
            assert cpu_decode.mid_kernel() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert cpu_decode.mid_kernel() is None  # reported once, not per call
    finally:
        cpu_decode._build.cache_clear()


@settings(max_examples=60, deadline=None)
@given(case=segment_cases(), threads=st.sampled_from([1, 2]))
def test_cpu_path_matches_float64_reference(case, threads):
    segs = synthetic_segments(**case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(case["kv_heads"] * case["group"], case["dk"], generator=g)
    scale = case["dk"] ** -0.5
    out = torch.full((q.shape[0], case["dv"]), float("nan"))
    decode_on_threads(q, segs, scale, threads, out=out)
    assert torch.isfinite(out).all()
    ref = reference_decode(q, segs, scale)
    err = (out.double() - ref).abs().max().item()
    assert err <= error_bound(q, segs, scale), (err, error_bound(q, segs, scale))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fallback_equals_c_kernel(bits, monkeypatch):
    segs = synthetic_segments(kv_heads=2, group=4, mid_page_rows=(8, 1, 0, 7) * 5, mid_bits=bits, seed=bits)
    q = torch.randn(8, 64)
    fast = cpu_decode.cpu_decode_attention(q, segs, 0.125)
    monkeypatch.setattr(cpu_decode, "mid_kernel", lambda: None)
    slow = cpu_decode.cpu_decode_attention(q, segs, 0.125)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5 * slow.abs().max().item())


POLICIES = {
    "topo": dict(target_ratio=None),
    "topo-projected": dict(target_ratio=None, key_energy=0.9, value_energy=0.9),
    "topo-evict": dict(target_ratio=4.0),
    "kivi": dict(policy="kivi", target_ratio=None),
    "palu": dict(policy="palu", target_ratio=None),
    "full": dict(policy="full", target_ratio=None),
}


@pytest.mark.parametrize("name", POLICIES)
def test_attend_cache_equals_session_decode_step(name):
    torch.manual_seed(0)
    hkv, hq, d, n = 2, 8, 32, 400
    k = torch.randn(hkv, n, d) @ torch.randn(d, d) * 0.3 + 1.0
    v = torch.randn(hkv, n, d) @ torch.randn(d, d) * 0.3
    cfg = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, **POLICIES[name])
    with kvtopo.session(cfg) as s:
        s.attend("l", torch.randn(1, hq, n, d), k[None], v[None], None, d**-0.5)
        cache = s.layers["l"]
        for step in range(3):  # a few decode steps: pages keep moving through phases
            q, kn, vn = torch.randn(hq, 1, d), torch.randn(hkv, 1, d), torch.randn(hkv, 1, d)
            segments = cache.segments(0)
            ref = merge_partials(_history_partials(q, segments, d**-0.5, None) + [partial_dense(q, kn, vn, d**-0.5)])
            out = decode_view.attend_cache(cache, 0, q, kn, vn, d**-0.5)
            assert out.shape == (hq, 1, d)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            s.attend("l", q[None], kn[None], vn[None], None, d**-0.5)
        if name == "topo":
            assert decode_view.decode_segments(cache, 0).mid is not None
