"""Mid stored as dense floats (``mid_other`` of a baseline policy, unprojected) is attended by
every path and counted by the float64 reference.

``DecodeSegments.mid_other`` holds a baseline policy's Mid either as float coefficients on bases
(projected) or as plain keys/values (dense). The decode and history paths attend the dense form
with ``partial_dense``, and ``explicit_kv`` / ``reference_decode`` / ``reference_history`` (the
ground truth of every kernel test) must include those tokens; a reference that left them out
would let every path drop them unnoticed. Checked against a float64 softmax written out here over
the concatenated exact and Mid tokens.
"""

from __future__ import annotations

import torch

from kvtopo.kernels.decode_inputs import DecodeSegments
from kvtopo.kernels.decode_reference import explicit_kv, reference_decode, reference_history
from kvtopo.kernels.fast_decode import decode_attention
from kvtopo.kernels.history_attention import history_attention

HEADS, GROUP, D, SCALE = 2, 3, 16, 0.4


def _segments(seed: int):
    g = torch.Generator().manual_seed(seed)
    exact = (torch.randn(HEADS, 3, D, generator=g), torch.randn(HEADS, 3, D, generator=g))
    mid = (2 * torch.randn(HEADS, 9, D, generator=g), torch.randn(HEADS, 9, D, generator=g) + 2)
    keys = torch.cat([exact[0], mid[0]], 1).double()
    values = torch.cat([exact[1], mid[1]], 1).double()
    return DecodeSegments(exact=exact, mid_other=mid), keys, values


def _float64(q, keys, values):
    """q [Hq, T, d] over every token: out [Hq, T, d], lse [Hq, T]."""
    logits = SCALE * q.double().reshape(HEADS, -1, D) @ keys.transpose(1, 2)
    out = torch.softmax(logits, -1) @ values
    return out.reshape(HEADS * GROUP, -1, D), torch.logsumexp(logits, -1).reshape(HEADS * GROUP, -1)


def test_reference_counts_dense_mid_tokens():
    segs, keys, values = _segments(0)
    k, v = explicit_kv(segs)
    assert k.shape[1] == 12
    q = torch.randn(HEADS * GROUP, D, generator=torch.Generator().manual_seed(1))
    want, _ = _float64(q[:, None], keys, values)
    torch.testing.assert_close(reference_decode(q, segs, SCALE), want[:, 0])


def test_decode_and_history_attend_dense_mid_tokens():
    segs, keys, values = _segments(2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(HEADS * GROUP, D, generator=g)
    want, _ = _float64(q[:, None], keys, values)
    torch.testing.assert_close(decode_attention(q, segs, SCALE).double(), want[:, 0], rtol=1e-5, atol=1e-5)
    chunk = torch.randn(HEADS * GROUP, 4, D, generator=g)
    out, lse = history_attention(chunk, segs, SCALE)
    want_out, want_lse = _float64(chunk, keys, values)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    ref_out, ref_lse = reference_history(chunk, segs, SCALE)
    torch.testing.assert_close(ref_out, want_out)
    torch.testing.assert_close(ref_lse, want_lse)
