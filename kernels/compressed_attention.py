"""Reference attention over a sequence whose KV cache is split into differently stored segments.

One sequence's cache is a set of segments: exact pages (Initial, Terminal), int8 pages
(Recent, dequantized by the runtime), low-rank Mid pages, and the chunk being processed with
its causal mask. Each ``partial_*`` function attends the queries to one segment and returns
``(out, lse)``: ``out`` [Hq, T, dv] normalised within the segment, ``lse`` [Hq, T] the
log-sum-exp of the segment's scaled logits. ``merge_partials`` combines segments exactly, so
attention over the whole cache equals one softmax over the concatenated keys. A segment with
no visible key for a query row (no tokens, or fully masked) contributes ``lse = -inf`` and a
zero output, and weighs nothing in the merge.

Mid pages are never decompressed. With keys ``k = mean_k + c_k @ B_k.T`` the logits are
``(q @ B_k) @ c_k.T + q @ mean_k``: the query is projected onto the r kept directions once,
then dotted with the N coefficient rows (N*r instead of N*d multiply-adds). With values
``v = mean_v + c_v @ B_v.T`` and probabilities p summing to one, the output is
``(p @ c_v) @ B_v.T + mean_v``: one projection back per query instead of per token.

GQA: Hq = Hkv * G and query head h reads kv-head h // G (the ``repeat_kv`` convention). The
G query heads of a kv-head are folded into the row dimension, so every product is a batched
matmul over kv-heads. All math is float32, except CPU flash partials of bfloat16 / float16
queries, which run in the queries' dtype (``flash_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .directions import Basis


@dataclass(frozen=True, eq=False)
class LowRankHeads:
    """Keys or values of a Mid segment for all kv-heads, padded to the largest rank R.

    ``coefficients`` [Hkv, N, R], ``vectors`` [Hkv, d, R], ``mean`` [Hkv, d], float32.
    Ranks differ per kv-head, but a per-head Python loop would cost Hkv small kernels per
    step, so the heads are padded to one batched layout. Invariant: columns of ``vectors[h]``
    beyond head h's rank are zero. Then the padded coefficient columns are multiplied by zero
    in both the logits and the output, so they may hold any finite values: the runtime can
    dequantize each head's true-rank coefficients (the only bytes it stores) into a reused
    [Hkv, N, R] buffer without clearing it. Build with ``stack_heads``. Every kv-head holds
    the same N tokens' worth of coefficients (eviction keeps the same budget per kv-head).
    """

    coefficients: Tensor
    vectors: Tensor
    mean: Tensor


def stack_heads(coefficients: Sequence[Tensor], bases: Sequence[Basis]) -> LowRankHeads:
    """Pad per-kv-head coefficients [N, r_h] and bases (vectors [d, r_h]) to ``LowRankHeads``."""
    if len(coefficients) != len(bases) or not bases:
        raise ValueError(f"need one basis per head and at least one head, got {len(coefficients)} and {len(bases)}")
    rank = max(b.rank for b in bases)
    n = coefficients[0].shape[0]
    d = bases[0].vectors.shape[0]
    heads = len(bases)
    padded_c = torch.zeros(heads, n, rank, device=bases[0].vectors.device)
    padded_v = torch.zeros(heads, d, rank, device=bases[0].vectors.device)
    for h, (c, b) in enumerate(zip(coefficients, bases)):
        if c.shape != (n, b.rank):
            raise ValueError(f"head {h}: coefficients {tuple(c.shape)} do not match [N={n}, rank={b.rank}]")
        padded_c[h, :, : b.rank] = c
        padded_v[h, :, : b.rank] = b.vectors
    mean = torch.stack([b.mean for b in bases]).float()
    return LowRankHeads(coefficients=padded_c, vectors=padded_v, mean=mean)


def group_query_heads(q: Tensor, kv_heads: int) -> Tensor:
    """[Hq, T, d] -> [Hkv, G*T, d] float32, rows of query head h under kv-head h // G."""
    hq, t, d = q.shape
    if hq % kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {kv_heads} kv-heads")
    return q.float().reshape(kv_heads, hq // kv_heads * t, d)


def _empty(q: Tensor, dv: int) -> tuple[Tensor, Tensor]:
    hq, t, _ = q.shape
    out = torch.zeros(hq, t, dv, device=q.device)
    return out, torch.full((hq, t), -float("inf"), device=q.device)


def _softmax_lse(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim and its log-sum-exp; rows that are all -inf give p=0, -inf.
    The probabilities overwrite `logits` (a temporary of every caller): the same ops in place,
    without allocating a tensor of that size per step (2x faster on a prefill chunk's blocks)."""
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = logits.sub_(m).exp_()
    total = p.sum(-1, keepdim=True)
    lse = (m + total.log()).squeeze(-1)
    return p.div_(torch.where(total > 0, total, torch.ones_like(total))), lse


def _capped(logits: Tensor, softcap: float | None) -> Tensor:
    """Logit softcapping (Gemma-2): ``softcap * tanh(logits / softcap)``, applied before any mask."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


# Logits partial_dense holds at once on CPU (float32 elements, 2 MiB) where aten's flash
# attention does not take the partial (a mask, a softcap, unequal head sizes). A prefill chunk
# attending to itself has [Hkv, G*T, T] of them; in blocks of query rows each softmax pass reads
# them from cache rather than memory (4096-token chunk, 4 query heads: 0.3 s instead of 1.4-2.9 s
# on one thread). Rows are independent and each block runs the same ops on the same rows: the results
# are the same bits (tests/runtime/test_prefill_blocks.py). A GPU takes all rows at once.
BLOCK_LOGITS = 1 << 19


def partial_dense(
    q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor | None = None, softcap: float | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of q [Hq, T, d] to exact keys k [Hkv, N, d] and values v [Hkv, N, dv].

    ``mask`` [T, N], True where query row t may see key n (the new chunk's causal mask), or any
    shape that broadcasts to [Hkv, G, T, N] (a per-kv-head mask: padding of a batch folded into
    the kv-heads); None means all visible.
    """
    kv_heads, n, _ = k.shape
    hq, t, _ = q.shape
    if n == 0:
        return _empty(q, v.shape[-1])
    if mask is None and _flash_takes(q, k, v, softcap):
        parts = dense_partials(q, k, v, scale)
        return parts[0] if len(parts) == 1 else merge_partials_lse(parts)
    qg = group_query_heads(q, kv_heads).view(kv_heads, hq // kv_heads, t, -1)
    keys, values = k.float().transpose(1, 2), v.float()
    rows = max(1, BLOCK_LOGITS // (hq * n)) if q.device.type == "cpu" else t
    if rows >= t:
        return _dense_block(qg, keys, values, scale, mask, softcap)
    per_row_mask = mask is not None and mask.dim() >= 2 and mask.shape[-2] == t
    blocks = [_dense_block(qg[:, :, r: r + rows], keys, values, scale,
                           mask[..., r: r + rows, :] if per_row_mask else mask, softcap) for r in range(0, t, rows)]
    return torch.cat([out for out, _ in blocks], 1), torch.cat([lse for _, lse in blocks], 1)


def partial_causal(q: Tensor, k: Tensor, v: Tensor, scale: float,
                   softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """A prefill chunk attending to itself: q [Hq, T, d] to its own keys k [Hkv, T, d] and values
    v [Hkv, T, dv], token t seeing tokens 0..t (``partial_dense`` with the causal mask)."""
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"a chunk's causal attention needs as many keys as queries, got {k.shape[1]} and {q.shape[1]}")
    if k.shape[1] and _flash_takes(q, k, v, softcap):
        aligned = k.shape[1] % FLASH_KEY_GRANULE == 0
        return _cpu_flash(q, k, v, scale, True, flash_dtype(q) if aligned else torch.float32)
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
    return partial_dense(q, k, v, scale, mask, softcap)


def _flash_takes(q: Tensor, k: Tensor, v: Tensor, softcap: float | None) -> bool:
    """Whether aten's fused CPU flash attention computes this partial: on CPU, uncapped, one
    head size for queries, keys and values (its requirement)."""
    return q.device.type == "cpu" and softcap is None and q.shape[-1] == k.shape[-1] == v.shape[-1]


# aten's CPU flash attention in bfloat16 / float16 builds a matrix-unit kernel for every length
# of the last key block it meets and keeps it for the life of the process: a long prefill, whose
# segments end at every length, grew the process by more than HF's whole cache (seen in
# bench/generate_speed.py's peak RSS). The reduced-precision calls therefore
# get key counts that are multiples of this granule only (a bounded set of last blocks); the few
# keys past the last multiple are attended in float32 and merged.
FLASH_KEY_GRANULE = 32


def flash_dtype(q: Tensor) -> torch.dtype:
    """The dtype CPU flash partials of queries `q` compute in: bfloat16 / float16 queries keep
    it (the model's own attention runs in it; the kernel accumulates in float32, and on CPUs
    with bf16 matrix units it runs several times faster than in float32); others (float32,
    float64) run in float32."""
    return q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32


def dense_partials(q: Tensor, k: Tensor, v: Tensor, scale: float,
                   softcap: float | None = None) -> list[tuple[Tensor, Tensor]]:
    """``partial_dense`` without a mask as one or two partials, for a caller that merges many
    (a history of tiles) in one merge. Through aten's CPU flash attention where it takes them:
    in ``flash_dtype(q)`` over the first multiple of ``FLASH_KEY_GRANULE`` keys, in float32
    over the rest."""
    if k.shape[1] == 0 or not _flash_takes(q, k, v, softcap):
        return [partial_dense(q, k, v, scale, softcap=softcap)]
    dtype = flash_dtype(q)
    n = k.shape[1]
    aligned = n - n % FLASH_KEY_GRANULE if dtype != torch.float32 else n
    parts = [_cpu_flash(q, k[:, :aligned], v[:, :aligned], scale, False, dtype)] if aligned else []
    if aligned < n:
        parts.append(_cpu_flash(q, k[:, aligned:], v[:, aligned:], scale, False, torch.float32))
    return parts


def _cpu_flash(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
               dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The partial through aten's CPU flash attention in `dtype`, which also returns the
    log-sum-exp: blocked over keys with the exponentials vectorized and no logit matrix, 3-4x
    faster than the blocked softmax below on one thread. Without a mask the G query heads of a
    kv-head are its rows (keys read once per group); causal rows are per token, so the group's
    keys are repeated. The partial comes back in float32 for the merge."""
    kv_heads, hq, t = k.shape[0], q.shape[0], q.shape[1]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    keys, values = (x.to(dtype, memory_format=torch.contiguous_format) for x in (k, v))
    if causal:
        groups = hq // kv_heads
        out, lse = flash(q.to(dtype)[None], keys.repeat_interleave(groups, 0)[None],
                         values.repeat_interleave(groups, 0)[None], is_causal=True, scale=scale)[:2]
    else:
        rows = q.to(dtype).reshape(kv_heads, hq // kv_heads * t, -1)
        out, lse = flash(rows[None], keys[None], values[None], scale=scale)[:2]
    return out.reshape(hq, t, -1).float(), lse.reshape(hq, t)


def _dense_block(qg: Tensor, keys: Tensor, values: Tensor, scale: float, mask: Tensor | None,
                 softcap: float | None) -> tuple[Tensor, Tensor]:
    """`partial_dense` of query rows qg [Hkv, G, T, d] over keys [Hkv, d, N] (transposed) and
    values [Hkv, N, dv] -> out [Hq, T, dv], lse [Hq, T]."""
    kv_heads, groups, t, d = qg.shape
    n = keys.shape[-1]
    logits = _capped(scale * (qg.reshape(kv_heads, groups * t, d) @ keys), softcap)
    if mask is not None:
        logits.view(kv_heads, groups, t, n).masked_fill_(~mask, -float("inf"))
    p, lse = _softmax_lse(logits)
    out = p @ values
    return out.reshape(kv_heads * groups, t, -1), lse.reshape(kv_heads * groups, t)


def partial_lowrank(q: Tensor, keys: LowRankHeads, values: LowRankHeads, scale: float,
                    softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Attention of q [Hq, T, d] to a Mid segment, computed on coefficients only.

    Every query row sees every token of the segment (Mid pages precede the chunk).
    """
    kv_heads, n, _ = keys.coefficients.shape
    hq, t, _ = q.shape
    dv = values.vectors.shape[1]
    if n == 0:
        return _empty(q, dv)
    rows = max(1, BLOCK_LOGITS // (hq * n)) if q.device.type == "cpu" else t
    if rows < t:  # blocks of query rows, as partial_dense (rows are independent)
        blocks = [partial_lowrank(q[:, r: r + rows], keys, values, scale, softcap) for r in range(0, t, rows)]
        return torch.cat([out for out, _ in blocks], 1), torch.cat([lse for _, lse in blocks], 1)
    qg = group_query_heads(q, kv_heads)
    projected = qg @ keys.vectors  # [Hkv, G*T, Rk]
    shift = qg @ keys.mean.unsqueeze(-1)  # [Hkv, G*T, 1]: q . mean_k, shared by all tokens
    logits = _capped(scale * (projected @ keys.coefficients.transpose(1, 2) + shift), softcap)
    p, lse = _softmax_lse(logits)
    mixed = p @ values.coefficients  # [Hkv, G*T, Rv]
    out = mixed @ values.vectors.transpose(1, 2) + values.mean.unsqueeze(1)
    return out.reshape(hq, t, dv), lse.reshape(hq, t)


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """Exact combination of segment results: ``sum_i exp(lse_i) out_i / sum_i exp(lse_i)``.

    Rows that no segment sees (every lse -inf) come out as zeros.
    """
    return merge_partials_lse(parts)[0]


def merge_partials_lse(parts: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """``merge_partials`` and the merged log-sum-exp (-inf where no segment sees a row): the
    merged result is itself a partial, to be merged with more segments later."""
    if not parts:
        raise ValueError("merge_partials needs at least one segment")
    lse = torch.stack([part_lse for _, part_lse in parts])  # [S, Hq, T]
    merged_lse = torch.logsumexp(lse, 0)  # -inf where no segment sees the row
    # Each segment's share exp(lse_s - merged); -inf (empty) segments and unseen rows weigh 0.
    weights = torch.exp(lse - torch.where(torch.isfinite(merged_lse), merged_lse, 0.0)).unsqueeze(-1)
    # Accumulated in place, segment by segment: no [S, Hq, T, dv] stack of the outputs.
    merged = parts[0][0].float() * weights[0]
    for s, (part_out, _) in enumerate(parts[1:], 1):
        merged.addcmul_(part_out, weights[s])
    return merged, merged_lse
