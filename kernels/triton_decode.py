"""Triton split-K attention over kvtopo's mixed segments: a decode step (one query token per
sequence), or a prefill chunk's queries over the stored history.

Entries: ``triton_decode_attention(q [Hq, d], segs: DecodeSegments, scale, out=None, softcap=None)
-> [Hq, dv]`` (``kernels.fast_decode.decode_attention`` dispatches CUDA tensors here) and
``history_partials(q [Hq, T, d], segs, scale, softcap=None) -> (out [Hq, T, dv], lse [Hq, T])``
(``kernels.history_attention``: every row sees every stored token). The segments are what
the runtime stores (see ``decode_inputs.DecodeSegments``):

* exact K/V [Hkv, N0, d] (any float dtype)            -> ``_dense_split_kernel`` (QUANT=False)
* Recent codes (packed b-bit, keys per page/channel,
  values per token statistics)                         -> ``_dense_split_kernel`` (QUANT=True)
* Mid rows [N, ceil(C*b/8)] uint8, per-page stats,
  head bases                                           -> ``_mid_split_kernel``
* unprojected Mid codes (identity basis, per-token
  value statistics)                                    -> ``_mid_split_kernel`` (VALUE_PER_ROW)

Every kernel runs one program per (kv-head, split of tokens, block of query rows): the query rows
of a kv-head are its G query heads times the T tokens (T = 1 when decoding: the group is one
tile, so keys/values are read once for it), in tiles of BLOCK_M rows. Codes are
loaded as bytes and unpacked in registers (shift + mask; first code in the low bits), dequantized
with their statistics and fed to ``tl.dot``; no dequantized K/V or coefficient matrix is written
to memory. Mid logits are ``(scale * q @ B_k) . c_k + scale * q . mean_k`` and the Mid output is
accumulated in the coefficient domain (``p @ c_v``) and projected back (``@ B_v^T + mean_v``)
once per split on the host side of the kernel (a [G, Rv] x [Rv, dv] product per split). An
unprojected Mid is the same computation on an identity basis: the query is only scaled (no
projection, zero mean term) and the coefficients are the values, so nothing is projected back;
with per-token value statistics (``VALUE_PER_ROW``, a constexpr) each row's value codes are
dequantized with its own kv-head scale/offset instead of its page's per-column ones. Each split
writes its normalised output and log-sum-exp (an empty split writes 0 and -inf); all splits of
all segments are merged exactly by log-sum-exp.

Logit softcapping (Gemma-2, ``softcap``): each logit becomes ``cap * tanh(logit / cap)`` right
after its dot product, before the mask and the running max (``CAPPED`` is a constexpr, so the
uncapped kernels are unchanged). Triton 3.9 has no ``tl.math.tanh`` and the interpreter cannot
run libdevice's, so ``_tanh`` builds it from ``tl.exp``: ``sign(x) (1 - e) / (1 + e)``, e =
exp(-2|x|) in (0, 1], which never overflows; its absolute error is a few float32 ulps of 1, i.e.
a few ulps of ``cap`` on the logit.

Dots run in float32 with ``input_precision="ieee"`` (no TF32), so the kernels match the float64
reference to float32 rounding (see tests/kernels/test_triton_decode.py for the bound).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .decode_inputs import DecodeSegments, MidCodes, RecentCodes, check_softcap
from .compressed_attention import partial_dense, partial_lowrank

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Tests set this to fill every scratch buffer with NaN first, proving the kernels write all of it.
POISON_SCRATCH = False
# Tests set this to force a split count (possibly more splits than token blocks: empty splits).
FORCE_SPLITS: int | None = None


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, x)))


def _scratch(*shape, device) -> Tensor:
    if POISON_SCRATCH:
        return torch.full(shape, float("nan"), device=device)
    return torch.empty(shape, device=device)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _online_softmax_step(logits, n_ok, m_i, l_i, cap, CAPPED: tl.constexpr):
    """One block of the running softmax: (p, alpha, new row max, new row sum). Masked columns
    get p = 0; a row that has seen nothing yet keeps max -inf and sum 0."""
    if CAPPED:
        logits = cap * _tanh(logits / cap)
    logits = tl.where(n_ok[None, :], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(logits - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_split(acc, m_i, l_i, o_ptr, lse_ptr, h, S, s, ROWS, rg, g_ok, rcol, WIDTH):
    """A split's normalised output [BLOCK_M, WIDTH] of query rows rg and their log-sum-exp (-inf
    for rows that saw nothing), at rows (h * S + s) * ROWS + rg of the [Hkv, S, ROWS] outputs."""
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = (h * S + s) * ROWS + rg
    tl.store(o_ptr + row[:, None] * WIDTH + rcol[None, :], out, mask=g_ok[:, None] & (rcol[None, :] < WIDTH))
    tl.store(lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _dense_split_kernel(
    q_ptr, k_ptr, v_ptr,
    ks_ptr, ko_ptr, vs_ptr, vo_ptr,
    o_ptr, lse_ptr,
    N, per_split, page_size, cap,
    stride_kh, stride_kn, stride_vh, stride_vn,
    stride_ksh, stride_ksp, stride_vsh,
    ROWS, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, QUANT: tl.constexpr, BITS: tl.constexpr, CAPPED: tl.constexpr,
):
    h = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    rg = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rdk = tl.arange(0, DK_PAD)
    rdv = tl.arange(0, DV_PAD)
    rn = tl.arange(0, BLOCK_N)
    g_ok = rg < ROWS
    # q already scaled, [Hkv, ROWS, DK] float32
    q = tl.load(q_ptr + (h * ROWS + rg)[:, None] * DK + rdk[None, :], mask=g_ok[:, None] & (rdk[None, :] < DK), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    n0 = s * per_split
    n1 = tl.minimum(n0 + per_split, N)
    for start in range(n0, n1, BLOCK_N):
        n = start + rn
        n_ok = n < n1
        kmask = n_ok[:, None] & (rdk[None, :] < DK)
        vmask = n_ok[:, None] & (rdv[None, :] < DV)
        if QUANT:
            kbit = rdk[None, :] * BITS  # packed codes: byte bit//8, shift bit%8, first code low
            kbyte = tl.load(k_ptr + h * stride_kh + n[:, None] * stride_kn + (kbit >> 3), mask=kmask, other=0)
            kcode = (kbyte.to(tl.int32) >> (kbit & 7)) & ((1 << BITS) - 1)
            page = n // page_size
            kst = h * stride_ksh + page[:, None] * stride_ksp + rdk[None, :]
            k = tl.load(ko_ptr + kst, mask=kmask, other=0.0) + kcode.to(tl.float32) * tl.load(ks_ptr + kst, mask=kmask, other=0.0)
        else:
            k = tl.load(k_ptr + h * stride_kh + n[:, None] * stride_kn + rdk[None, :], mask=kmask, other=0.0).to(tl.float32)
        logits = tl.dot(q, tl.trans(k), input_precision="ieee")
        p, alpha, m_new, l_i = _online_softmax_step(logits, n_ok, m_i, l_i, cap, CAPPED)
        if QUANT:
            vbit = rdv[None, :] * BITS
            vbyte = tl.load(v_ptr + h * stride_vh + n[:, None] * stride_vn + (vbit >> 3), mask=vmask, other=0)
            vcode = (vbyte.to(tl.int32) >> (vbit & 7)) & ((1 << BITS) - 1)
            vsc = tl.load(vs_ptr + h * stride_vsh + n, mask=n_ok, other=0.0)
            vof = tl.load(vo_ptr + h * stride_vsh + n, mask=n_ok, other=0.0)
            v = vof[:, None] + vcode.to(tl.float32) * vsc[:, None]
            v = tl.where(vmask, v, 0.0)
        else:
            v = tl.load(v_ptr + h * stride_vh + n[:, None] * stride_vn + rdv[None, :], mask=vmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    _store_split(acc, m_i, l_i, o_ptr, lse_ptr, h, S, s, ROWS, rg, g_ok, rdv, DV)


@triton.jit
def _mid_split_kernel(
    qp_ptr, qb_ptr,
    kr_ptr, ks_ptr, ko_ptr, kstart_ptr, krank_ptr,
    vr_ptr, vs_ptr, vo_ptr, vstart_ptr, vrank_ptr,
    stat_ptr, o_ptr, lse_ptr,
    N, per_split, k_bytes, v_bytes, KC, VC, cap,
    ROWS, RK: tl.constexpr, RV: tl.constexpr,
    BLOCK_M: tl.constexpr, RK_PAD: tl.constexpr, RV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, CAPPED: tl.constexpr,
    VALUE_PER_ROW: tl.constexpr,
):
    # value statistics: [Pm, VC] per page (row st, column of the code), or VALUE_PER_ROW
    # [N, VC = Hkv] per token and kv-head
    h = tl.program_id(0)
    s = tl.program_id(1)
    S = tl.num_programs(1)
    rg = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk_ = tl.arange(0, RK_PAD)
    rv_ = tl.arange(0, RV_PAD)
    rn = tl.arange(0, BLOCK_N)
    g_ok = rg < ROWS
    k_rank = tl.load(krank_ptr + h)
    k_start = tl.load(kstart_ptr + h)
    v_rank = tl.load(vrank_ptr + h)
    v_start = tl.load(vstart_ptr + h)
    # projected, scaled query [Hkv, ROWS, RK] and its mean term [Hkv, ROWS]
    qp = tl.load(qp_ptr + (h * ROWS + rg)[:, None] * RK + rk_[None, :], mask=g_ok[:, None] & (rk_[None, :] < RK), other=0.0)
    qb = tl.load(qb_ptr + h * ROWS + rg, mask=g_ok, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, RV_PAD], tl.float32)
    n0 = s * per_split
    n1 = tl.minimum(n0 + per_split, N)
    for start in range(n0, n1, BLOCK_N):
        n = start + rn
        n_ok = n < n1
        st = tl.load(stat_ptr + n, mask=n_ok, other=0)
        kmask = n_ok[:, None] & (rk_[None, :] < k_rank)
        kcol = k_start + rk_[None, :]
        kbit = kcol * KBITS
        kbyte = tl.load(kr_ptr + n[:, None].to(tl.int64) * k_bytes + (kbit >> 3), mask=kmask, other=0)
        kcode = (kbyte.to(tl.int32) >> (kbit & 7)) & ((1 << KBITS) - 1)
        kst = st[:, None].to(tl.int64) * KC + kcol
        ck = tl.load(ko_ptr + kst, mask=kmask, other=0.0) + kcode.to(tl.float32) * tl.load(ks_ptr + kst, mask=kmask, other=0.0)
        logits = tl.dot(qp, tl.trans(ck), input_precision="ieee") + qb[:, None]
        p, alpha, m_new, l_i = _online_softmax_step(logits, n_ok, m_i, l_i, cap, CAPPED)
        vmask = n_ok[:, None] & (rv_[None, :] < v_rank)
        vcol = v_start + rv_[None, :]
        vbit = vcol * VBITS
        vbyte = tl.load(vr_ptr + n[:, None].to(tl.int64) * v_bytes + (vbit >> 3), mask=vmask, other=0)
        vcode = (vbyte.to(tl.int32) >> (vbit & 7)) & ((1 << VBITS) - 1)
        if VALUE_PER_ROW:
            vst = n.to(tl.int64) * VC + h
            vsc = tl.load(vs_ptr + vst, mask=n_ok, other=0.0)
            vof = tl.load(vo_ptr + vst, mask=n_ok, other=0.0)
            cv = tl.where(vmask, vof[:, None] + vcode.to(tl.float32) * vsc[:, None], 0.0)
        else:
            vst = st[:, None].to(tl.int64) * VC + vcol
            cv = tl.load(vo_ptr + vst, mask=vmask, other=0.0) + vcode.to(tl.float32) * tl.load(vs_ptr + vst, mask=vmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, cv, input_precision="ieee")
        m_i = m_new
    _store_split(acc, m_i, l_i, o_ptr, lse_ptr, h, S, s, ROWS, rg, g_ok, rv_, RV)


def _splits(n: int, programs: int, block: int, device: torch.device) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the device (``programs`` per split
    already: kv-heads x row blocks), whole blocks per split."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4
    blocks = triton.cdiv(n, block)
    if FORCE_SPLITS:
        return FORCE_SPLITS, max(1, triton.cdiv(blocks, FORCE_SPLITS)) * block
    splits = max(1, min(blocks, triton.cdiv(target, programs)))
    per = triton.cdiv(blocks, splits) * block
    return triton.cdiv(n, per), per


def _cap(softcap: float | None) -> float:
    """The kernels' runtime ``cap`` argument (unused when CAPPED is False)."""
    check_softcap(softcap)
    return 1.0 if softcap is None else float(softcap)


