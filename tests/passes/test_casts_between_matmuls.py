"""Casts between attention's two matmuls are transparent only to a floating dtype: scores cut to
integers, or probabilities made 0/1 by a bool, are other math, refused and left as they are."""

import pytest
import torch

import kvtopo
from kvtopo.models.blocks import _Projections


class IntegerScores(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2)).to(torch.int32).to(torch.float32) * 0.35
        scores = scores + torch.full((t, t), float("-inf")).triu(1)
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class HardProbabilities(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2)) * 0.35 + torch.full((t, t), float("-inf")).triu(1)
        p = torch.softmax(scores, dim=-1).to(torch.bool).to(torch.float32)
        return self.out(p @ self.repeat_kv(v))


class HalfProbabilities(_Projections):
    """A floating round trip stays transparent: rewritten."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2)).float() * 0.35 + torch.full((t, t), float("-inf")).triu(1)
        return self.out(torch.softmax(scores, dim=-1).to(torch.float32) @ self.repeat_kv(v))


@pytest.mark.parametrize("cls,rewritten", [(IntegerScores, False), (HardProbabilities, False), (HalfProbabilities, True)],
                         ids=["int32 scores", "bool probabilities", "float casts"])
def test_only_floating_casts_are_seen_through(cls, rewritten):
    torch.manual_seed(0)
    block = cls().eval()
    x = torch.randn(2, 9, 32) * 3
    report = kvtopo.inspect(block, x)
    assert (len(report.sites), len(report.refusals)) == ((1, 0) if rewritten else (0, 1)), report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=0)
