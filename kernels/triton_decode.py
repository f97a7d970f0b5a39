"""Triton split-K attention over kvtopo's mixed segments: a decode step (one query token per
sequence), or a prefill chunk's queries over the stored history.

Entries: ``triton_decode_batch(q [B, Hq, d], segs: [DecodeSegments] * B, scale, softcap=None)
-> [B, Hq, dv]`` (``kernels.fast_decode`` dispatches CUDA tensors here; ``triton_decode_attention``
is a batch of one) and ``history_partials(q [Hq, T, d], segs, scale, softcap=None) -> (out
[Hq, T, dv], lse [Hq, T])`` (``kernels.history_attention``: every row sees every stored token).
The segments are what the runtime stores (see ``decode_inputs.DecodeSegments``):

* exact K/V [Hkv, N0, d] (any float dtype)            -> ``_dense_split_kernel`` (QUANT=False)
* Recent codes (packed b-bit, keys per page/channel,
  values per token statistics)                         -> ``_dense_split_kernel`` (QUANT=True)
* Mid rows [N, ceil(C*b/8)] uint8, per-page stats,
  head bases                                           -> ``_mid_split_kernel``
* unprojected Mid codes (identity basis, per-token
  value statistics)                                    -> ``_mid_split_kernel`` (VALUE_PER_ROW)

A batch is one launch per kind of segment for all its sequences: each kernel runs one program
per (kv-head, split of tokens, entry x block of query rows). An entry is one sequence's segment:
exact tokens and Recent codes of all sequences are laid side by side along the tokens (entry
e's are starts[e] .. starts[e + 1]); Mid segments stay where the store keeps them and the
kernel finds each (a sequence's current Mid and its earlier epochs are entries of their own)
through a table of its tensors' addresses and sizes. The query rows of an entry are its
sequence's G query heads times its T tokens (T = 1 when decoding: the group is one tile, so
keys/values are read once for it), in tiles of BLOCK_M rows. Codes are
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
all segments of all sequences are merged exactly by log-sum-exp in one set of scatter ops. The
host builds its small tables in pinned memory and copies them asynchronously: no host
synchronisation. Varying shapes and addresses per step make a launch not capturable in a CUDA
graph as it is.

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

import itertools
import os
from collections.abc import Sequence

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
def _store_split(acc, m_i, l_i, o_ptr, lse_ptr, row, g_ok, rcol, WIDTH):
    """A split's normalised output [BLOCK_M, WIDTH] and log-sum-exp (-inf for rows that saw
    nothing) at output rows ``row``."""
    seen = l_i > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    row = row.to(tl.int64)
    tl.store(o_ptr + row[:, None] * WIDTH + rcol[None, :], out, mask=g_ok[:, None] & (rcol[None, :] < WIDTH))
    tl.store(lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _program(ROWS, BLOCK_M: tl.constexpr):
    """(kv-head h, split s, splits S, entry e, its query rows rg, rows in range) of this program:
    the grid is (Hkv, S, entries x row blocks of BLOCK_M rows)."""
    row_blocks = tl.cdiv(ROWS, BLOCK_M)
    e = tl.program_id(2) // row_blocks
    rg = (tl.program_id(2) % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.program_id(0), tl.program_id(1), tl.num_programs(1), e, rg, rg < ROWS


@triton.jit
def _dense_split_kernel(
    q_ptr, k_ptr, v_ptr,
    ks_ptr, ko_ptr, vs_ptr, vo_ptr,
    o_ptr, lse_ptr, starts_ptr,
    per_split, page_size, cap,
    stride_kh, stride_kn, stride_vh, stride_vn,
    stride_ksh, stride_ksp, stride_vsh,
    ROWS, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, DK_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, QUANT: tl.constexpr, BITS: tl.constexpr, CAPPED: tl.constexpr,
):
    # entry e's tokens are starts[e] .. starts[e + 1] of k/v (several sequences side by side)
    h, s, S, e, rg, g_ok = _program(ROWS, BLOCK_M)
    H = tl.num_programs(0)
    rdk = tl.arange(0, DK_PAD)
    rdv = tl.arange(0, DV_PAD)
    rn = tl.arange(0, BLOCK_N)
    # q already scaled, [E, Hkv, ROWS, DK] float32
    q_row = ((e * H + h) * ROWS + rg).to(tl.int64)  # a long chunk's rows x width pass 2**31
    q = tl.load(q_ptr + q_row[:, None] * DK + rdk[None, :], mask=g_ok[:, None] & (rdk[None, :] < DK), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    n0 = tl.load(starts_ptr + e) + s * per_split
    n1 = tl.minimum(n0 + per_split, tl.load(starts_ptr + e + 1))
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
    _store_split(acc, m_i, l_i, o_ptr, lse_ptr, ((e * H + h) * S + s) * ROWS + rg, g_ok, rdv, DV)


@triton.jit
def _mid_split_kernel(
    qp_ptr, qb_ptr, addr_ptr, dims_ptr, kstart_ptr, krank_ptr, vstart_ptr, vrank_ptr,
    o_ptr, lse_ptr, per_split, cap,
    ROWS, RK: tl.constexpr, RV: tl.constexpr,
    BLOCK_M: tl.constexpr, RK_PAD: tl.constexpr, RV_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, CAPPED: tl.constexpr,
    VALUE_PER_ROW: tl.constexpr, HALF_STATS: tl.constexpr,
):
    # Entry e is one Mid segment, wherever it is: addr [E, 7] int64 holds the addresses of its
    # key rows, key scale, key offset, value rows, value scale, value offset and row_stat;
    # dims [E, 5] its N, key and value row bytes, key and value statistics widths (KC, VC);
    # kstart/krank/vstart/vrank [E, Hkv] its head columns. Value statistics: [Pm, VC] per page
    # (row st, column of the code), or VALUE_PER_ROW [N, VC = Hkv] per token and kv-head.
    # Statistics are float32, or HALF_STATS float16 as the store keeps them (widened as loaded).
    h, s, S, e, rg, g_ok = _program(ROWS, BLOCK_M)
    H = tl.num_programs(0)
    rk_ = tl.arange(0, RK_PAD)
    rv_ = tl.arange(0, RV_PAD)
    rn = tl.arange(0, BLOCK_N)
    kr_ptr = tl.load(addr_ptr + e * 7).to(tl.pointer_type(tl.uint8))
    if HALF_STATS:
        ks_ptr = tl.load(addr_ptr + e * 7 + 1).to(tl.pointer_type(tl.float16))
        ko_ptr = tl.load(addr_ptr + e * 7 + 2).to(tl.pointer_type(tl.float16))
        vs_ptr = tl.load(addr_ptr + e * 7 + 4).to(tl.pointer_type(tl.float16))
        vo_ptr = tl.load(addr_ptr + e * 7 + 5).to(tl.pointer_type(tl.float16))
    else:
        ks_ptr = tl.load(addr_ptr + e * 7 + 1).to(tl.pointer_type(tl.float32))
        ko_ptr = tl.load(addr_ptr + e * 7 + 2).to(tl.pointer_type(tl.float32))
        vs_ptr = tl.load(addr_ptr + e * 7 + 4).to(tl.pointer_type(tl.float32))
        vo_ptr = tl.load(addr_ptr + e * 7 + 5).to(tl.pointer_type(tl.float32))
    vr_ptr = tl.load(addr_ptr + e * 7 + 3).to(tl.pointer_type(tl.uint8))
    stat_ptr = tl.load(addr_ptr + e * 7 + 6).to(tl.pointer_type(tl.int32))
    N = tl.load(dims_ptr + e * 5)
    k_bytes = tl.load(dims_ptr + e * 5 + 1)
    v_bytes = tl.load(dims_ptr + e * 5 + 2)
    KC = tl.load(dims_ptr + e * 5 + 3)
    VC = tl.load(dims_ptr + e * 5 + 4)
    k_rank = tl.load(krank_ptr + e * H + h)
    k_start = tl.load(kstart_ptr + e * H + h)
    v_rank = tl.load(vrank_ptr + e * H + h)
    v_start = tl.load(vstart_ptr + e * H + h)
    # projected, scaled query [E, Hkv, ROWS, RK] and its mean term [E, Hkv, ROWS]
    q_row = ((e * H + h) * ROWS + rg).to(tl.int64)  # a long chunk's rows x width pass 2**31
    qp = tl.load(qp_ptr + q_row[:, None] * RK + rk_[None, :], mask=g_ok[:, None] & (rk_[None, :] < RK), other=0.0)
    qb = tl.load(qb_ptr + q_row, mask=g_ok, other=0.0)
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
        kof = tl.load(ko_ptr + kst, mask=kmask, other=0.0).to(tl.float32)
        ck = kof + kcode.to(tl.float32) * tl.load(ks_ptr + kst, mask=kmask, other=0.0).to(tl.float32)
        logits = tl.dot(qp, tl.trans(ck), input_precision="ieee") + qb[:, None]
        p, alpha, m_new, l_i = _online_softmax_step(logits, n_ok, m_i, l_i, cap, CAPPED)
        vmask = n_ok[:, None] & (rv_[None, :] < v_rank)
        vcol = v_start + rv_[None, :]
        vbit = vcol * VBITS
        vbyte = tl.load(vr_ptr + n[:, None].to(tl.int64) * v_bytes + (vbit >> 3), mask=vmask, other=0)
        vcode = (vbyte.to(tl.int32) >> (vbit & 7)) & ((1 << VBITS) - 1)
        if VALUE_PER_ROW:
            vst = n.to(tl.int64) * VC + h
            vsc = tl.load(vs_ptr + vst, mask=n_ok, other=0.0).to(tl.float32)
            vof = tl.load(vo_ptr + vst, mask=n_ok, other=0.0).to(tl.float32)
            cv = tl.where(vmask, vof[:, None] + vcode.to(tl.float32) * vsc[:, None], 0.0)
        else:
            vst = st[:, None].to(tl.int64) * VC + vcol
            vof = tl.load(vo_ptr + vst, mask=vmask, other=0.0).to(tl.float32)
            cv = vof + vcode.to(tl.float32) * tl.load(vs_ptr + vst, mask=vmask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, cv, input_precision="ieee")
        m_i = m_new
    _store_split(acc, m_i, l_i, o_ptr, lse_ptr, ((e * H + h) * S + s) * ROWS + rg, g_ok, rv_, RV)


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


def _table(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host-built table on the device without a host synchronisation (pinned, async copy)."""
    table = torch.tensor(rows, dtype=dtype)
    if device.type != "cuda":
        return table
    if torch.cuda.is_current_stream_capturing():  # a replay would copy from a freed host buffer
        raise RuntimeError("kvtopo's batched Triton decode builds its tables per call: it cannot be captured "
                           "in a CUDA graph")
    return table.pin_memory().to(device, non_blocking=True)