def _block(device: torch.device) -> int:
    return 64 if device.type == "cuda" and not INTERPRET else 16


def _row_block(rows: int, device: torch.device) -> int:
    """Query rows per program: a decode step's G heads in one tile; a prefill chunk's G * T rows
    in tiles of at most 64 (16 in the interpreter)."""
    return min(_pow2(rows), 64 if device.type == "cuda" and not INTERPRET else 16)


def _rows_out(x: Tensor, hq: int, t: int) -> Tensor:
    """A kernel output [Hkv, S, ROWS = G * T, ...] as [Hq, T, S, ...] (row (g, t) of kv-head h is
    query head h * G + g, token t)."""
    hkv, splits = x.shape[:2]
    return x.reshape(hkv, splits, hq // hkv, t, *x.shape[3:]).permute(0, 2, 3, 1, *range(4, x.dim() + 1)).reshape(
        hq, t, splits, *x.shape[3:])


def dense_partial(q: Tensor, k: Tensor, v: Tensor, scale: float, recent: RecentCodes | None = None,
                  softcap: float | None = None):
    """Split partials of q [Hq, T, d] over exact k/v [Hkv, N, d] (or Recent codes), every query
    row seeing every token: o [Hq, T, S, dv], lse [Hq, T, S]."""
    if recent is not None:
        k, v = recent.k_codes.contiguous(), recent.v_codes.contiguous()
        hkv, n = k.shape[:2]
        dk, dv = recent.dk, recent.dv
        ks, ko = recent.k_scale.contiguous(), recent.k_offset.contiguous()
        vs, vo = recent.v_scale.contiguous(), recent.v_offset.contiguous()
        page, bits = recent.page_size, recent.bits
    else:
        k, v = k.contiguous(), v.contiguous()
        hkv, n, dk = k.shape
        dv = v.shape[-1]
        ks = ko = vs = vo = k  # unused
        page, bits = 1, 8
    hq, t = q.shape[:2]
    rows = hq // hkv * t
    block, block_m = _block(q.device), _row_block(rows, q.device)
    row_blocks = triton.cdiv(rows, block_m)
    splits, per = _splits(n, hkv * row_blocks, block, q.device)
    o = _scratch(hkv, splits, rows, dv, device=q.device)
    lse = _scratch(hkv, splits, rows, device=q.device)
    qs = (q.float() * scale).contiguous()
    _dense_split_kernel[(hkv, splits, row_blocks)](
        qs, k, v, ks, ko, vs, vo, o, lse,
        n, per, page, _cap(softcap),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        ks.stride(0), ks.stride(1) if ks.dim() > 1 else 0, vs.stride(0),
        rows, DK=dk, DV=dv, BLOCK_M=block_m, DK_PAD=_pow2(dk), DV_PAD=_pow2(dv),
        BLOCK_N=block, QUANT=recent is not None, BITS=bits, CAPPED=softcap is not None,
    )
    return _rows_out(o, hq, t), _rows_out(lse, hq, t)


