"""Eager attention whose scores and probabilities go through several floating casts in a row
(`.float().contiguous()`, `.to(float32).contiguous()`): every cast in a chain is transparent,
so the block is rewritten, and in a session run token by token it equals the eager block."""

import torch

import kvtopo
from kvtopo.models.blocks import _Projections


class ChainedCasts(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2)).float().contiguous() * 0.35
        scores = scores + torch.full((t, t), float("-inf")).triu(1)
        p = torch.softmax(scores, dim=-1).to(torch.float32).contiguous()
        return self.out(p @ self.repeat_kv(v))


def test_a_chain_of_floating_casts_is_seen_through():
    torch.manual_seed(0)
    block = ChainedCasts().eval()
    x = torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals, report.format()
    assert report.sites[0].scale == 0.35
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            got = torch.cat([compiled(x[:, :3])] + [compiled(x[:, i:i + 1]) for i in range(3, 7)], 1)
            assert s.stats().tokens == (7,)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
