"""Fast decode attention (one query token per sequence) over a phased, compressed KV history.

The runtime keeps one sequence-layer's history as exact pages, low-bit Recent pages and a
contiguous Mid segment of packed low-bit coefficient codes (runtime/codecs.py). The torch
reference (kernels/compressed_attention.py) dequantizes all of it to float32 every step; the fast
path reads the codes as they are stored (``DecodeSegments``, kernels/decode_inputs.py, gathered
by runtime/decode_view.py): CUDA tensors go to the Triton kernels (kernels/triton_decode.py), CPU
tensors to the fused C++ kernel (kernels/cpu_decode.py). Both are checked against the float64
reference of kernels/decode_reference.py. A decode step of many sequences
(``decode_attention_batch``) is one call on either.

Measured (bench/decode_speed.py, 1 thread, shared 2-core machine): see bench/results.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .cpu_decode import cpu_decode_attention, cpu_decode_batch
from .decode_inputs import DecodeSegments, check_softcap


def decode_attention(q: Tensor, segs: DecodeSegments, scale: float, out: Tensor | None = None,
                     softcap: float | None = None) -> Tensor:
    """Attention of q [Hq, d] (one token) over all segments -> [Hq, dv] float32.

    ``softcap``: every logit becomes ``softcap * tanh(logit / softcap)`` before the softmax
    (Gemma-2's logit softcapping, in every segment and backend; None: not)."""
    check_softcap(softcap)
    if q.is_cuda:
        from .triton_decode import triton_decode_attention

        return triton_decode_attention(q, segs, scale, out=out, softcap=softcap)
    result = cpu_decode_attention(q, segs, scale, softcap=softcap)
    if out is not None:
        out.copy_(result)
        return out
    return result


def decode_attention_batch(q: Tensor, segs: Sequence[DecodeSegments], scale: float,
                           softcap: float | None = None) -> Tensor:
    """Decode attention of a batch: q [B, Hq, d], one token per sequence, over ``segs[b]``
    -> [B, Hq, dv] float32, one call for the whole batch: ``cpu_decode_batch`` on CPU, on CUDA
    ``triton_decode_batch`` (one launch per kind of segment over all sequences)."""
    check_softcap(softcap)
    if q.is_cuda:
        from .triton_decode import triton_decode_batch

        return triton_decode_batch(q, segs, scale, softcap=softcap)
    return cpu_decode_batch(q, segs, scale, softcap=softcap)