def mid_partial(q: Tensor, mid: MidCodes, scale: float, softcap: float | None = None):
    """Split partials of q [Hq, T, d] over a Mid segment, projected or not: o [Hq, T, S, dv],
    lse [Hq, T, S]."""
    hkv, rv = mid.kv_heads, mid.value_width
    hq, t = q.shape[:2]
    rows = hq // hkv * t
    n = mid.tokens
    qp, qb = mid.query_terms(q, scale)  # [Hkv, G * T, Rk], [Hkv, G * T]
    rk = qp.shape[2]
    block, block_m = _block(q.device), _row_block(rows, q.device)
    row_blocks = triton.cdiv(rows, block_m)
    splits, per = _splits(n, hkv * row_blocks, block, q.device)
    coef = _scratch(hkv, splits, rows, rv, device=q.device)
    lse = _scratch(hkv, splits, rows, device=q.device)
    tensors = [x.contiguous() for x in (mid.k_rows, mid.k_scale, mid.k_offset, mid.v_rows, mid.v_scale, mid.v_offset)]
    _mid_split_kernel[(hkv, splits, row_blocks)](
        qp, qb, tensors[0], tensors[1], tensors[2], mid.k_starts, mid.k_ranks,
        tensors[3], tensors[4], tensors[5], mid.v_starts, mid.v_ranks,
        mid.row_stat, coef, lse,
        n, per, tensors[0].shape[1], tensors[3].shape[1], tensors[1].shape[1], tensors[4].shape[1], _cap(softcap),
        rows, RK=rk, RV=rv, BLOCK_M=block_m, RK_PAD=_pow2(rk), RV_PAD=_pow2(rv),
        BLOCK_N=block, KBITS=mid.k_bits, VBITS=mid.v_bits, CAPPED=softcap is not None,
        VALUE_PER_ROW=mid.value_stats_per_row,
    )
    out = mid.values_out(coef)  # each split is normalised (weights sum to one): the mean goes back per split
    return _rows_out(out, hq, t), _rows_out(lse, hq, t)


