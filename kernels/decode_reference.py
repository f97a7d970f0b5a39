"""Ground truth for the decode kernels: the same stored codes decoded to explicit K/V and one
softmax in float64 (tests and benchmarks compare every decode path against it)."""

from __future__ import annotations

import torch
from torch import Tensor

from .decode_inputs import DecodeSegments, MidCodes


def explicit_kv(segs: DecodeSegments, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    """Every segment decoded to explicit K and V [Hkv, N, d] in ``dtype`` (same stored codes)."""
    ks, vs = [], []
    exact = segs.exact_kv()
    if exact is not None:
        ks.append(exact[0].to(dtype))
        vs.append(exact[1].to(dtype))
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


def reference_history(q: Tensor, segs: DecodeSegments, scale: float, dtype=torch.float64,
                      softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """Ground truth for a chunk's queries q [Hq, T, d] over the stored history (every row sees
    every token): (out [Hq, T, dv], lse [Hq, T]) in ``dtype``."""
    k, v = explicit_kv(segs, dtype)
    hkv = k.shape[0]
    hq, t, d = q.shape
    logits = scale * q.to(dtype).reshape(hkv, -1, d) @ k.transpose(1, 2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    out = torch.softmax(logits, -1) @ v
    return out.reshape(hq, t, -1), torch.logsumexp(logits, -1).reshape(hq, t)
