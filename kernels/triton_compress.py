"""Triton page compressor: exp-free token score, projection onto head bases, low-bit codes.

What runtime/layer_cache.py does (in torch) when a page enters Mid, as three kernels:

* ``expfree_scores_triton(q_obs [Hq, W, d], k [Hkv, n, d], scale, margin) -> [Hkv, n]`` —
  kernels.scoring.expfree_scores: one program per kv-head, the G*W observation rows of the
  group as one tile; ``sum relu(s - rowmax(s) + margin)`` over rows. No exponential.
* ``project_quantize_triton(x [Hkv, n, d], vectors [Hkv, d, R], mean [Hkv, d], ranks, bits)``
  -> (codes [n, ceil(C*bits/8)] uint8, scale [1, C], offset [1, C]) — HeadBases.project +
  quant.quantize(reduce_dim=0), i.e. what ``CodedRows.append`` stores for a projected page:
  ``_project_minmax_kernel`` (one program per kv-head) writes the coefficients of the head's
  true-rank columns and their per-column min/max over the page's rows; the statistics are
  rounded to float16 exactly as quant.py does (offset down, scale up, float32 fallback),
  on [C]-sized vectors in torch; ``_pack_kernel`` then rounds every coefficient to its level
  (round half to even, as torch.round) and packs ``8 // bits`` codes a byte, first in the low
  bits.

Coefficients are float32 dot products in a different summation order than torch's matmul, so a
code can differ by one level from the torch path where a coefficient falls within float32
rounding of a level boundary; the statistics can differ likewise by one float16 step. The tests
check reconstruction within the quantization bound and codes within one level.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .quant import _statistics, float16_holds


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, x)))


@triton.jit
def _expfree_kernel(q_ptr, k_ptr, out_ptr, n, scale, margin,
                    stride_qh, stride_qw, stride_kh, stride_kn,
                    G: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
                    ROWS_PAD: tl.constexpr, N_PAD: tl.constexpr, D_PAD: tl.constexpr):
    h = tl.program_id(0)
    rows = tl.arange(0, ROWS_PAD)
    rn = tl.arange(0, N_PAD)
    rd = tl.arange(0, D_PAD)
    g = rows // W
    w = rows % W
    row_ok = rows < G * W
    n_ok = rn < n
    q = tl.load(q_ptr + (h * G + g)[:, None] * stride_qh + w[:, None] * stride_qw + rd[None, :],
                mask=row_ok[:, None] & (rd[None, :] < D), other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + h * stride_kh + rn[:, None] * stride_kn + rd[None, :],
                mask=n_ok[:, None] & (rd[None, :] < D), other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(n_ok[None, :], s, float("-inf"))
    m = tl.max(s, 1)
    credit = tl.maximum(s - m[:, None] + margin, 0.0)
    credit = tl.where(row_ok[:, None] & n_ok[None, :], credit, 0.0)
    tl.store(out_ptr + h * n + rn, tl.sum(credit, 0), mask=n_ok)


def expfree_scores_triton(q_obs: Tensor, k: Tensor, scale: float, margin: float = 4.0) -> Tensor:
    """Exp-free importance [Hkv, n] of a page's keys k [Hkv, n, d] (kernels.scoring.expfree_scores)."""
    hq, w, d = q_obs.shape
    hkv, n, _ = k.shape
    g = hq // hkv
    q_obs, k = q_obs.contiguous(), k.contiguous()
    out = torch.empty(hkv, n, device=k.device)
    if n == 0:
        return out
    _expfree_kernel[(hkv,)](q_obs, k, out, n, float(scale), float(margin),
                            q_obs.stride(0), q_obs.stride(1), k.stride(0), k.stride(1),
                            G=g, W=w, D=d, ROWS_PAD=_pow2(g * w), N_PAD=_pow2(n), D_PAD=_pow2(d))
    return out


