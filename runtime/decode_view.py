"""The store's data as the decode kernels' inputs: DecodeSegments of one sequence-layer of a
``LayerCache`` (exact pages, Recent codes, Mid codes as stored: gathered, not decoded), and the
decode step ``Session`` runs on them for a batch of sequences (``attend_cache_batch``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from kvtopo.kernels.decode_inputs import DecodeSegments, MidCodes, PagedExact, RecentCodes, rank_columns
from kvtopo.kernels.fast_decode import decode_attention_batch

from .codecs import CodedRows, MidSegment
from .layer_cache import LayerCache

def _row_stat(coded: CodedRows) -> Tensor:
    """[N] int32 statistics row of every Mid code row, from page_rows."""
    counts = coded.page_rows[coded.page_rows > 0].long()
    return torch.repeat_interleave(torch.arange(counts.numel()), counts).to(torch.int32).to(coded.rows.device)


_VIEWS: "weakref.WeakKeyDictionary[MidSegment, tuple]" = weakref.WeakKeyDictionary()


def mid_codes(mid: MidSegment) -> MidCodes | None:
    """``_codes_view`` of the segment, built once per append and reused by every decode step: a
    segment changes only when rows are appended, which replaces its key rows' view object."""
    hit = _VIEWS.get(mid)
    if hit is not None and hit[0] is mid.keys.rows:
        return hit[1]
    codes = _codes_view(mid)
    _VIEWS[mid] = (mid.keys.rows, codes)
    return codes


def _codes_view(mid: MidSegment) -> MidCodes | None:
    """MidCodes view of a quantized ``MidSegment`` (else None: float Mid takes the torch path).

    Unprojected codes [N, Hkv, d / codes per byte] are read as one row of Hkv * d codes (an
    identity basis: ranks d, starts h * d), which needs each head's codes to fill whole bytes;
    MLA segments (values inside the keys) are not viewed: their decode steps do not come here
    (``Session._reads_codes``)."""
    e = mid.encoding
    if mid.tokens == 0 or not (e.key_bits and e.value_bits) or mid.shared_value_dim is not None:
        return None
    dev = mid.keys.rows.device
    if e.project:
        ks, kr = rank_columns(mid.key_bases.ranks)
        vs, vr = rank_columns(mid.value_bases.ranks)
        return MidCodes(
            mid.keys.rows, mid.keys.scale, mid.keys.offset, e.key_bits, ks.to(dev), kr.to(dev),
            mid.key_bases.vectors.float(), mid.key_bases.mean.float(),
            mid.values.rows, mid.values.scale, mid.values.offset, e.value_bits, vs.to(dev), vr.to(dev),
            mid.value_bases.vectors.float(), mid.value_bases.mean.float(), _row_stat(mid.keys))
    n, heads = mid.keys.rows.shape[:2]
    dk, dv = mid.keys.length, mid.values.length
    if dk * e.key_bits % 8 or dv * e.value_bits % 8:
        return None
    ks, kr = rank_columns((dk,) * heads)
    vs, vr = rank_columns((dv,) * heads)
    k_scale, k_offset = (s.reshape(s.shape[0], heads * dk) for s in (mid.keys.scale, mid.keys.offset))
    v_scale, v_offset = (s.reshape(n, heads) for s in (mid.values.scale, mid.values.offset))
    return MidCodes(
        mid.keys.rows.reshape(n, -1), k_scale, k_offset, e.key_bits, ks.to(dev), kr.to(dev), None, None,
        mid.values.rows.reshape(n, -1), v_scale, v_offset, e.value_bits, vs.to(dev), vr.to(dev), None, None,
        _row_stat(mid.keys), projected=False, value_stats_per_row=True)


class _PagesView:
    """The exact and Recent pages of one sequence-layer as a decode step reads them, kept between
    steps so that a step does not walk every page of a long sequence.

    Pages are only appended to a sequence and only move forward (exact -> Recent -> Mid, or
    dropped), never back: the pages that can be exact or Recent now are the ones that were, plus
    the pages appended since. A step checks those few (their slot and Recent codes, O(window));
    when they changed or pages were appended, only they and the new pages are looked at again.
    The Recent pages' codes are stacked once per change of the window, not per step."""

    def __init__(self, cache: LayerCache, entry, previous: "_PagesView | None"):
        pages = entry.pages
        if previous is not None and previous.pages is pages and previous.count <= len(pages):
            candidates = sorted(previous.exact + previous.recent) + list(range(previous.count, len(pages)))
        else:
            candidates = range(len(pages))
        self.pages, self.count = pages, len(pages)
        self.exact = [i for i in candidates if pages[i].slot is not None]
        self.recent = [i for i in candidates if pages[i].recent is not None]
        self.state = self._state()
        # The exact pages as the kernel reads them in place: their pool slots, when every one but
        # the newest (the Terminal page, still filling) is full, so token n is row n % P of page n // P.
        kernel_reads_pool = (cache.pool.keys.dtype in (torch.float32, torch.bfloat16)
                             and cache.pool.keys.device.type == "cpu")
        paged = kernel_reads_pool and bool(self.exact) and self.exact[-1] == len(pages) - 1 and all(
            pages[i].tokens == cache.config.page_size for i in self.exact[:-1])
        self.exact_slots = torch.tensor([pages[i].slot for i in self.exact], dtype=torch.int32) if paged else None
        reused = previous is not None and previous.pages is pages and previous.recent == self.recent and all(
            pages[i].recent is r for i, r in zip(self.recent, previous.state[1]))
        if reused:
            self.recent_codes = previous.recent_codes
        elif self.recent:
            codes = [(pages[i].recent.keys, pages[i].recent.values) for i in self.recent]
            self.recent_codes = RecentCodes.from_pages(codes, cache.config.page_size)
        else:
            self.recent_codes = None

    def _state(self) -> tuple:
        """What the view was built from: the exact pages' slots, the Recent pages' codes."""
        return (tuple(self.pages[i].slot for i in self.exact), tuple(self.pages[i].recent for i in self.recent))

    def current(self, entry) -> bool:
        return self.pages is entry.pages and self.count == len(entry.pages) and self._state() == self.state


