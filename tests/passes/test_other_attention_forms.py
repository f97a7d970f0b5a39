"""Attention that no pass rewrites, in forms test_blocks.py and test_other_attention.py do not
cover: refused by name, and a session raises instead of attending over the new chunk alone."""

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models.blocks import _Projections


def _future(t):
    return torch.ones(t, t, dtype=torch.bool).triu(1)


class CheckpointedEagerAttention(_Projections):
    """Softmax over q @ k^T inside torch.utils.checkpoint: no SDPA call in the subgraph."""

    def forward(self, x):
        def attend(q, k, v):
            scores = (q @ self.repeat_kv(k).transpose(-1, -2) * 0.35).masked_fill(_future(q.shape[2]), float("-inf"))
            return torch.softmax(scores, dim=-1) @ self.repeat_kv(v)

        return self.out(torch.utils.checkpoint.checkpoint(attend, *self.qkv(x), use_reentrant=False))


class NestedCheckpoints(_Projections):
    """SDPA inside a checkpoint inside a checkpoint."""

    def forward(self, x):
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), is_causal=True)

        def outer(q, k, v):
            return torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False) * 1.0

        return self.out(torch.utils.checkpoint.checkpoint(outer, *self.qkv(x), use_reentrant=False))


class AtenMathAttention(_Projections):
    """The aten math kernel of SDPA called directly."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(q, self.repeat_kv(k), self.repeat_kv(v),
                                                                    is_causal=True)
        return self.out(out)


CASES = {
    CheckpointedEagerAttention: "a softmax over a product",
    NestedCheckpoints: "scaled_dot_product_attention inside the subgraph",
    AtenMathAttention: "aten._scaled_dot_product_attention_math is an attention kvtopo does not rewrite",
}


@pytest.mark.parametrize("cls", list(CASES), ids=[c.__name__ for c in CASES])
def test_attention_no_pass_rewrites_is_refused_and_a_session_raises(cls):
    block = cls().eval()
    x = torch.randn(1, 8, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and len(report.refusals) == 1 and CASES[cls] in report.refusals[0].reason, report.refusals
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=0)  # outside a session: unchanged
        with kvtopo.session(kvtopo.Config.lossless()) as s, pytest.raises(RefusedAttention):
            compiled(x[:, :4])
        assert s.stats().tokens == ()