@triton.jit
def _project_minmax_kernel(x_ptr, vec_ptr, mean_ptr, start_ptr, rank_ptr, coef_ptr, lo_ptr, hi_ptr,
                           n, C, stride_xh, stride_xn,
                           D: tl.constexpr, R: tl.constexpr,
                           N_PAD: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr):
    h = tl.program_id(0)
    rn = tl.arange(0, N_PAD)
    rd = tl.arange(0, D_PAD)
    rr = tl.arange(0, R_PAD)
    rank = tl.load(rank_ptr + h)
    start = tl.load(start_ptr + h)
    n_ok = rn < n
    d_ok = rd < D
    x = tl.load(x_ptr + h * stride_xh + rn[:, None] * stride_xn + rd[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + h * D + rd, mask=d_ok, other=0.0)
    x = tl.where(n_ok[:, None] & d_ok[None, :], x - mean[None, :], 0.0)
    r_ok = rr < rank
    vec = tl.load(vec_ptr + h * D * R + rd[:, None] * R + rr[None, :], mask=d_ok[:, None] & r_ok[None, :], other=0.0)
    c = tl.dot(x, vec, input_precision="ieee")  # [N_PAD, R_PAD]
    ok = n_ok[:, None] & r_ok[None, :]
    tl.store(coef_ptr + rn[:, None] * C + (start + rr)[None, :], c, mask=ok)
    tl.store(lo_ptr + start + rr, tl.min(tl.where(ok, c, float("inf")), 0), mask=r_ok)
    tl.store(hi_ptr + start + rr, tl.max(tl.where(ok, c, float("-inf")), 0), mask=r_ok)


@triton.jit
def _pack_kernel(coef_ptr, scale_ptr, offset_ptr, codes_ptr, n, C, CB,
                 BITS: tl.constexpr, BLOCK_N: tl.constexpr, CB_PAD: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, CB_PAD)
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    n_ok = rn < n
    packed = tl.zeros([BLOCK_N, CB_PAD], tl.int32)
    for i in tl.static_range(PER):
        col = rb * PER + i
        c_ok = col < C
        ok = n_ok[:, None] & c_ok[None, :]
        x = tl.load(coef_ptr + rn[:, None] * C + col[None, :], mask=ok, other=0.0)
        sc = tl.load(scale_ptr + col, mask=c_ok, other=1.0)
        off = tl.load(offset_ptr + col, mask=c_ok, other=0.0)
        step = tl.where(sc > 0, sc, 1.0)
        v = (x - off[None, :]) / step[None, :]
        f = tl.floor(v)
        frac = v - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
        r = tl.where(frac > 0.5, f + 1.0, tl.where(frac < 0.5, f, tl.where(odd, f + 1.0, f)))  # half to even
        r = tl.minimum(tl.maximum(r, 0.0), LEVELS * 1.0)
        code = tl.where(ok, r.to(tl.int32), 0)
        packed = packed | (code << (i * BITS))
    tl.store(codes_ptr + rn[:, None] * CB + rb[None, :], packed.to(tl.uint8),
             mask=n_ok[:, None] & (rb[None, :] < CB))


def project_quantize_triton(x: Tensor, vectors: Tensor, mean: Tensor, ranks, bits: int):
    """Coefficients of one page x [Hkv, n, d] on the head bases, quantized per column over the
    page's rows: (codes [n, ceil(C*bits/8)] uint8, scale [1, C], offset [1, C]) as
    ``quant.quantize(HeadBases.project(x), bits, reduce_dim=0)`` stores them."""
    hkv, n, d = x.shape
    r_pad = vectors.shape[-1]
    ranks_t = torch.tensor(list(ranks), dtype=torch.int32)
    starts = (torch.cumsum(ranks_t, 0) - ranks_t).to(torch.int32).to(x.device)
    ranks_t = ranks_t.to(x.device)
    c = int(sum(ranks))
    if n == 0 or c == 0:
        raise ValueError(f"nothing to quantize: {n} rows, {c} columns")
    x = x.contiguous()
    coef = torch.empty(n, c, device=x.device)
    lo = torch.empty(c, device=x.device)
    hi = torch.empty(c, device=x.device)
    _project_minmax_kernel[(hkv,)](x, vectors.float().contiguous(), mean.float().contiguous(), starts, ranks_t,
                                   coef, lo, hi, n, c, x.stride(0), x.stride(1),
                                   D=d, R=r_pad, N_PAD=_pow2(n), D_PAD=_pow2(d), R_PAD=_pow2(r_pad))
    levels = (1 << bits) - 1
    lo, hi = lo[None], hi[None]
    offset, scale = _statistics(lo, hi, levels, torch.float16)
    if not float16_holds(lo, hi).item():
        offset, scale = _statistics(lo, hi, levels, torch.float32)
    per = 8 // bits
    cb = -(-c // per)
    codes = torch.empty(n, cb, dtype=torch.uint8, device=x.device)
    block = 16
    _pack_kernel[(triton.cdiv(n, block),)](coef, scale.float().contiguous(), offset.float().contiguous(), codes,
                                           n, c, cb, BITS=bits, BLOCK_N=block, CB_PAD=_pow2(cb))
    return codes, scale, offset
