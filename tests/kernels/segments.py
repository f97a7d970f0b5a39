"""Synthetic decode inputs for the decode-kernel tests: random K/V encoded the way the store
encodes them, every phase of any size (including empty)."""

from __future__ import annotations

import torch

from kvtopo.kernels.decode_inputs import DecodeSegments, MidCodes, RecentCodes, rank_columns
from kvtopo.kernels.quant import quantize


def synthetic_segments(
    kv_heads: int = 2, group: int = 4, dk: int = 64, dv: int = 64, exact: int = 5,
    recent_pages: int = 1, page_size: int = 8, mid_page_rows: tuple[int, ...] = (8, 3, 0, 5),
    k_ranks: tuple[int, ...] | None = None, v_ranks: tuple[int, ...] | None = None,
    recent_bits: int = 8, mid_bits: int = 4, seed: int = 0, exact_dtype=torch.float32,
) -> DecodeSegments:
    """Random segments encoded exactly as the runtime encodes them (quant.quantize per page).
    Any phase can be empty (exact=0, recent_pages=0, no mid rows)."""
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
    if sum(mid_page_rows):
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
