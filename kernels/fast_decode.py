"""Fast decode attention (one query token per sequence) over a phased, compressed KV history.

The runtime keeps one sequence-layer's history as exact pages (pool), int8 Recent pages and a
contiguous Mid segment of packed low-bit coefficient codes (runtime/codecs.py). The torch
reference (kernels/compressed_attention.py via ``LayerCache.segments``) dequantizes all of it to
float32 every step. The fast path instead reads the codes as they are stored:

* ``DecodeSegments`` gathers, per step, the tensors the runtime already holds: exact K/V
  (Initial/Terminal pages plus the step's new token), Recent codes with their statistics, Mid
  row codes with their per-page statistics, and the head bases. Nothing is decoded.
* ``decode_attention(q [Hq, d], segs, scale, softcap=None)`` -> out [Hq, dv] dispatches: CUDA
  tensors go to the Triton kernels (kernels/triton_decode.py); CPU tensors go to
  ``cpu_decode_attention``.
* ``attend_cache(cache, seq, q, k_new, v_new, scale, softcap=None)`` is what
  ``Session._attend_one`` calls for decode steps (T == 1): same semantics (history + the new
  token, exactly merged; ``softcap``: every logit becomes ``softcap * tanh(logit / softcap)``
  before the softmax, Gemma-2's logit softcapping, in every segment and every backend).

CPU path: the Mid segment (where the bytes are) runs in a small C kernel compiled once with
the system C compiler (``-O3 -march=native -ffast-math``, cached under ~/.cache/kvtopo) and
called through ctypes (which releases the GIL, so splits of rows run on torch's thread count
of Python threads). For each split of 1024 rows and every kv-head at once it unpacks each
row's packed codes in registers, folds the page's key statistics into the projected query
(q_r * scale_r, q . offset: recomputed only when the page changes), so a logit is one short dot
with the raw codes; a two-pass softmax within the split then accumulates the weighted value
*codes* per page and applies the page's value statistics once per page. Splits and segments
are merged by log-sum-exp; the Mid output is projected back (``@ B_v^T + mean_v``) once per
query head. No [N, C] float matrix is ever built: the kernel reads N * C * bits / 8 bytes of
codes plus one statistics row per page. Exact and Recent segments are a few pages: they use
plain torch ops. Without a C compiler the Mid segment falls back to the torch reference
(dequantize + ``partial_lowrank``): slower, same result.

Measured (bench/decode_speed.py, 1 thread, shared 2-core machine): see bench/results.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .compressed_attention import LowRankHeads, merge_partials, partial_dense, partial_lowrank
from .quant import Quantized, dequantize

# -- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RecentCodes:
    """Recent pages of one sequence-layer, codes as stored (packed along the last dim).

    k_codes [Hkv, Nr, ceil(dk*bits/8)] uint8 with per-page per-channel statistics
    k_scale/k_offset [Hkv, Nr // page_size, dk]; v_codes [Hkv, Nr, ceil(dv*bits/8)] with
    per-token statistics v_scale/v_offset [Hkv, Nr]. Statistics float32. Recent pages are always
    full pages (only the last page of a sequence is partial, and it is Terminal), so token t's
    key statistics are row t // page_size.
    """

    k_codes: Tensor
    k_scale: Tensor
    k_offset: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_offset: Tensor
    bits: int
    page_size: int
    dk: int
    dv: int

    @property
    def tokens(self) -> int:
        return self.k_codes.shape[1]

    def decode(self) -> tuple[Tensor, Tensor]:
        """float32 keys [Hkv, Nr, dk] and values [Hkv, Nr, dv] (reference/fallback only)."""
        k_scale = self.k_scale.repeat_interleave(self.page_size, 1)[:, : self.tokens]
        k_offset = self.k_offset.repeat_interleave(self.page_size, 1)[:, : self.tokens]
        k = dequantize(Quantized(self.k_codes, k_scale, k_offset, self.bits, self.dk))
        v = dequantize(Quantized(self.v_codes, self.v_scale[..., None], self.v_offset[..., None], self.bits, self.dv))
        return k, v


@dataclass(frozen=True, eq=False)
class MidCodes:
    """A projected Mid segment, codes as stored.

    k_rows [N, ceil(Ck*k_bits/8)] uint8, codes of all kv-heads side by side (head h's columns
    are k_starts[h] .. k_starts[h] + k_ranks[h]), first code in the low bits; k_scale/k_offset
    [Pm, Ck] float32, one statistics row per page that kept rows; row_stat [N] int32: the
    statistics row of each code row. Values alike. Bases: k_vectors [Hkv, dk, Rk] (zero beyond
    each head's rank), k_mean [Hkv, dk]; v_vectors [Hkv, dv, Rv], v_mean [Hkv, dv], float32.
    k_starts/k_ranks/v_starts/v_ranks: int32 [Hkv].
    """

    k_rows: Tensor
    k_scale: Tensor
    k_offset: Tensor
    k_bits: int
    k_starts: Tensor
    k_ranks: Tensor
    k_vectors: Tensor
    k_mean: Tensor
    v_rows: Tensor
    v_scale: Tensor
    v_offset: Tensor
    v_bits: int
    v_starts: Tensor
    v_ranks: Tensor
    v_vectors: Tensor
    v_mean: Tensor
    row_stat: Tensor

    @property
    def tokens(self) -> int:
        return self.k_rows.shape[0]

    def decode(self) -> tuple[LowRankHeads, LowRankHeads]:
        """Dequantized coefficients as LowRankHeads (reference/fallback only)."""
        idx = self.row_stat.long()
        sides = []
        for rows, scale, offset, bits, starts, ranks, vectors, mean in (
            (self.k_rows, self.k_scale, self.k_offset, self.k_bits, self.k_starts, self.k_ranks,
             self.k_vectors, self.k_mean),
            (self.v_rows, self.v_scale, self.v_offset, self.v_bits, self.v_starts, self.v_ranks,
             self.v_vectors, self.v_mean)):
            width = scale.shape[1]
            flat = dequantize(Quantized(rows, scale[idx], offset[idx], bits, width))  # [N, C]
            heads, _, r_pad = vectors.shape
            padded = flat.new_zeros(heads, flat.shape[0], r_pad)
            for h in range(heads):
                s, r = int(starts[h]), int(ranks[h])
                padded[h, :, :r] = flat[:, s: s + r]
            sides.append(LowRankHeads(padded, vectors.float(), mean.float()))
        return sides[0], sides[1]


@dataclass(frozen=True, eq=False)
class DecodeSegments:
    """Everything one decode step of one sequence-layer attends to.

    exact: (keys [Hkv, N0, dk], values [Hkv, N0, dv]) — Initial/Terminal pages plus the step's
    new token (any float dtype); recent: RecentCodes; mid: MidCodes (projected, quantized);
    mid_other: Mid stored another way (baseline policies: dense (keys, values) or float
    coefficients as (LowRankHeads, LowRankHeads)) attended by the torch reference;
    retired: earlier Mid epochs (topo refits its bases as the sequence grows), each MidCodes or,
    uncoded, (LowRankHeads, LowRankHeads). Any of them may be None/empty (an empty phase).
    """

    exact: tuple[Tensor, Tensor] | None = None
    recent: RecentCodes | None = None
    mid: MidCodes | None = None
    mid_other: tuple | None = None
    mid_other_projected: bool = False
    retired: tuple = ()

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: exact K/V, Recent codes + statistics, Mid codes +
        statistics + row index + bases (the torch-reference fallback segment counted as held)."""
        tensors = list(self.exact or ())
        coded = [self.recent, self.mid] + [e for e in self.retired if isinstance(e, MidCodes)]
        for part in coded:
            if part is not None:
                tensors += [v for v in vars(part).values() if isinstance(v, Tensor)]
        uncoded = list(self.mid_other or ()) + [s for e in self.retired if not isinstance(e, MidCodes) for s in e]
        for side in uncoded:
            tensors += [side.coefficients, side.vectors, side.mean] if isinstance(side, LowRankHeads) else [side]
        return sum(t.nbytes for t in tensors)

    @property
    def kv_heads(self) -> int:
        for t in (self.exact and self.exact[0], self.recent and self.recent.k_codes,
                  self.mid and self.mid.k_vectors):
            if t is not None:
                return t.shape[0]
        if self.mid_other is not None:
            first = self.mid_other[0]
            return (first.vectors if isinstance(first, LowRankHeads) else first).shape[0]
        raise ValueError("DecodeSegments holds no segment")


# -- building from the runtime's store -------------------------------------------------------

_STAT_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _row_stat(coded) -> Tensor:
    """[N] int32 statistics row of every Mid code row, from page_rows (cached per buffer size)."""
    hit = _STAT_CACHE.get(coded)
    if hit is not None and hit[0] == coded.count:
        return hit[1]
    counts = coded.page_rows[coded.page_rows > 0].long()
    idx = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(torch.int32)
    idx = idx.to(coded.rows.device)
    _STAT_CACHE[coded] = (coded.count, idx)
    return idx


_F32_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _stats_f32(coded) -> tuple[Tensor, Tensor]:
    """float32 (scale, offset) of a CodedRows (stored float16), converted once per append."""
    hit = _F32_CACHE.get(coded)
    if hit is not None and hit[0] == coded.count and hit[1] is coded.scale:
        return hit[2]
    pair = (coded.scale.float().contiguous(), coded.offset.float().contiguous())
    _F32_CACHE[coded] = (coded.count, coded.scale, pair)
    return pair


def _starts(ranks) -> tuple[Tensor, Tensor]:
    r = torch.tensor(ranks, dtype=torch.int32)
    return torch.cumsum(r, 0, dtype=torch.int32) - r, r


def mid_codes(mid) -> MidCodes | None:
    """MidCodes view of a runtime ``MidSegment`` that is projected and quantized (else None)."""
    e = mid.encoding
    if mid.tokens == 0 or not (e.project and e.key_bits and e.value_bits):
        return None
    dev = mid.keys.rows.device
    ks, kr = _starts(mid.key_bases.ranks)
    vs, vr = _starts(mid.value_bases.ranks)
    return MidCodes(
        mid.keys.rows, *_stats_f32(mid.keys), e.key_bits, ks.to(dev), kr.to(dev),
        mid.key_bases.vectors.float(), mid.key_bases.mean.float(),
        mid.values.rows, *_stats_f32(mid.values), e.value_bits, vs.to(dev), vr.to(dev),
        mid.value_bases.vectors.float(), mid.value_bases.mean.float(), _row_stat(mid.keys))


def recent_codes(pages, page_size: int) -> RecentCodes | None:
    """Stack the Recent pages' codes (a few pages: a small copy, nothing decoded)."""
    pages = [p.recent for p in pages if p.recent is not None]
    if not pages:
        return None
    k, v = pages[0].keys, pages[0].values
    return RecentCodes(
        torch.cat([p.keys.codes for p in pages], 1),
        torch.cat([p.keys.scale.float() for p in pages], 1),
        torch.cat([p.keys.offset.float() for p in pages], 1),
        torch.cat([p.values.codes for p in pages], 1),
        torch.cat([p.values.scale.float()[..., 0] for p in pages], 1),
        torch.cat([p.values.offset.float()[..., 0] for p in pages], 1),
        k.bits, page_size, k.length, v.length)


def decode_segments(cache, seq: int, k_new: Tensor | None = None, v_new: Tensor | None = None) -> DecodeSegments:
    """DecodeSegments of sequence ``seq`` in a runtime ``LayerCache``, plus the step's new
    k/v [Hkv, 1, d] appended to the exact segment (the new token sees itself)."""
    entry = cache.sequences.get(seq)
    exact = None
    if entry is not None and entry.length:
        exact_pages = [p for p in entry.pages if p.slot is not None]
        if exact_pages:
            pool = cache.pool
            ks = [pool.keys[p.slot, :, : p.tokens] for p in exact_pages]
            vs = [pool.values[p.slot, :, : p.tokens] for p in exact_pages]
            exact = (torch.cat(ks, 1), torch.cat(vs, 1))
    if k_new is not None:
        exact = (k_new, v_new) if exact is None else (torch.cat([exact[0], k_new], 1), torch.cat([exact[1], v_new], 1))
    if entry is None:
        return DecodeSegments(exact=exact)
    recent = recent_codes(entry.pages, cache.config.page_size)
    mid = other = None
    if entry.mid is not None and entry.mid.tokens:
        mid = mid_codes(entry.mid)
        if mid is None:
            other = entry.mid.attention_inputs()
    retired = tuple(mid_codes(m) or m.attention_inputs() for m in entry.retired if m.tokens)
    return DecodeSegments(exact, recent, mid, other, cache.mid_encoding.project, retired)


def attend_cache(cache, seq: int, q: Tensor, k_new: Tensor, v_new: Tensor, scale: float,
                 softcap: float | None = None) -> Tensor:
    """Decode step of ``Session._attend_one``: q [Hq, 1, d] over the stored history of ``seq``
    plus k_new/v_new [Hkv, 1, d]; returns [Hq, 1, dv] in q's dtype. ``softcap``: logits are
    ``softcap * tanh(logits / softcap)`` (None: uncapped). Does not store the token (the caller
    still calls ``cache.observe``/``cache.append``)."""
    if q.shape[1] != 1:
        raise ValueError(f"attend_cache is for decode steps (one query token), got {q.shape[1]}")
    segs = decode_segments(cache, seq, k_new, v_new)
    return decode_attention(q[:, 0], segs, scale, softcap=softcap)[:, None].to(q.dtype)


# -- reference -------------------------------------------------------------------------------


def explicit_kv(segs: DecodeSegments, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    """Every segment decoded to explicit K and V [Hkv, N, d] in ``dtype`` (same stored codes)."""
    ks, vs = [], []
    if segs.exact is not None:
        ks.append(segs.exact[0].to(dtype))
        vs.append(segs.exact[1].to(dtype))
    if segs.recent is not None:
        k, v = segs.recent.decode()
        ks.append(k.to(dtype))
        vs.append(v.to(dtype))
    lowrank = segs.mid.decode() if segs.mid is not None else (
        segs.mid_other if segs.mid_other_projected else None)
    epochs = [e.decode() if isinstance(e, MidCodes) else e for e in segs.retired]
    for epoch in epochs + ([lowrank] if lowrank is not None else []):
        for side, out in zip(epoch, (ks, vs)):
            out.append(side.coefficients.to(dtype) @ side.vectors.to(dtype).transpose(1, 2) + side.mean.to(dtype)[:, None])
    if lowrank is None and segs.mid_other is not None:
        ks.append(segs.mid_other[0].to(dtype))
        vs.append(segs.mid_other[1].to(dtype))
    return torch.cat(ks, 1), torch.cat(vs, 1)


def reference_decode(q: Tensor, segs: DecodeSegments, scale: float, dtype=torch.float64,
                     softcap: float | None = None) -> Tensor:
    """Ground truth: every segment decoded to explicit K/V, one softmax, in ``dtype``."""
    k, v = explicit_kv(segs, dtype)
    hkv = k.shape[0]
    qg = q.to(dtype).reshape(hkv, -1, q.shape[-1])
    logits = scale * qg @ k.transpose(1, 2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    p = torch.softmax(logits, -1)
    return (p @ v).reshape(q.shape[0], -1)


# -- dispatch --------------------------------------------------------------------------------


def decode_attention(q: Tensor, segs: DecodeSegments, scale: float, out: Tensor | None = None,
                     softcap: float | None = None) -> Tensor:
    """Attention of q [Hq, d] (one token) over all segments -> [Hq, dv] float32.

    ``softcap``: logits are ``softcap * tanh(logits / softcap)`` before the softmax (None: not).
    CUDA tensors run the Triton kernels; CPU tensors the fused C kernel (or torch fallback)."""
    _check_softcap(softcap)
    if q.is_cuda:
        from .triton_decode import triton_decode_attention

        return triton_decode_attention(q, segs, scale, out=out, softcap=softcap)
    result = cpu_decode_attention(q, segs, scale, softcap=softcap)
    if out is not None:
        out.copy_(result)
        return out
    return result


def _check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")


# -- CPU path --------------------------------------------------------------------------------


def _dense_partial(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(out [Hq, dv], lse [Hq]) of q [Hq, d] over k [Hkv, n, d], v [Hkv, n, dv], float32."""
    out, lse = partial_dense(q[:, None], k, v, scale, softcap=softcap)
    return out[:, 0], lse[:, 0]


def cpu_decode_attention(q: Tensor, segs: DecodeSegments, scale: float, softcap: float | None = None) -> Tensor:
    _check_softcap(softcap)
    parts = []
    if segs.exact is not None and segs.exact[0].shape[1]:
        parts.append(_dense_partial(q, *segs.exact, scale, softcap))
    if segs.recent is not None and segs.recent.tokens:
        parts.append(_dense_partial(q, *segs.recent.decode(), scale, softcap))
    if segs.mid is not None and segs.mid.tokens:
        parts.append(mid_partial_cpu(q, segs.mid, scale, softcap))
    elif segs.mid_other is not None:
        attend = partial_lowrank if segs.mid_other_projected else partial_dense
        out, lse = attend(q[:, None], *segs.mid_other, scale, softcap=softcap)
        parts.append((out[:, 0], lse[:, 0]))
    for epoch in segs.retired:
        if isinstance(epoch, MidCodes):
            parts.append(mid_partial_cpu(q, epoch, scale, softcap))
        else:
            out, lse = partial_lowrank(q[:, None], *epoch, scale, softcap=softcap)
            parts.append((out[:, 0], lse[:, 0]))
    if not parts:
        raise ValueError("decode attention over an empty history")
    return merge_partials(parts)


def mid_partial_cpu(q: Tensor, mid: MidCodes, scale: float, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """(out [Hq, dv], lse [Hq]) of q [Hq, d] over a projected, quantized Mid segment
    (``softcap``: capped logits; passed to C as a float, 0 meaning none)."""
    lib = _library()
    hkv, dk, rk = mid.k_vectors.shape
    dv, rv = mid.v_vectors.shape[1:]
    hq = q.shape[0]
    g = hq // hkv
    qg = q.float().reshape(hkv, g, dk)
    qp = (scale * (qg @ mid.k_vectors)).contiguous()  # [Hkv, G, Rk]
    qb = (scale * (qg @ mid.k_mean[..., None]))[..., 0].contiguous()  # [Hkv, G]
    if lib is None:
        keys, values = mid.decode()
        out, lse = partial_lowrank(q[:, None], keys, values, scale, softcap=softcap)
        return out[:, 0], lse[:, 0]
    n = mid.tokens
    threads = torch.get_num_threads()
    splits = max(1, -(-n // 1024))  # 1024 rows a split: its logits stay in L2
    coef = torch.empty(splits, hkv, g, rv)
    lse = torch.empty(splits, hkv, g)
    t = [mid.k_rows, mid.k_scale, mid.k_offset, mid.k_starts, mid.k_ranks,
         mid.v_rows, mid.v_scale, mid.v_offset, mid.v_starts, mid.v_ranks, mid.row_stat]
    t = [x.contiguous() for x in t]
    p = lambda x: ctypes.c_void_p(x.data_ptr())  # noqa: E731
    args = (p(t[0]), t[0].shape[1], p(t[1]), p(t[2]), t[1].shape[1], p(t[3]), p(t[4]), mid.k_bits,
            p(t[5]), t[5].shape[1], p(t[6]), p(t[7]), t[6].shape[1], p(t[8]), p(t[9]), mid.v_bits,
            p(t[10]), p(coef), p(lse))
    tasks = splits
    bounds = [tasks * i // threads for i in range(threads + 1)]
    cap = ctypes.c_float(0.0 if softcap is None else float(softcap))
    call = lambda a, b: lib.kvtopo_mid_decode(p(qp), p(qb), hkv, g, rk, rv, n, splits, a, b, cap, *args)  # noqa: E731
    if threads == 1 or tasks == 1:
        call(0, tasks)
    else:  # ctypes drops the GIL during the call: the worker threads run the C code in parallel
        futures = [_pool(threads).submit(call, a, b) for a, b in zip(bounds[1:-1], bounds[2:])]
        call(bounds[0], bounds[1])
        for f in futures:
            f.result()
    # merge splits (coefficient domain, linear), then project back once per query head
    m = lse.amax(0, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)  # [S, Hkv, G]
    total = w.sum(0)
    mixed = (w[..., None] * coef).sum(0) / total.clamp_min(1e-38)[..., None]  # [Hkv, G, Rv]
    out = mixed @ mid.v_vectors.transpose(1, 2) + mid.v_mean[:, None]
    return out.reshape(hq, dv), (m[0] + total.log()).reshape(hq)


_C_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* All C codes of one row as floats (the row is short: sum of ranks codes). */
static inline void unpack_row(const uint8_t *row, int C, int bits, float *u) {
    if (bits == 8) {
        for (int c = 0; c < C; ++c) u[c] = (float)row[c];
    } else if (bits == 4) {
        int nb = (C + 1) / 2;
        for (int i = 0; i < nb; ++i) {
            uint8_t b = row[i];
            u[2 * i] = (float)(b & 15);
            u[2 * i + 1] = (float)(b >> 4);
        }
    } else {
        int nb = (C + 3) / 4;
        for (int i = 0; i < nb; ++i) {
            uint8_t b = row[i];
            u[4 * i] = (float)(b & 3);
            u[4 * i + 1] = (float)((b >> 2) & 3);
            u[4 * i + 2] = (float)((b >> 4) & 3);
            u[4 * i + 3] = (float)(b >> 6);
        }
    }
}

/* Splits [s0, s1) of the rows, every kv-head and query head at once. Statistics are per page,
   so they are folded into the query (keys) or applied once per page to code sums (values):
     logit = q.mean_k + sum_r q_r off_r + sum_r (q_r scale_r) code_r
     sum_n p_n c_n = sum_pages (scale * sum_n p_n code_n + off * sum_n p_n)
   Pass 1: logits of every row and query head, and their max; pass 2: softmax weights and
   the weighted value codes. Rows go 4 at a time (register blocking: each query/accumulator
   element loaded once per 4 rows); a block never crosses a page (rows past its end get zero
   codes and zero weight). Writes coef [S, H, G, RV] (normalised within the split, zero beyond
   each head's rank) and lse [S, H, G] (-inf and 0 for an empty split).
   cap > 0: every logit becomes cap * tanh(logit / cap) (logit softcapping) as soon as it is
   computed, before the max and the softmax; cap == 0: logits are used as they are. */
#define RB 4
void kvtopo_mid_decode(const float *qp, const float *qb, int H, int G, int RK, int RV, int N, int S,
                       int s0, int s1, float cap,
                       const uint8_t *krows, int kbytes, const float *kscale, const float *koff, int kC,
                       const int *kstarts, const int *kranks, int kbits,
                       const uint8_t *vrows, int vbytes, const float *vscale, const float *voff, int vC,
                       const int *vstarts, const int *vranks, int vbits,
                       const int *row_stat, float *coef, float *lse) {
    int HG = H * G;
    int per = (N + S - 1) / S;
    int CM = ((kC > vC ? kC : vC) + 15) & ~7;
    float *u = (float *)calloc((size_t)RB * CM, sizeof(float));
    float *qs = (float *)malloc(sizeof(float) * (size_t)HG * (RK > 0 ? RK : 1));
    float *bias = (float *)malloc(sizeof(float) * HG * 4);
    float *m = bias + HG, *l = bias + 2 * HG, *P = bias + 3 * HG;
    float *A = (float *)malloc(sizeof(float) * (size_t)HG * (RV > 0 ? RV : 1));
    float *pb = (float *)malloc(sizeof(float) * (size_t)RB * HG);
    for (int s = s0; s < s1; ++s) {
        int n0 = s * per, n1 = n0 + per < N ? n0 + per : N;
        float *acc = coef + (size_t)s * HG * RV;
        float *out_lse = lse + (size_t)s * HG;
        memset(acc, 0, sizeof(float) * (size_t)HG * RV);
        if (n1 <= n0) {
            for (int i = 0; i < HG; ++i) out_lse[i] = -INFINITY;
            continue;
        }
        float *logits = (float *)malloc(sizeof(float) * (size_t)(n1 - n0 + RB) * HG);
        for (int i = 0; i < HG; ++i) m[i] = -INFINITY;
        int cur = -1;
        for (int n = n0; n < n1;) {
            int st = row_stat[n];
            int nb = 1;
            while (nb < RB && n + nb < n1 && row_stat[n + nb] == st) ++nb;
            if (st != cur) {
                cur = st;
                for (int h = 0; h < H; ++h) {
                    const float *sc = kscale + (size_t)st * kC + kstarts[h];
                    const float *of = koff + (size_t)st * kC + kstarts[h];
                    int rk = kranks[h];
                    for (int g = 0; g < G; ++g) {
                        int hg = h * G + g;
                        const float *q = qp + (size_t)hg * RK;
                        float b = qb[hg];
                        for (int r = 0; r < rk; ++r) {
                            qs[(size_t)hg * RK + r] = q[r] * sc[r];
                            b += q[r] * of[r];
                        }
                        bias[hg] = b;
                    }
                }
            }
            for (int i = 0; i < RB; ++i) {
                if (i < nb) unpack_row(krows + (size_t)(n + i) * kbytes, kC, kbits, u + (size_t)i * CM);
                else memset(u + (size_t)i * CM, 0, sizeof(float) * CM);
            }
            float *lg = logits + (size_t)(n - n0) * HG;
            for (int h = 0; h < H; ++h) {
                const float *u0 = u + kstarts[h], *u1 = u0 + CM, *u2 = u1 + CM, *u3 = u2 + CM;
                int rk = kranks[h];
                for (int g = 0; g < G; ++g) {
                    int hg = h * G + g;
                    const float *q = qs + (size_t)hg * RK;
                    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
                    for (int r = 0; r < rk; ++r) {
                        float qv = q[r];
                        d0 += qv * u0[r]; d1 += qv * u1[r]; d2 += qv * u2[r]; d3 += qv * u3[r];
                    }
                    float bb = bias[hg];
                    lg[hg] = bb + d0; lg[HG + hg] = bb + d1; lg[2 * HG + hg] = bb + d2; lg[3 * HG + hg] = bb + d3;
                }
            }
            if (cap > 0.f)
                for (int i = 0; i < nb * HG; ++i) lg[i] = cap * tanhf(lg[i] / cap);
            for (int i = 0; i < nb; ++i)
                for (int j = 0; j < HG; ++j) m[j] = lg[i * HG + j] > m[j] ? lg[i * HG + j] : m[j];
            n += nb;
        }
        for (int i = 0; i < HG; ++i) { l[i] = 0.f; P[i] = 0.f; }
        memset(A, 0, sizeof(float) * (size_t)HG * RV);
        cur = row_stat[n0];
        for (int n = n0; n <= n1;) {
            int st = n < n1 ? row_stat[n] : -1;
            if (st != cur) {  /* flush the page's code sums through its statistics */
                for (int h = 0; h < H; ++h) {
                    const float *sc = vscale + (size_t)cur * vC + vstarts[h];
                    const float *of = voff + (size_t)cur * vC + vstarts[h];
                    int rv = vranks[h];
                    for (int g = 0; g < G; ++g) {
                        int hg = h * G + g;
                        float *a = A + (size_t)hg * RV, *o = acc + (size_t)hg * RV;
                        float pp = P[hg];
                        for (int r = 0; r < rv; ++r) { o[r] += sc[r] * a[r] + of[r] * pp; a[r] = 0.f; }
                        P[hg] = 0.f;
                    }
                }
                cur = st;
            }
            if (n == n1) break;
            int nb = 1;
            while (nb < RB && n + nb < n1 && row_stat[n + nb] == st) ++nb;
            for (int i = 0; i < RB; ++i) {
                if (i < nb) unpack_row(vrows + (size_t)(n + i) * vbytes, vC, vbits, u + (size_t)i * CM);
                else memset(u + (size_t)i * CM, 0, sizeof(float) * CM);
            }
            const float *lg = logits + (size_t)(n - n0) * HG;
            for (int i = 0; i < nb; ++i)
                for (int j = 0; j < HG; ++j) pb[i * HG + j] = expf(lg[i * HG + j] - m[j]);
            for (int i = nb * HG; i < RB * HG; ++i) pb[i] = 0.f;
            for (int i = 0; i < nb; ++i)
                for (int j = 0; j < HG; ++j) { l[j] += pb[i * HG + j]; P[j] += pb[i * HG + j]; }
            for (int h = 0; h < H; ++h) {
                const float *u0 = u + vstarts[h], *u1 = u0 + CM, *u2 = u1 + CM, *u3 = u2 + CM;
                int rv = vranks[h];
                for (int g = 0; g < G; ++g) {
                    int hg = h * G + g;
                    float p0 = pb[hg], p1 = pb[HG + hg], p2 = pb[2 * HG + hg], p3 = pb[3 * HG + hg];
                    float *a = A + (size_t)hg * RV;
                    for (int r = 0; r < rv; ++r) a[r] += p0 * u0[r] + p1 * u1[r] + p2 * u2[r] + p3 * u3[r];
                }
            }
            n += nb;
        }
        for (int i = 0; i < HG; ++i) {
            float inv = 1.f / l[i];
            for (int r = 0; r < RV; ++r) acc[(size_t)i * RV + r] *= inv;
            out_lse[i] = m[i] + logf(l[i]);
        }
        free(logits);
    }
    free(u); free(qs); free(bias); free(A); free(pb);
}
"""

_LIB = None
_LIB_TRIED = False
_POOL = None


def _pool(threads: int):
    global _POOL
    if _POOL is None or _POOL._max_workers < threads - 1:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=max(1, threads - 1), thread_name_prefix="kvtopo-decode")
    return _POOL

_LIB_LOCK = threading.Lock()


def _library():
    """The compiled C kernel (built once per source and machine, cached on disk), or None."""
    global _LIB, _LIB_TRIED
    if _LIB_TRIED:
        return _LIB
    with _LIB_LOCK:
        if _LIB_TRIED:
            return _LIB
        _LIB_TRIED = True
        if os.environ.get("KVTOPO_NO_CKERNEL"):
            return None
        flags = ["-O3", "-march=native", "-ffast-math", "-shared", "-fPIC"]
        tag = hashlib.sha256((_C_SOURCE + " ".join(flags)).encode()).hexdigest()[:16]
        root = Path(os.environ.get("KVTOPO_CACHE", Path.home() / ".cache" / "kvtopo"))
        so = root / f"mid_decode_{tag}.so"
        try:
            if not so.exists():
                root.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=root) as tmp:
                    src = Path(tmp) / "mid_decode.c"
                    src.write_text(_C_SOURCE)
                    built = Path(tmp) / "mid_decode.so"
                    cc = os.environ.get("CC", "cc")
                    subprocess.run([cc, *flags, str(src), "-o", str(built), "-lm", "-lmvec"], check=True,
                                   capture_output=True, timeout=120)
                    os.replace(built, so)
            lib = ctypes.CDLL(str(so))
            i, f = ctypes.c_int, ctypes.c_void_p
            lib.kvtopo_mid_decode.argtypes = [f, f, i, i, i, i, i, i, i, i, ctypes.c_float,
                                              f, i, f, f, i, f, f, i,
                                              f, i, f, f, i, f, f, i,
                                              f, f, f]
            lib.kvtopo_mid_decode.restype = None
            _LIB = lib
        except (OSError, subprocess.SubprocessError):
            _LIB = None
        return _LIB


def c_kernel_available() -> bool:
    return _library() is not None


# -- synthetic inputs (tests, benchmarks) ----------------------------------------------------


def synthetic_segments(
    kv_heads: int = 2, group: int = 4, dk: int = 64, dv: int = 64, exact: int = 5,
    recent_pages: int = 1, page_size: int = 8, mid_page_rows: tuple[int, ...] = (8, 3, 0, 5),
    k_ranks: tuple[int, ...] | None = None, v_ranks: tuple[int, ...] | None = None,
    recent_bits: int = 8, mid_bits: int = 4, seed: int = 0, exact_dtype=torch.float32,
    device="cpu",
) -> DecodeSegments:
    """Random segments encoded exactly as the runtime encodes them (quant.quantize per page),
    for tests and benchmarks. Any phase can be empty (exact=0, recent_pages=0, no mid rows)."""
    from .quant import quantize

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
        rec = RecentCodes(
            torch.cat([k.codes for k, _ in pages], 1), torch.cat([k.scale.float() for k, _ in pages], 1),
            torch.cat([k.offset.float() for k, _ in pages], 1), torch.cat([v.codes for _, v in pages], 1),
            torch.cat([v.scale.float()[..., 0] for _, v in pages], 1),
            torch.cat([v.offset.float()[..., 0] for _, v in pages], 1), recent_bits, page_size, dk, dv)
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
            starts, r32 = _starts(ranks)
            sides.append((torch.cat(rows), torch.cat(scale), torch.cat(offset), starts, r32, vectors, randn(kv_heads, d)))
        counts = torch.tensor([n for n in mid_page_rows if n])
        stat = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(torch.int32)
        (kr, ks, ko, kst, krk, kv, km), (vr, vs, vo, vst, vrk, vv, vm) = sides
        mid = MidCodes(kr, ks, ko, mid_bits, kst, krk, kv, km, vr, vs, vo, mid_bits, vst, vrk, vv, vm, stat)
    segs = DecodeSegments(ex, rec, mid)
    return _to(segs, device)


def _to(segs: DecodeSegments, device) -> DecodeSegments:
    def move(x):
        if isinstance(x, Tensor):
            return x.to(device)
        if isinstance(x, (RecentCodes, MidCodes)):
            return type(x)(**{k: move(v) for k, v in vars(x).items()})
        if isinstance(x, tuple):
            return tuple(move(v) for v in x)
        return x
    return DecodeSegments(move(segs.exact), move(segs.recent), move(segs.mid), move(segs.mid_other),
                          segs.mid_other_projected, tuple(move(e) for e in segs.retired))
