"""Attention of a prefill chunk's queries to a sequence's stored history, read as stored.

A chunk of T query tokens attends to [stored history ; the chunk itself]. The chunk part is an
exact causal attention (``partial_dense``); this module is the history part: every query row sees
every stored token (the history precedes the chunk), so it is the decode computation with G * T
query rows per kv-head instead of G. ``history_attention`` returns a partial (out, lse), merged
by the caller with the chunk's own.

The history comes as ``DecodeSegments`` (runtime/decode_view.py: exact pages in place, Recent
and Mid codes as stored). On CUDA the Triton split-K kernels run with the chunk's rows tiled
(kernels/triton_decode.py, ``history_partials``): codes unpacked in registers, nothing dequantized
to memory. On CPU the history is attended in tiles of ``TILE_TOKENS`` stored tokens, each tile's
codes dequantized to a small float32 block that a matrix product then reads from cache (aten's
flash attention where it takes the partial, in the model's dtype when that is bfloat16 / float16:
``compressed_attention.dense_partials``): the chunk never builds a dense K/V (or a [T, N] logit
matrix) of the whole history, so its peak memory is set by the tile, not by the context length. Both are checked against the float64 reference
(tests/kernels/test_history_attention.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from .compressed_attention import dense_partials, merge_partials_lse, partial_lowrank
from .decode_inputs import DecodeSegments, MidCodes, check_softcap, pool_rows

# Stored tokens one CPU tile dequantizes: a tile's K/V (float32, [Hkv, TILE_TOKENS, d]) stays in
# L2 while all the chunk's query rows read it.
TILE_TOKENS = 1024


def history_attention(q: Tensor, segs: DecodeSegments, scale: float,
                      softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Queries q [Hq, T, d] over every stored segment -> (out [Hq, T, dv] float32, lse [Hq, T]).

    ``softcap``: logits are ``softcap * tanh(logits / softcap)`` (None: uncapped). An empty
    history raises (the caller attends the chunk alone)."""
    check_softcap(softcap)
    if q.is_cuda:
        from .triton_decode import history_partials

        return history_partials(q, segs, scale, softcap)
    parts = list(_cpu_partials(q, segs, scale, softcap))
    if not parts:
        raise ValueError("history attention over an empty history")
    return merge_partials_lse(parts)


def _cpu_partials(q: Tensor, segs: DecodeSegments, scale: float, softcap: float | None) -> Iterator[tuple[Tensor, Tensor]]:
    """The (out, lse) partials of every tile of every segment."""
    if segs.exact_pages is not None:
        pages = segs.exact_pages
        size = pages.keys.shape[2]
        per_tile = max(1, TILE_TOKENS // size)
        for first in range(0, pages.slots.numel(), per_tile):
            slots = pages.slots[first: first + per_tile]
            tokens = min(pages.tokens - first * size, slots.numel() * size)
            k, v = pool_rows(pages.keys, slots, tokens), pool_rows(pages.values, slots, tokens)
            yield from dense_partials(q, k, v, scale, softcap)
    if segs.exact is not None:
        k, v = segs.exact
        for start in range(0, k.shape[1], TILE_TOKENS):
            yield from dense_partials(q, k[:, start: start + TILE_TOKENS], v[:, start: start + TILE_TOKENS], scale,
                                      softcap)
    if segs.recent is not None and segs.recent.tokens:  # a few pages (the Recent window): one tile
        yield from dense_partials(q, *segs.recent.decode(), scale, softcap)
    if segs.mid is None and segs.mid_other is not None:  # baseline Mid encodings, float
        if segs.mid_other_projected:
            yield partial_lowrank(q, *segs.mid_other, scale, softcap=softcap)
        else:
            yield from dense_partials(q, *segs.mid_other, scale, softcap)
    for epoch in ((segs.mid,) if segs.mid is not None else ()) + tuple(segs.retired):
        if not isinstance(epoch, MidCodes):
            yield partial_lowrank(q, *epoch, scale, softcap=softcap)
            continue
        for start in range(0, epoch.tokens, TILE_TOKENS):
            tile = epoch.rows(start, start + TILE_TOKENS)
            if tile.projected:  # on its bases
                yield partial_lowrank(q, *tile.decode(), scale, softcap=softcap)
            else:  # the codes are K/V
                yield from dense_partials(q, *tile.dense(), scale, softcap)
