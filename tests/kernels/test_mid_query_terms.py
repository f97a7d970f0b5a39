"""``MidCodes.query_terms``: what a Mid kernel dots with the key codes gives the layer's scaled
logits, for projected and unprojected (KIVI-style) Mid segments alike.

With ``qp, qb = query_terms(q, scale)`` a Mid key's logit is ``qp . c + qb`` (c its dequantized
coefficients, or its dequantized key when unprojected), which must equal ``scale * q . k`` for the
key ``k`` the codes stand for. The decode kernels call it for projected segments only (an
unprojected Mid reads the batch's already scaled query), so its unprojected form -- the scaled
query and a zero mean term on the identity basis -- is otherwise never compared with anything.
Checked against float64 logits over the decoded keys.
"""

from __future__ import annotations

import pytest
import torch

from segments import synthetic_segments

SCALE = 0.37


@pytest.mark.parametrize("projected", [True, False])
@pytest.mark.parametrize("kv_heads, group", [(1, 1), (2, 3), (3, 4)])
def test_query_terms_give_the_scaled_logits(projected, kv_heads, group):
    mid = synthetic_segments(kv_heads=kv_heads, group=group, dk=32, dv=32, exact=0, recent_pages=0, page_size=4,
                             mid_page_rows=(4, 2, 3), projected=projected, seed=kv_heads * 10 + group).mid
    q = torch.randn(kv_heads * group, 32, generator=torch.Generator().manual_seed(group))
    qp, qb = mid.query_terms(q, SCALE)
    assert qp.shape[:2] == qb.shape == (kv_heads, group)
    keys = mid.decode()[0]  # LowRankHeads: the identity basis with zero mean when unprojected
    coefficients = keys.coefficients.double()  # [Hkv, N, R]
    explicit = coefficients @ keys.vectors.double().transpose(1, 2) + keys.mean.double()[:, None]  # [Hkv, N, dk]
    want = SCALE * q.double().reshape(kv_heads, group, -1) @ explicit.transpose(1, 2)  # [Hkv, G, N]
    got = qp.double() @ coefficients.transpose(1, 2) + qb.double()[..., None]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if not projected:  # the identity basis: the scaled query itself and no mean term
        torch.testing.assert_close(qp, SCALE * q.reshape(kv_heads, group, -1))
        assert torch.equal(qb, torch.zeros_like(qb))
