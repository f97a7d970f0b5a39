"""A float attn_mask built in the graph hides a key only at or below -1e4, the value the session
reads as hidden: a causal mask of -5000 (a large penalty, not a hidden key, by that rule) is a
bias, refused at compile time so that a session raises before computing, while the same mask
at -1e4 is a causal mask, rewritten and exact token by token."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models.blocks import _Projections


class CausalFill(_Projections):
    def __init__(self, fill):
        super().__init__()
        self.fill = fill

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        mask = torch.full((t, t), self.fill).triu(1)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


def test_a_fill_above_the_hiding_floor_is_refused():
    block = CausalFill(-5000.0).eval()
    x = torch.randn(1, 6, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and len(report.refusals) == 1, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(RefusedAttention):
            compiled(x)
        assert s.stats().tokens == ()


def test_a_fill_at_the_hiding_floor_is_a_causal_mask():
    block = CausalFill(-1e4).eval()
    x = torch.randn(1, 6, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
        with kvtopo.session(kvtopo.Config.lossless()):
            got = torch.cat([compiled(x[:, i:i + 1]) for i in range(x.shape[1])], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
