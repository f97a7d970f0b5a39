"""Small plain `nn.Module` attention blocks, written the ways attention is written in the wild.

Each takes x [batch, tokens, hidden] and returns [batch, tokens, hidden]; all are causal
self-attention with optional GQA, so the kvtopo passes must find every one of them.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Projections(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4, kv_heads: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def qkv(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def repeat_kv(self, t):
        """HF-style GQA repeat: expand + reshape."""
        n = self.heads // self.kv_heads
        b, h, s, d = t.shape
        return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    def out(self, attn):
        b, _, t, _ = attn.shape
        return self.o(attn.transpose(1, 2).reshape(b, t, -1))


class SDPACausal(_Projections):
    """SDPA with `is_causal=True` and native GQA (`enable_gqa`)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


class SDPAFloatMask(_Projections):
    """SDPA with an explicit additive float causal mask and repeat_kv."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class SDPABoolMask(_Projections):
    """SDPA with a bool causal mask (True = attend) and repeat_interleave GQA."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        n = self.heads // self.kv_heads
        k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


class EagerMulScale(_Projections):
    """matmul -> * scale -> + mask -> softmax(fp32 upcast) -> .to(dtype) -> matmul (HF eager)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        mask = torch.full((t, t), torch.finfo(x.dtype).min, device=x.device).triu(1)
        scores = torch.matmul(q, self.repeat_kv(k).transpose(2, 3)) * self.head_dim**-0.5
        probs = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.out(torch.matmul(probs, self.repeat_kv(v)))


class EagerDivScale(_Projections):
    """(q @ k^T) / sqrt(d) -> masked_fill(future, -inf) -> softmax (no upcast) -> @ v, no GQA."""

    def __init__(self, **kw):
        super().__init__(kv_heads=kw.pop("kv_heads", 4), **kw)

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = (q @ k.transpose(-1, -2)) / (self.head_dim**0.5)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return self.out(probs @ v)


class EagerInPlaceScale(_Projections):
    """Falcon's eager form: `scores = q @ k^T; scores /= sqrt(d)` in place, then softmax(scores + mask)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = q @ self.repeat_kv(k).transpose(-1, -2)
        scores /= math.sqrt(self.head_dim)
        probs = F.softmax(scores + mask, dim=-1, dtype=q.dtype)
        return self.out(probs @ self.repeat_kv(v))


class GPT2Legacy(_Projections):
    """GPT-2's older eager attention: where(causal_mask, scores, finfo.min) then + padding mask.
    Refused: the causal mask is a slice of a buffer, whose values the passes cannot read (GPT-Neo
    keeps a sliding band in the same form)."""

    def __init__(self, **kw):
        super().__init__(kv_heads=kw.pop("kv_heads", 4), **kw)
        self.register_buffer("bias", torch.ones(256, 256, dtype=torch.bool).tril().view(1, 1, 256, 256), persistent=False)

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], self.head_dim**0.5)
        causal = self.bias[:, :, :t, :t]
        mask_value = torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
        scores = torch.where(causal, scores.to(scores.dtype), mask_value)
        padding = torch.zeros(x.shape[0], 1, 1, t, device=x.device)
        probs = F.softmax(scores + padding, dim=-1).type(v.dtype)
        return self.out(torch.matmul(probs, v))


BLOCKS = {cls.__name__: cls for cls in (SDPACausal, SDPAFloatMask, SDPABoolMask, EagerMulScale, EagerDivScale,
                                        EagerInPlaceScale)}
