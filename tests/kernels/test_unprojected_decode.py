"""The CPU decode path over an unprojected, quantized Mid segment (KIVI-style codes: keys per
channel per page, values per token and head) matches float64.

``MidCodes.decode`` is checked against ``quant.dequantize`` of the very pages it was stored
from; the C kernel (identity basis, per-row value statistics folded into the weights) against
the float64 reference within the bound of tests/kernels/test_softcap_decode.py (that of
tests/kernels/decode_bound.py plus a few float32 ulps of the cap) and against the torch fallback;
and ``attend_cache`` on a real store (topo without projection, and KIVI) against what
``Session._attend_one`` computes off the fast path (``CodedRows.decode``, dense attention).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtopo
from kvtopo.kernels import cpu_decode
from kvtopo.kernels.compressed_attention import merge_partials, partial_dense
from kvtopo.kernels.decode_reference import reference_decode
from kvtopo.kernels.quant import dequantize
from kvtopo.runtime import decode_view
from kvtopo.runtime.session import _history_partials

from segments import decode_on_threads, synthetic_segments, unprojected_mid
from decode_bound import capped_bound


def test_decode_equals_dequantized_pages():
    g = torch.Generator().manual_seed(0)
    mid, pages = unprojected_mid(lambda *s: torch.randn(*s, generator=g), 3, 64, 32, (8, 1, 0, 5), 4)
    keys, values = mid.decode()
    want_k = torch.cat([dequantize(k) for k, _ in pages]).transpose(0, 1)  # [Hkv, N, dk]
    want_v = torch.cat([dequantize(v) for _, v in pages]).transpose(0, 1)
    for side, want in ((keys, want_k), (values, want_v)):
        dense = side.coefficients @ side.vectors.transpose(1, 2) + side.mean[:, None]
        torch.testing.assert_close(dense, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dense_equals_decoded_coefficients_and_the_pages(bits):
    """``MidCodes.dense`` (what a prefill chunk attends to) gives the values ``decode()``'s
    coefficients hold, bit for bit, and those of the pages it was stored from; any row range."""
    g = torch.Generator().manual_seed(bits)
    mid, pages = unprojected_mid(lambda *s: torch.randn(*s, generator=g), 3, 64, 32, (8, 1, 0, 5, 32), bits)
    want_k = torch.cat([dequantize(k) for k, _ in pages]).transpose(0, 1)
    want_v = torch.cat([dequantize(v) for _, v in pages]).transpose(0, 1)
    for start, stop in ((0, mid.tokens), (3, 20), (9, 10)):
        rows = mid.rows(start, stop)
        keys, values = rows.dense()
        decoded_k, decoded_v = rows.decode()
        assert torch.equal(keys, decoded_k.coefficients) and torch.equal(values, decoded_v.coefficients)
        torch.testing.assert_close(keys, want_k[:, start:stop], rtol=0, atol=1e-6)
        torch.testing.assert_close(values, want_v[:, start:stop], rtol=0, atol=1e-6)


def test_dense_refuses_projected_codes():
    segs = synthetic_segments(kv_heads=2, group=2, dk=16, dv=16, exact=1, recent_pages=0, page_size=4,
                              mid_page_rows=(3, 4), mid_bits=4, seed=0)
    with pytest.raises(ValueError, match="unprojected"):
        segs.mid.dense()


@st.composite
def cases(draw):
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    page = draw(st.sampled_from([4, 8, 32]))
    mid_rows = tuple(draw(st.lists(st.integers(0, page), min_size=1, max_size=40)))
    return dict(
        kv_heads=kv_heads, group=draw(st.sampled_from([1, 4, 8])), dk=draw(st.sampled_from([64, 72, 128])),
        dv=draw(st.sampled_from([32, 40, 64, 128])), exact=draw(st.sampled_from([0, 1, 5])),
        recent_pages=draw(st.integers(0, 1)), page_size=page, mid_page_rows=mid_rows + (1,),
        mid_bits=draw(st.sampled_from([2, 4, 8])), seed=draw(st.integers(0, 2**16)), projected=False,
    )


@settings(max_examples=40, deadline=None)
@given(case=cases(), threads=st.sampled_from([1, 2]), softcap=st.sampled_from([None, 5.0, 30.0]))
def test_c_kernel_matches_float64_reference(case, threads, softcap):
    segs = synthetic_segments(**case)
    assert segs.mid is not None and not segs.mid.projected
    q = 3 * torch.randn(case["kv_heads"] * case["group"], case["dk"], generator=torch.Generator().manual_seed(case["seed"]))
    scale = case["dk"] ** -0.5
    out = decode_on_threads(q, segs, scale, threads, softcap=softcap)
    ref = reference_decode(q, segs, scale, softcap=softcap)
    bound = capped_bound(q, segs, scale, softcap)
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("kv_heads, dk", [(3, 72), (2, 128), (1, 136)])
def test_long_four_bit_rows(kv_heads, dk):
    """Mid rows of 108, 128 and 68 bytes: the kernel unpacks long 4-bit rows 16 bytes at a time
    and any tail code by code."""
    case = dict(kv_heads=kv_heads, group=4, dk=dk, dv=dk, exact=1, recent_pages=1, page_size=8,
                mid_page_rows=(8, 3, 0, 8, 1), mid_bits=4, seed=dk, projected=False)
    segs = synthetic_segments(**case)
    q = 3 * torch.randn(kv_heads * 4, dk, generator=torch.Generator().manual_seed(dk))
    out = decode_on_threads(q, segs, dk**-0.5, 1)
    ref = reference_decode(q, segs, dk**-0.5)
    assert (out.double() - ref).abs().max().item() <= capped_bound(q, segs, dk**-0.5, None)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_fallback_equals_c_kernel(bits, monkeypatch):
    segs = synthetic_segments(kv_heads=2, group=4, mid_page_rows=(8, 1, 0, 7) * 200, mid_bits=bits, seed=bits,
                              projected=False)
    q = torch.randn(8, 64)
    fast = cpu_decode.cpu_decode_attention(q, segs, 0.125, softcap=10.0)
    monkeypatch.setattr(cpu_decode, "mid_kernel", lambda: None)
    slow = cpu_decode.cpu_decode_attention(q, segs, 0.125, softcap=10.0)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5 * slow.abs().max().item())


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("settings_", [dict(key_energy=None, value_energy=None), dict(policy="kivi")],
                         ids=["topo-unprojected", "kivi"])
def test_attend_cache_takes_the_c_kernel_and_equals_session_decode_step(settings_, softcap):
    torch.manual_seed(0)
    hkv, hq, d, n = 2, 8, 32, 400
    k = torch.randn(hkv, n, d) @ torch.randn(d, d) * 0.3 + 1.0
    v = torch.randn(hkv, n, d) @ torch.randn(d, d) * 0.3
    cfg = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None, **settings_)
    with kvtopo.session(cfg) as s:
        s.attend("l", torch.randn(1, hq, n, d), k[None], v[None], None, d**-0.5, softcap=softcap)
        cache = s.layers["l"]
        for step in range(3):
            q, kn, vn = torch.randn(hq, 1, d), torch.randn(hkv, 1, d), torch.randn(hkv, 1, d)
            mid = decode_view.decode_segments(cache, 0).mid
            assert mid is not None and not mid.projected and mid.tokens > 300
            ref = merge_partials(_history_partials(q, cache.segments(0), d**-0.5, softcap)
                                 + [partial_dense(q, kn, vn, d**-0.5, softcap=softcap)])
            out = decode_view.attend_cache(cache, 0, q, kn, vn, d**-0.5, softcap=softcap)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            segs = decode_view.decode_segments(cache, 0, kn, vn)
            f64 = reference_decode(q[:, 0], segs, d**-0.5, softcap=softcap)
            assert (out[:, 0].double() - f64).abs().max().item() <= 1e-5 * f64.abs().max().item()
            s.attend("l", q[None], kn[None], vn[None], None, d**-0.5, softcap=softcap)


def test_mla_mid_has_no_codes_view():
    """Values inside the keys (MLA): no MidCodes view (its decode steps take the session's torch
    path, ``Session._attend_one``), and a decode step still runs."""
    torch.manual_seed(0)
    hq, d, dv, n = 4, 32, 16, 200
    k = torch.randn(1, 1, n, d)
    cfg = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None, key_energy=None,
                        value_energy=None)
    with kvtopo.session(cfg) as s:
        s.attend("l", torch.randn(1, hq, n, d), k, k[..., :dv], None, d**-0.5, shared_value_dim=dv)
        mid = s.layers["l"].sequences[0].mid
        assert mid.tokens and mid.encoding.key_bits and decode_view.mid_codes(mid) is None
        out = s.attend("l", torch.randn(1, hq, 1, d), k[..., :1, :], k[..., :1, :dv], None, d**-0.5,
                       shared_value_dim=dv)
        assert out.shape == (1, hq, 1, dv) and torch.isfinite(out).all()


@pytest.mark.parametrize("dim, viewed", [(4, True), (3, False)])
def test_codes_view_needs_whole_bytes_per_head(dim, viewed):
    """4-bit codes of a 3-dim head end mid-byte, so the heads' codes cannot be read as one flat row:
    no codes view (the torch path decodes it) rather than a misread one."""
    from kvtopo.runtime.codecs import MidSegment
    from kvtopo.runtime.policies import MidEncoding

    mid = MidSegment(MidEncoding(evict=True, key_bits=4, value_bits=4), None, None, torch.float32)
    g = torch.Generator().manual_seed(dim)
    mid.append_page(torch.randn(2, 5, dim, generator=g), torch.randn(2, 5, dim, generator=g))
    codes = decode_view.mid_codes(mid)
    assert (codes is not None) == viewed
    if viewed:
        assert not codes.projected and codes.tokens == 5 and codes.kv_heads == 2
