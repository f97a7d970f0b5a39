"""Exact attention in plain torch: the definition every other kvtopo attention path must match.

Keys and values stay grouped by kv-head (GQA): q is [B, Hq, T, d], k/v are [B, Hkv, S, d] with
Hq a multiple of Hkv, so repeated K/V is never materialised by kvtopo itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of query heads over kv-head-grouped keys/values.

    `attn_mask` follows `scaled_dot_product_attention`: bool (True = attend) or additive float,
    broadcastable to [B, Hq, T, S]. `softcap` caps the scaled logits (`cap * tanh(x / cap)`)
    before the mask, and `sinks` [Hq] (gpt-oss) adds one logit per query head to every row's
    softmax whose column is dropped afterwards; SDPA can do neither, so those cases run the
    explicit decomposition.
    """
    if softcap is not None or sinks is not None:
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        return attention_decomposition(query, key, value, attn_mask, scale, is_causal, softcap, sinks).contiguous()
    grouped = query.shape[-3] != key.shape[-3]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, scale=scale, is_causal=is_causal, enable_gqa=grouped
    )
    return out.contiguous()


def chunk_causal_mask(history: int, chunk: int, device: torch.device | None = None,
                      window: int | None = None) -> torch.Tensor:
    """Bool mask [chunk, history + chunk]: every history token visible, causal within the chunk;
    with a sliding `window`, query i sees only keys j with i - window < j <= i."""
    rows = torch.arange(chunk, device=device)[:, None] + history
    cols = torch.arange(history + chunk, device=device)[None, :]
    visible = cols <= rows
    return visible if window is None else visible & (rows - cols < window)


def attention_decomposition(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention written with plain aten ops (matmul, softmax), for graph export.

    With `sinks` [Hq], each row's softmax runs over [logits ; sink of the row's head] and the
    sink's column is dropped: the output is the sink-free attention scaled by
    exp(lse) / (exp(lse) + exp(sink)), so a row with no visible key comes out zero.
    """
    groups = query.shape[-3] // key.shape[-3]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        # Top-left aligned, as `scaled_dot_product_attention(is_causal=True)` defines it.
        t, s = scores.shape[-2], scores.shape[-1]
        keep = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1)
    else:
        sink_column = sinks.float().reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.float(), sink_column], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value)