_PAGE_VIEWS: dict[int, _PagesView] = {}  # id(sequence entry) -> its view, dropped with the entry


def _pages_view(cache: LayerCache, entry) -> _PagesView:
    view = _PAGE_VIEWS.get(id(entry))
    if view is not None and view.current(entry):
        return view
    if view is None:
        weakref.finalize(entry, _PAGE_VIEWS.pop, id(entry), None)
    view = _PAGE_VIEWS[id(entry)] = _PagesView(cache, entry, view)
    return view


def decode_segments(cache: LayerCache, seq: int, k_new: Tensor | None = None, v_new: Tensor | None = None) -> DecodeSegments:
    """DecodeSegments of sequence ``seq`` in a ``LayerCache``, plus the step's new
    k/v [Hkv, 1, d] appended to the exact segment (the new token sees itself). A float32 or bfloat16
    CPU pool's exact pages are handed over in place (``exact_pages``; ``exact`` is then the new
    token alone); other pools' are copied into ``exact``."""
    return entry_segments(cache, cache.sequences.get(seq), k_new, v_new)


def entry_segments(cache: LayerCache, entry, k_new: Tensor | None = None, v_new: Tensor | None = None) -> DecodeSegments:
    """``decode_segments`` of a sequence's state (None: no history), read as it is: a decode
    batch (runtime/decode_batch.py) builds its sequences' arguments here without being written
    back."""
    ks, vs, paged = [], [], None
    view = _pages_view(cache, entry) if entry is not None and entry.pages else None
    if view is not None and entry.length and view.exact_slots is not None:  # read in place
        tokens = (len(view.exact) - 1) * cache.config.page_size + entry.pages[view.exact[-1]].tokens
        paged = PagedExact(cache.pool.keys, cache.pool.values, view.exact_slots, tokens)
    elif view is not None and entry.length:
        pool = cache.pool
        exact_pages = [entry.pages[i] for i in view.exact]
        ks = [pool.keys[p.slot, :, : p.tokens] for p in exact_pages]
        vs = [pool.values[p.slot, :, : p.tokens] for p in exact_pages]
    if k_new is not None:
        ks, vs = ks + [k_new], vs + [v_new]
    exact = (torch.cat(ks, 1), torch.cat(vs, 1)) if ks else None  # one copy of what is not paged
    if entry is None:
        return DecodeSegments(exact=exact)
    recent = view.recent_codes if view is not None else None
    mid = other = None
    if entry.mid is not None and entry.mid.tokens:
        mid = mid_codes(entry.mid)
        if mid is None:
            other = entry.mid.attention_inputs()
    retired = tuple(mid_codes(m) or m.attention_inputs() for m in entry.retired if m.tokens)
    return DecodeSegments(exact, recent, mid, other, cache.mid_encoding.project, retired, exact_pages=paged)


def attend_cache_batch(cache: LayerCache, seqs: Sequence[int], q: Tensor, k_new: Tensor, v_new: Tensor,
                       scale: float, softcap: float | None = None, pending: Sequence[int] | None = None) -> Tensor:
    """Decode step of several sequences (``Session._decode_batch``): q [B, Hq, 1, d] of sequence
    ``seqs[b]`` over its stored history plus k_new/v_new [B, Hkv, 1, d], one batched kernel call;
    returns [B, Hq, 1, dv] in q's dtype. ``softcap``: logits are ``softcap * tanh(logits /
    softcap)`` (None: uncapped). ``pending``: the rows whose new token is not stored yet (None:
    every row); the others' tokens are already in their history (``LayerCache.write_in_place``),
    so their k_new/v_new are not read. Does not store the pending tokens (the caller still calls
    ``cache.observe``/``cache.append``)."""
    if q.shape[2] != 1:
        raise ValueError(f"attend_cache_batch is for decode steps (one query token), got {q.shape[2]}")
    pending = set(range(len(seqs)) if pending is None else pending)
    segs = [decode_segments(cache, seq, k_new[b], v_new[b]) if b in pending else decode_segments(cache, seq)
            for b, seq in enumerate(seqs)]
    return decode_attention_batch(q[:, :, 0], segs, scale, softcap=softcap)[:, :, None].to(q.dtype)


def attend_cache(cache: LayerCache, seq: int, q: Tensor, k_new: Tensor | None, v_new: Tensor | None, scale: float,
                 softcap: float | None = None) -> Tensor:
    """``attend_cache_batch`` of one sequence: q [Hq, 1, d], k_new/v_new [Hkv, 1, d] -> [Hq, 1, dv]
    (k_new/v_new None: the new token is already stored)."""
    if k_new is None:
        return attend_cache_batch(cache, [seq], q[None], None, None, scale, softcap, pending=())[0]
    return attend_cache_batch(cache, [seq], q[None], k_new[None], v_new[None], scale, softcap)[0]
