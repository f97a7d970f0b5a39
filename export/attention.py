"""Attention of one step's queries over a compressed cache given as explicit tensors.

This is what replaces each `torch.ops.kvtopo.attention` node in the exported decode step. It
computes what `runtime.session.Session._attend_one` computes, from fixed-capacity buffers: one
softmax over the dense segments (exact pages, dequantized Recent int8 pages, an unprojected Mid's
dequantized codes, the new chunk with its causal mask) concatenated, each masked to its valid
length. A projected Mid is attended in the compressed domain (q projected onto the kept key
directions, dotted with the dequantized coefficients, the probability-weighted value coefficients
projected back once) and merged with the dense part by one exact log-sum-exp
(`kernels.compressed_attention.merge_partials`).

Per layer, the cache tensors (see export/layout.py for capacities; batch 1):
    exact_k [Hkv, E, dk], exact_v [Hkv, E, dv]                   float32
    recent_k_codes [Hkv, C, dk/(8/rb)], recent_v_codes [Hkv, C, dv/(8/rb)]   uint8, C = recent pages * P
    recent_k_scale, recent_k_offset [Hkv, C/P, dk]              per Recent page and channel
    recent_v_scale, recent_v_offset [Hkv, C]                    per token
    mid_k_codes [Hkv, M, R/(8/mb)], mid_v_codes [Hkv, M, R/(8/mb)]   uint8, M rows (kept tokens)
    mid_k_scale, mid_k_offset, mid_v_scale, mid_v_offset [Hkv, Mp, R]  per Mid page and direction
    mid_row_page [M] int64                                     the Mid page slot of each row
    key_vectors [Hkv, dk, R], key_mean [Hkv, dk], value_vectors [Hkv, dv, R], value_mean [Hkv, dv]
and lengths [3] int64: valid tokens in (exact, recent, mid). Rows past a length are ignored.

An unprojected Mid (KIVI-style codes, `CacheLayout.mid_projected` False) has no bases
(`BASIS_TENSORS` absent) and holds the tokens' own channels: mid_k_codes [Hkv, M, dk/(8/mb)] with
mid_k_scale / mid_k_offset [Hkv, Mp, dk] per Mid page and channel, mid_v_codes [Hkv, M, dv/(8/mb)]
with mid_v_scale / mid_v_offset [Hkv, M] per row. It is dequantized in the graph and attended
densely, masked by the Mid length.

MLA layers (`shared_value_dim` r set) cache what the session caches for them: one kv-head whose
key is [latent ; RoPE key] and whose value is the latent, i.e. the key's first r dims. The value
tensors (`VALUE_TENSORS`) are then absent and every segment reads its values from its keys: exact
and Recent keys sliced, Mid coefficients shared with the keys against the first r rows of the key
directions (as `runtime.codecs.MidSegment` with `shared_value_dim`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from kvtopo.kernels.compressed_attention import group_query_heads
from kvtopo.kernels.reference import chunk_causal_mask

from .compressor import unpack_codes


# Absent when the values are the keys' leading dims (MLA).
VALUE_TENSORS = ("exact_v", "recent_v_codes", "recent_v_scale", "recent_v_offset", "mid_v_codes", "mid_v_scale",
                 "mid_v_offset", "value_vectors", "value_mean")

# Absent when Mid is not projected (codes of the tokens' own channels).
BASIS_TENSORS = ("key_vectors", "key_mean", "value_vectors", "value_mean")


@dataclass
class LayerCacheTensors:
    exact_k: Tensor
    exact_v: Tensor
    recent_k_codes: Tensor
    recent_k_scale: Tensor
    recent_k_offset: Tensor
    recent_v_codes: Tensor
    recent_v_scale: Tensor
    recent_v_offset: Tensor
    mid_k_codes: Tensor
    mid_k_scale: Tensor
    mid_k_offset: Tensor
    mid_v_codes: Tensor
    mid_v_scale: Tensor
    mid_v_offset: Tensor
    mid_row_page: Tensor
    key_vectors: Tensor
    key_mean: Tensor
    value_vectors: Tensor
    value_mean: Tensor

    @classmethod
    def names(cls, shared_values: bool = False, projected: bool = True) -> list[str]:
        """Graph-input order of one layer's tensors (without the value tensors when shared, without
        the bases when Mid is not projected)."""
        return [f.name for f in fields(cls) if not (shared_values and f.name in VALUE_TENSORS)
                and not (not projected and f.name in BASIS_TENSORS)]

    @classmethod
    def from_flat(cls, tensors, shared_values: bool = False, projected: bool = True) -> "LayerCacheTensors":
        given = dict(zip(cls.names(shared_values, projected), tensors, strict=True))
        return cls(**{n: given.get(n) for n in cls.names()})


# The functions below are kernels.compressed_attention's partial_dense / _softmax_lse /
# merge_partials, with `isfinite(m)` written as `m > -inf` (m is a max of logits: finite or -inf),
# which every MLIR lowering has (torch-mlir lowers no aten.isfinite to linalg).
def _finite_or_zero(m: Tensor) -> Tensor:
    return torch.where(m > -float("inf"), m, torch.zeros_like(m))


def _softmax_lse(logits: Tensor) -> tuple[Tensor, Tensor]:
    m = _finite_or_zero(logits.amax(-1, keepdim=True))
    p = torch.exp(logits - m)
    total = p.sum(-1, keepdim=True)
    lse = (m + total.log()).squeeze(-1)
    return p / torch.where(total > 0, total, torch.ones_like(total)), lse


def partial_dense(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Tensor) -> tuple[Tensor, Tensor]:
    kv_heads, n, _ = k.shape
    hq, t, _ = q.shape
    logits = scale * (group_query_heads(q, kv_heads) @ k.float().transpose(1, 2))
    logits = logits.view(kv_heads, -1, t, n).masked_fill(~mask, -float("inf")).view(kv_heads, -1, n)
    p, lse = _softmax_lse(logits)
    return (p @ v.float()).reshape(hq, t, -1), lse.reshape(hq, t)


def merge_partials(parts) -> Tensor:
    lse = torch.stack([part_lse for _, part_lse in parts])
    m = _finite_or_zero(lse.amax(0))
    weights = torch.exp(lse - m)
    total = weights.sum(0)
    out = sum(w.unsqueeze(-1) * part_out for w, (part_out, _) in zip(weights, parts))
    return out / torch.where(total > 0, total, torch.ones_like(total)).unsqueeze(-1)


def _valid(n: int, length: Tensor, t: int, device) -> Tensor:
    return (torch.arange(n, device=device) < length)[None, :].expand(t, n)


def dequantize_recent(c: LayerCacheTensors, page_size: int, bits: int,
                      shared_value_dim: int | None = None) -> tuple[Tensor, Tensor]:
    heads, rows, dk = c.recent_k_codes.shape[0], c.recent_k_codes.shape[1], c.exact_k.shape[-1]
    kc = unpack_codes(c.recent_k_codes, bits)[..., :dk].reshape(heads, rows // page_size, page_size, dk)
    keys = (c.recent_k_offset[:, :, None] + kc * c.recent_k_scale[:, :, None]).reshape(heads, rows, dk)
    if shared_value_dim:
        return keys, keys[..., :shared_value_dim]
    return keys, dequantize_rows(c.recent_v_codes, c.recent_v_scale, c.recent_v_offset, bits, c.exact_v.shape[-1])


def dequantize_rows(codes: Tensor, scale: Tensor, offset: Tensor, bits: int, dim: int) -> Tensor:
    """Packed codes [Hkv, N, dim/(8/bits)] with one statistics pair per row ([Hkv, N]) -> [Hkv, N, dim]."""
    return offset[..., None] + unpack_codes(codes, bits)[..., :dim] * scale[..., None]


def dequantize_paged(codes: Tensor, scale: Tensor, offset: Tensor, row_page: Tensor, bits: int, dim: int) -> Tensor:
    """Packed Mid codes [Hkv, M, dim/(8/bits)] with statistics per page and column ([Hkv, Mp, dim],
    row i using page row_page[i]) -> [Hkv, M, dim]."""
    return offset[:, row_page] + unpack_codes(codes, bits)[..., :dim] * scale[:, row_page]


def dequantize_mid_unprojected(c: LayerCacheTensors, bits: int, shared_value_dim: int | None = None
                               ) -> tuple[Tensor, Tensor]:
    """An unprojected Mid's keys (statistics per page and channel) and values (per row; the keys'
    first `shared_value_dim` dims when set: MLA), [Hkv, M, dk] and [Hkv, M, dv]."""
    keys = dequantize_paged(c.mid_k_codes, c.mid_k_scale, c.mid_k_offset, c.mid_row_page, bits, c.exact_k.shape[-1])
    if shared_value_dim:
        return keys, keys[..., :shared_value_dim]
    return keys, dequantize_rows(c.mid_v_codes, c.mid_v_scale, c.mid_v_offset, bits, c.exact_v.shape[-1])


def partial_lowrank_masked(q: Tensor, coeff_k: Tensor, key_vectors: Tensor, key_mean: Tensor, coeff_v: Tensor,
                           value_vectors: Tensor, value_mean: Tensor, scale: float, valid: Tensor):
    """`kernels.compressed_attention.partial_lowrank` with a [T, N] visibility mask."""
    kv_heads, n, _ = coeff_k.shape
    hq, t, _ = q.shape
    dv = value_vectors.shape[1]
    qg = group_query_heads(q, kv_heads)
    projected = qg @ key_vectors
    shift = qg @ key_mean.unsqueeze(-1)
    logits = scale * (projected @ coeff_k.transpose(1, 2) + shift)
    logits = logits.view(kv_heads, -1, t, n).masked_fill(~valid, -float("inf")).view(kv_heads, -1, n)
    p, lse = _softmax_lse(logits)
    mixed = p @ coeff_v
    out = mixed @ value_vectors.transpose(1, 2) + value_mean.unsqueeze(1)
    return out.reshape(hq, t, dv), lse.reshape(hq, t)


def cached_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, c: LayerCacheTensors, lengths: Tensor,
                     page_size: int, recent_bits: int, mid_bits: int, shared_value_dim: int | None = None) -> Tensor:
    """q [1, Hq, T, d], new k/v [1, Hkv, T, d] -> [1, Hq, T, dv] over [cache ; chunk].

    `shared_value_dim` r: the values are the keys' first r dims (`v` is ignored, `c` holds no
    value tensors), as `Session.attend` with `shared_value_dim`.
    """
    q, k, v = q[0], k[0], v[0]
    r = shared_value_dim
    if r:
        v = k[..., :r]
    t = q.shape[1]
    dev = q.device
    # The dense segments (exact, Recent, an unprojected Mid, the chunk) are one softmax over their
    # concatenation, each masked to its length: the same function as a partial per segment merged
    # by log-sum-exp, in ~110 fewer graph nodes per layer (SmolLM2's decode step: 7,964 -> 4,539),
    # which onnxruntime runs one by one.
    rk, rv = dequantize_recent(c, page_size, recent_bits, r)
    keys = [c.exact_k, rk]
    values = [c.exact_k[..., :r] if r else c.exact_v, rv]
    masks = [_valid(c.exact_k.shape[1], lengths[0], t, dev), _valid(rk.shape[1], lengths[1], t, dev)]
    mid = None
    if c.key_vectors is None:  # unprojected Mid: dequantized keys and values
        mk, mv = dequantize_mid_unprojected(c, mid_bits, r)
        keys, values = keys + [mk], values + [mv]
        masks.append(_valid(mk.shape[1], lengths[2], t, dev))
    else:  # projected Mid: attended in the compressed domain, merged by log-sum-exp
        mid = _partial_mid_projected(q, c, lengths[2], scale, mid_bits, r)
    keys, values = torch.cat(keys + [k], dim=1), torch.cat(values + [v], dim=1)
    masks.append(chunk_causal_mask(0, t, device=dev))
    dense = partial_dense(q, keys, values, scale, torch.cat(masks, dim=-1))
    out = dense[0] if mid is None else merge_partials([dense, mid])
    return out.to(q.dtype)[None]


def _partial_mid_projected(q: Tensor, c: LayerCacheTensors, length: Tensor, scale: float, mid_bits: int,
                           r: int | None) -> tuple[Tensor, Tensor]:
    """The projected Mid's partial, in the compressed domain (values from the keys' coefficients
    against the first r key-direction rows when r is set: MLA)."""
    page, rank = c.mid_row_page, c.key_vectors.shape[-1]
    ck = dequantize_paged(c.mid_k_codes, c.mid_k_scale, c.mid_k_offset, page, mid_bits, rank)
    if r:
        cv, value_vectors, value_mean = ck, c.key_vectors[:, :r], c.key_mean[:, :r]
    else:
        cv = dequantize_paged(c.mid_v_codes, c.mid_v_scale, c.mid_v_offset, page, mid_bits, rank)
        value_vectors, value_mean = c.value_vectors, c.value_mean
    return partial_lowrank_masked(q, ck, c.key_vectors, c.key_mean, cv, value_vectors, value_mean, scale,
                                  _valid(ck.shape[1], length, q.shape[1], q.device))
