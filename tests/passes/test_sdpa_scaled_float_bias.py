"""A float mask built by arithmetic is a mask only when every term is: a product with a hiding
constant only when what is multiplied holds 0/1 values by construction (a bool or integer
tensor, or `1 - ` one), a sum only when both addends are masks. `full(0.1).tril(-1) * -1e4` is
a bias of -1000 on every earlier key, and `ones.tril(-1) * -3 + causal` one of -3, with 0 on
the token's own key: the SDPA pass refuses both (token by token a session would see only the 0),
while `(1 - causal.int()) * -1e4`, HF's old form of a causal mask, is rewritten and exact token
by token."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models.blocks import _Projections


def _future(t):
    return torch.full((t, t), float("-inf")).triu(1)


class _Masked(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        mask = self.mask(x.shape[1])
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class ScaledFloatPenalty(_Masked):
    def mask(self, t):
        return torch.full((t, t), 0.1).tril(-1) * -1e4 + _future(t)


class CausalPlusPenalty(_Masked):
    def mask(self, t):
        return torch.ones(t, t).tril(-1) * -3.0 + _future(t)


class ScaledIntegerMask(_Masked):
    def mask(self, t):
        visible = torch.ones(t, t, dtype=torch.bool).tril()
        return (1 - visible.int()) * -1e4


@pytest.mark.parametrize("cls", [ScaledFloatPenalty, CausalPlusPenalty], ids=lambda c: c.__name__)
def test_a_penalty_on_earlier_keys_is_a_bias_and_refused(cls):
    torch.manual_seed(0)
    block = cls().eval()
    x = torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and len(report.refusals) == 1, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=0)
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            with pytest.raises(RefusedAttention):
                for i in range(x.shape[1]):
                    compiled(x[:, i:i + 1])
            assert s.stats().tokens == ()


def test_a_zero_one_mask_times_a_hiding_constant_is_a_causal_mask():
    torch.manual_seed(0)
    block = ScaledIntegerMask().eval()
    x = torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
        with kvtopo.session(kvtopo.Config.lossless()):
            got = torch.cat([compiled(x[:, i:i + 1]) for i in range(x.shape[1])], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