def merge_splits(parts) -> tuple[Tensor, Tensor]:
    """Exact log-sum-exp merge of split partials [(o [Hq, T, S_i, dv], lse [Hq, T, S_i]), ...]
    -> (o [Hq, T, dv], lse [Hq, T]; -inf where no split saw a row)."""
    o = torch.cat([p[0] for p in parts], 2)
    lse = torch.cat([p[1] for p in parts], 2)
    m = lse.amax(2, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m)
    total = w.sum(2, keepdim=True)
    seen = total > 0
    merged = (w[..., None] * o).sum(2) / torch.where(seen, total, torch.ones_like(total))
    merged_lse = torch.where(seen, m + torch.log(torch.where(seen, total, torch.ones_like(total))), -float("inf"))
    return merged, merged_lse[..., 0]


def _split_partials(q: Tensor, segs: DecodeSegments, scale: float, softcap: float | None) -> list:
    """Split partials of q [Hq, T, d] over every segment (the Triton kernels; baseline float Mid
    encodings through the torch reference, as one split)."""
    parts = []
    exact = segs.exact_kv()
    if exact is not None and exact[0].shape[1]:
        parts.append(dense_partial(q, *exact, scale, softcap=softcap))
    if segs.recent is not None and segs.recent.tokens:
        parts.append(dense_partial(q, None, None, scale, recent=segs.recent, softcap=softcap))
    if segs.mid is not None and segs.mid.tokens:
        parts.append(mid_partial(q, segs.mid, scale, softcap))
    elif segs.mid_other is not None:  # baseline Mid encodings: torch reference
        attend = partial_lowrank if segs.mid_other_projected else partial_dense
        parts.append(_one_split(attend(q, *segs.mid_other, scale, softcap=softcap)))
    for epoch in segs.retired:  # earlier Mid epochs (bases refitted as the sequence grew)
        parts.append(mid_partial(q, epoch, scale, softcap) if isinstance(epoch, MidCodes)
                     else _one_split(partial_lowrank(q, *epoch, scale, softcap=softcap)))
    return parts


def _one_split(part: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """A torch partial (out [Hq, T, dv], lse [Hq, T]) as one split ([Hq, T, 1, dv], [Hq, T, 1])."""
    return part[0][:, :, None], part[1][:, :, None]


def triton_decode_attention(q: Tensor, segs: DecodeSegments, scale: float, out: Tensor | None = None,
                            softcap: float | None = None) -> Tensor:
    """Decode attention of q [Hq, d] over every segment with the Triton kernels -> [Hq, dv] float32.
    ``softcap``: logits are ``softcap * tanh(logits / softcap)`` (None: uncapped)."""
    parts = _split_partials(q[:, None], segs, scale, softcap)
    if not parts:
        raise ValueError("decode attention over an empty history")
    merged = merge_splits(parts)[0][:, 0]
    if out is None:
        return merged
    out.copy_(merged)
    return out


def history_partials(q: Tensor, segs: DecodeSegments, scale: float,
                     softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """A prefill chunk's queries q [Hq, T, d] over every stored segment (kernels.history_attention)
    -> (out [Hq, T, dv] float32, lse [Hq, T])."""
    parts = _split_partials(q, segs, scale, softcap)
    if not parts:
        raise ValueError("history attention over an empty history")
    return merge_splits(parts)
