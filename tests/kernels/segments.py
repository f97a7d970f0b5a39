"""Synthetic decode inputs for the decode-kernel tests: random K/V encoded the way the store
encodes them, every phase of any size (including empty)."""

from __future__ import annotations

import dataclasses

import torch

from kvtopo.kernels.decode_inputs import DecodeSegments, MidCodes, RecentCodes, rank_columns
from kvtopo.kernels.quant import quantize


def synthetic_segments(
    kv_heads: int = 2, group: int = 4, dk: int = 64, dv: int = 64, exact: int = 5,
    recent_pages: int = 1, page_size: int = 8, mid_page_rows: tuple[int, ...] = (8, 3, 0, 5),
    k_ranks: tuple[int, ...] | None = None, v_ranks: tuple[int, ...] | None = None,
    recent_bits: int = 8, mid_bits: int = 4, seed: int = 0, exact_dtype=torch.float32,
    projected: bool = True,
) -> DecodeSegments:
    """Random segments encoded exactly as the runtime encodes them (quant.quantize per page).
    Any phase can be empty (exact=0, recent_pages=0, no mid rows). ``projected`` False: Mid
    holds KIVI-style codes of the keys/values themselves (``unprojected_mid``); ranks unused.
    ``group`` (query heads per kv-head) shapes no segment: it is taken so that one case dict
    describes both the segments and the caller's queries."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ex = None
    if exact:
        ex = (randn(kv_heads, exact, dk).to(exact_dtype), randn(kv_heads, exact, dv).to(exact_dtype))
    rec = None
    if recent_pages:
        pages = []
        for _ in range(recent_pages):
            kq = quantize(2 * randn(kv_heads, page_size, dk) + randn(kv_heads, 1, dk), recent_bits, reduce_dim=1)
            vq = quantize(randn(kv_heads, page_size, dv), recent_bits, reduce_dim=-1)
            pages.append((kq, vq))
        rec = RecentCodes.from_pages(pages, page_size)
    mid = None
    if sum(mid_page_rows) and not projected:
        mid = unprojected_mid(randn, kv_heads, dk, dv, mid_page_rows, mid_bits)[0]
    elif sum(mid_page_rows):
        k_ranks = k_ranks or tuple(min(dk, 3 + 2 * h) for h in range(kv_heads))
        v_ranks = v_ranks or tuple(min(dv, 5 + h) for h in range(kv_heads))
        sides = []
        for ranks, d in ((k_ranks, dk), (v_ranks, dv)):
            width = max(1, max(ranks))
            vectors = torch.zeros(kv_heads, d, width)
            for h, r in enumerate(ranks):
                vectors[h, :, :r] = torch.linalg.qr(randn(d, d))[0][:, :r]
            rows, scale, offset = [], [], []
            c = sum(ranks)
            decay = torch.cat([torch.exp(-torch.arange(r) / 4.0) for r in ranks]) if c else torch.ones(0)
            for n in mid_page_rows:
                if n == 0:
                    continue
                q = quantize(3 * randn(n, c) * decay + 0.5 * randn(1, c), mid_bits, reduce_dim=0) if c else None
                rows.append(q.codes if q is not None else torch.zeros(n, 0, dtype=torch.uint8))
                scale.append(q.scale.float() if q is not None else torch.zeros(1, 0))
                offset.append(q.offset.float() if q is not None else torch.zeros(1, 0))
            starts, r32 = rank_columns(ranks)
            sides.append((torch.cat(rows), torch.cat(scale), torch.cat(offset), starts, r32, vectors, randn(kv_heads, d)))
        counts = torch.tensor([n for n in mid_page_rows if n])
        stat = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(torch.int32)
        (kr, ks, ko, kst, krk, kv, km), (vr, vs, vo, vst, vrk, vv, vm) = sides
        mid = MidCodes(kr, ks, ko, mid_bits, kst, krk, kv, km, vr, vs, vo, mid_bits, vst, vrk, vv, vm, stat)
    return DecodeSegments(ex, rec, mid)


def unprojected_mid(randn, kv_heads: int, dk: int, dv: int, page_rows: tuple[int, ...], bits: int,
                    value_stats_per_row: bool = True):
    """(MidCodes, pages): an unprojected Mid as ``runtime.codecs.MidSegment`` stores it, keys
    [n, Hkv, dk] quantized per channel per page, values [n, Hkv, dv] per token and head (or, with
    ``value_stats_per_row=False``, per channel per page as the keys, values drawn about an offset
    of their own), and the per-page (keys, values) Quantized they were read from."""
    pages = []
    for n in page_rows:
        if n:
            keys = 2 * randn(n, kv_heads, dk) + randn(1, kv_heads, dk)
            if value_stats_per_row:
                values = quantize(randn(n, kv_heads, dv), bits, reduce_dim=-1)
            else:
                values = quantize(randn(n, kv_heads, dv) + 3 * randn(1, kv_heads, dv), bits, reduce_dim=0)
            pages.append((quantize(keys, bits, reduce_dim=0), values))
    counts = torch.tensor([n for n in page_rows if n])
    stat = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(torch.int32)
    n = int(counts.sum())
    cat = lambda tensors, width: torch.cat(tensors).float().reshape(-1, width)  # noqa: E731
    ks, kr = rank_columns((dk,) * kv_heads)
    vs, vr = rank_columns((dv,) * kv_heads)
    value_stat_width = kv_heads if value_stats_per_row else kv_heads * dv
    mid = MidCodes(
        torch.cat([k.codes for k, _ in pages]).reshape(n, -1), cat([k.scale for k, _ in pages], kv_heads * dk),
        cat([k.offset for k, _ in pages], kv_heads * dk), bits, ks, kr, None, None,
        torch.cat([v.codes for _, v in pages]).reshape(n, -1), cat([v.scale for _, v in pages], value_stat_width),
        cat([v.offset for _, v in pages], value_stat_width), bits, vs, vr, None, None, stat,
        projected=False, value_stats_per_row=value_stats_per_row)
    return mid, pages


def decode_on_threads(q, segs: DecodeSegments, scale: float, threads: int, softcap: float | None = None,
                      out=None):
    """`decode_attention` with torch's thread count set to `threads` (the CPU path splits Mid rows
    over that many threads), restored afterwards."""
    from kvtopo.kernels import fast_decode

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fast_decode.decode_attention(q, segs, scale, out=out, softcap=softcap)
    finally:
        torch.set_num_threads(before)


def concat_mids(a, b):
    """Two unprojected Mid segments' rows one after the other (b's pages after a's)."""
    pages = int(a.row_stat.max()) + 1
    return dataclasses.replace(
        a, k_rows=torch.cat([a.k_rows, b.k_rows]), k_scale=torch.cat([a.k_scale, b.k_scale]),
        k_offset=torch.cat([a.k_offset, b.k_offset]), v_rows=torch.cat([a.v_rows, b.v_rows]),
        v_scale=torch.cat([a.v_scale, b.v_scale]), v_offset=torch.cat([a.v_offset, b.v_offset]),
        row_stat=torch.cat([a.row_stat, b.row_stat + pages]))