def _launch(kernel, device: torch.device, heads: int, entries: int, rows: int, tokens: int):
    """(kernel[grid], splits, tokens per split, BLOCK_M, BLOCK_N) for `entries` segments of up to
    `tokens` tokens with `rows` query rows each."""
    block, block_m = _block(device), _row_block(rows, device)
    programs = entries * triton.cdiv(rows, block_m)
    splits, per = _splits(max(tokens, 1), heads * programs, block, device)
    return kernel[(heads, splits, programs)], splits, per, block_m, block


def _as_rows(o: Tensor, lse: Tensor, seq: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel outputs o [E, Hkv, S, ROWS, dv], lse [E, Hkv, S, ROWS] of the entries' sequences
    `seq` [E] as merge rows: o [E * S, Hkv * ROWS, dv], lse [E * S, Hkv * ROWS], sequence [E * S]
    (Hkv * ROWS is query head x token: row g * T + t of kv-head h is head h * G + g, token t)."""
    e, hkv, splits, rows = lse.shape
    return (o.permute(0, 2, 1, 3, 4).reshape(e * splits, hkv * rows, -1),
            lse.permute(0, 2, 1, 3).reshape(e * splits, hkv * rows), seq.repeat_interleave(splits))


def _dense_rows(qs: Tensor, entries: list[int], kv: tuple[Tensor, Tensor] | None, recent: RecentCodes | None,
                tokens: list[int], softcap: float | None):
    """One launch over exact K/V (or Recent codes) of several sequences side by side along the
    tokens (`tokens[i]` of sequence entries[i]); qs [B, Hkv, ROWS, d] the scaled queries."""
    device = qs.device
    if recent is not None:
        k, v = recent.k_codes.contiguous(), recent.v_codes.contiguous()
        dk, dv = recent.dk, recent.dv
        ks, ko = recent.k_scale.float().contiguous(), recent.k_offset.float().contiguous()
        vs, vo = recent.v_scale.float().contiguous(), recent.v_offset.float().contiguous()
        page, bits = recent.page_size, recent.bits
    else:
        k, v = (x.contiguous() for x in kv)
        dk, dv = k.shape[-1], v.shape[-1]
        ks = ko = vs = vo = k  # unused
        page, bits = 1, 8
    rows = qs.shape[2]
    index = torch.tensor(entries, device=device)
    q = qs if len(entries) == qs.shape[0] else qs[index].contiguous()
    starts = _table([0, *itertools.accumulate(tokens)], torch.int32, device)
    run, splits, per, block_m, block = _launch(_dense_split_kernel, device, k.shape[0], len(entries), rows, max(tokens))
    o = _scratch(len(entries), k.shape[0], splits, rows, dv, device=device)
    lse = _scratch(len(entries), k.shape[0], splits, rows, device=device)
    run(q, k, v, ks, ko, vs, vo, o, lse, starts,
        per, page, _cap(softcap),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        ks.stride(0), ks.stride(1) if ks.dim() > 1 else 0, vs.stride(0),
        rows, DK=dk, DV=dv, BLOCK_M=block_m, DK_PAD=_pow2(dk), DV_PAD=_pow2(dv),
        BLOCK_N=block, QUANT=recent is not None, BITS=bits, CAPPED=softcap is not None)
    return _as_rows(o, lse, index)


def _mid_rows(q: Tensor, qs: Tensor, entries: list[int], mids: list[MidCodes], scale: float,
              softcap: float | None):
    """One launch over Mid segments wherever they are stored (mids[i] of sequence entries[i];
    several may belong to one sequence: its earlier epochs), found through a table of their
    addresses. Unprojected (the default coding) reads the scaled queries qs [B, Hkv, ROWS, d]
    as they are; projected segments have their own bases, so their query terms and the
    projection back are one small product per segment."""
    first = mids[0]
    for m in mids:
        if (m.k_rows.dtype, m.v_rows.dtype, m.row_stat.dtype) != (torch.uint8, torch.uint8, torch.int32):
            raise ValueError("Mid codes must be uint8 rows and int32 row_stat "
                             "(the kernel reads them through their addresses)")
    if any((m.k_bits, m.v_bits, m.projected, m.value_stats_per_row) !=
           (first.k_bits, first.v_bits, first.projected, first.value_stats_per_row) for m in mids):
        raise ValueError("the Mid segments of one launch must share bits, projection and value statistics")
    device, (_, heads, rows, _) = qs.device, qs.shape
    index = torch.tensor(entries, device=device)
    if first.projected:
        terms = [m.query_terms(q[b], scale) for b, m in zip(entries, mids)]  # [Hkv, ROWS, Rk_i], [Hkv, ROWS]
        rk = max(t[0].shape[-1] for t in terms)
        qp = torch.stack([torch.nn.functional.pad(t[0], (0, rk - t[0].shape[-1])) for t in terms])
        qb = torch.stack([t[1] for t in terms])
    else:
        qp, qb = qs[index].contiguous(), qs.new_zeros(len(entries), heads, rows)
    width = max(m.value_width for m in mids)
    # Statistics as stored when every segment keeps them in float16 (the store's rule), else all
    # widened to float32: one launch reads one dtype.
    half = all(x.dtype == torch.float16 for m in mids for x in (m.k_scale, m.k_offset, m.v_scale, m.v_offset))
    stat = (lambda x: x) if half else (lambda x: x.float())  # noqa: E731
    held = [[x.contiguous() for x in (m.k_rows, stat(m.k_scale), stat(m.k_offset), m.v_rows, stat(m.v_scale),
                                      stat(m.v_offset), m.row_stat)]
            for m in mids]  # alive until the launch is queued (stream order keeps them for the kernel)
    addr = _table([[x.data_ptr() for x in h] for h in held], torch.int64, device)
    dims = _table([[m.tokens, h[0].shape[1], h[3].shape[1], h[1].shape[1], h[4].shape[1]] for m, h in zip(mids, held)],
                  torch.int32, device)
    columns = [torch.stack([getattr(m, f) for m in mids]) for f in ("k_starts", "k_ranks", "v_starts", "v_ranks")]
    run, splits, per, block_m, block = _launch(_mid_split_kernel, device, heads, len(mids), rows,
                                               max(m.tokens for m in mids))
    coef = _scratch(len(mids), heads, splits, rows, width, device=device)
    lse = _scratch(len(mids), heads, splits, rows, device=device)
    run(qp.contiguous(), qb.contiguous(), addr, dims, *columns, coef, lse, per, _cap(softcap),
        rows, RK=qp.shape[-1], RV=width, BLOCK_M=block_m, RK_PAD=_pow2(qp.shape[-1]), RV_PAD=_pow2(width),
        BLOCK_N=block, KBITS=first.k_bits, VBITS=first.v_bits, CAPPED=softcap is not None,
        VALUE_PER_ROW=first.value_stats_per_row, HALF_STATS=half)
    if first.projected:  # each split is normalised (weights sum to one): the mean goes back per split
        out = torch.stack([m.values_out(c[..., : m.value_width]) for m, c in zip(mids, coef)])
    else:
        out = coef
    return _as_rows(out, lse, index)


def _merge_rows(pieces, batch: int) -> tuple[Tensor, Tensor]:
    """Exact log-sum-exp merge of partial rows [(o [P, R, dv], lse [P, R], sequence [P]), ...]
    into each sequence's (out [B, R, dv], lse [B, R]; -inf where nothing was seen)."""
    o = torch.cat([p[0] for p in pieces])
    lse = torch.cat([p[1] for p in pieces])
    seq = torch.cat([p[2] for p in pieces])
    m = lse.new_full((batch, lse.shape[1]), -float("inf"))
    m = m.scatter_reduce(0, seq[:, None].expand_as(lse), lse, "amax")
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m[seq])
    total = lse.new_zeros(batch, lse.shape[1]).index_add_(0, seq, w)
    merged = o.new_zeros(batch, *o.shape[1:]).index_add_(0, seq, w[..., None] * o)
    seen = total > 0
    merged = merged / torch.where(seen, total, torch.ones_like(total))[..., None]
    return merged, torch.where(seen, m + torch.log(torch.where(seen, total, torch.ones_like(total))), -float("inf"))


def _attend(q: Tensor, segs: Sequence[DecodeSegments], scale: float,
            softcap: float | None) -> tuple[Tensor, Tensor]:
    """q [B, Hq, T, d] of sequence b over segs[b] (every row sees every stored token) -> (out
    [B, Hq, T, dv], lse [B, Hq, T]): one launch per kind of segment for the whole batch — exact
    tokens and Recent codes of all sequences side by side, every Mid segment (and earlier
    epoch) of every sequence through its addresses — and one merge. Mid stored as floats
    (baseline policies) goes through the torch reference, per sequence."""
    batch, hq, t, d = q.shape
    heads = segs[0].kv_heads
    qs = (scale * q.float()).reshape(batch, heads, hq // heads * t, d).contiguous()
    pieces = []
    exact = [(b, kv) for b, s in enumerate(segs) if (kv := s.exact_kv()) is not None and kv[0].shape[1]]
    if exact:
        kv = exact[0][1] if len(exact) == 1 else tuple(torch.cat([x[i] for _, x in exact], 1) for i in (0, 1))
        pieces.append(_dense_rows(qs, [b for b, _ in exact], kv, None, [x[0].shape[1] for _, x in exact], softcap))
    recent = [(b, s.recent) for b, s in enumerate(segs) if s.recent is not None and s.recent.tokens]
    if recent:
        codes = recent[0][1] if len(recent) == 1 else RecentCodes.concat([r for _, r in recent])
        pieces.append(_dense_rows(qs, [b for b, _ in recent], None, codes, [r.tokens for _, r in recent], softcap))
    coded, floats = [], []
    for b, s in enumerate(segs):
        if s.mid is None and s.mid_other is not None:
            floats.append((b, partial_lowrank if s.mid_other_projected else partial_dense, s.mid_other))
        for epoch in ((s.mid,) if s.mid is not None and s.mid.tokens else ()) + tuple(s.retired):
            if isinstance(epoch, MidCodes):
                coded.append((b, epoch))
            else:
                floats.append((b, partial_lowrank, epoch))
    if coded:
        pieces.append(_mid_rows(q, qs, [b for b, _ in coded], [m for _, m in coded], scale, softcap))
    for b, attend, stored in floats:
        o, lse = attend(q[b], *stored, scale, softcap=softcap)
        pieces.append((o.reshape(1, hq * t, -1), lse.reshape(1, hq * t), torch.tensor([b], device=q.device)))
    if not pieces:
        raise ValueError("attention over an empty history")
    out, lse = _merge_rows(pieces, batch)
    return out.reshape(batch, hq, t, -1), lse.reshape(batch, hq, t)


def triton_decode_batch(q: Tensor, segs: Sequence[DecodeSegments], scale: float,
                        softcap: float | None = None) -> Tensor:
    """Decode attention of a batch, q [B, Hq, d] (one token per sequence) over each sequence's
    segments -> [B, Hq, dv] float32, one launch per kind of segment for all sequences.
    ``softcap``: logits are ``softcap * tanh(logits / softcap)`` (None: uncapped)."""
    return _attend(q[:, :, None], segs, scale, softcap)[0][:, :, 0]


def triton_decode_attention(q: Tensor, segs: DecodeSegments, scale: float, out: Tensor | None = None,
                            softcap: float | None = None) -> Tensor:
    """Decode attention of q [Hq, d] over every segment (a batch of one) -> [Hq, dv] float32."""
    merged = triton_decode_batch(q[None], [segs], scale, softcap)[0]
    if out is None:
        return merged
    out.copy_(merged)
    return out


def history_partials(q: Tensor, segs: DecodeSegments, scale: float,
                     softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """A prefill chunk's queries q [Hq, T, d] over every stored segment (kernels.history_attention)
    -> (out [Hq, T, dv] float32, lse [Hq, T])."""
    out, lse = _attend(q[None], [segs], scale, softcap)
    return out[0], lse[0]
