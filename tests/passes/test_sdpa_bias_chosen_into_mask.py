"""A float attn_mask made by `masked_fill` or `where` holds only 0 and hiding values when both
values it chooses between do: `bias.masked_fill(future, -inf)` and `where(visible, bias, -inf)`
keep the bias on every visible key, so the SDPA pass refuses them (a session run token by token
would see only the bias's 0 on the token's own key), while the same forms choosing between 0 and
-inf are a plain causal mask, rewritten and exact token by token."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models.blocks import _Projections


def _future(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).triu(1)


def _alibi(t: int) -> torch.Tensor:
    """[4, t, t] per-head slope times the (non-positive) distance back to the key: 0 on the diagonal."""
    distance = torch.arange(t)[None, :] - torch.arange(t)[:, None]
    return torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None] * distance.clamp(max=0).float()


class _FilledMask(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        mask = self.base(t).masked_fill(_future(t), float("-inf"))
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class BiasFilled(_FilledMask):
    def base(self, t):
        return _alibi(t)


class EarlierKeysLowered(_FilledMask):
    """Every earlier key lowered by 3, the token's own key not: a bias with no position arithmetic."""

    def base(self, t):
        return torch.ones(t, t).tril(-1) * -3.0


class ZerosFilled(_FilledMask):
    def base(self, t):
        return torch.zeros(t, t)


class _ChosenMask(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        mask = torch.where(~_future(t), self.visible_value(t), float("-inf"))
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class BiasWhereVisible(_ChosenMask):
    """Every earlier key lowered by 3 where visible."""

    def visible_value(self, t):
        return torch.ones(t, t).tril(-1) * -3.0


class ZerosWhereVisible(_ChosenMask):
    def visible_value(self, t):
        return torch.zeros(t, t)


@pytest.mark.parametrize("cls", [BiasFilled, EarlierKeysLowered, BiasWhereVisible], ids=lambda c: c.__name__)
def test_a_bias_filled_with_minus_inf_is_refused_and_a_session_raises(cls):
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


@pytest.mark.parametrize("cls", [ZerosFilled, ZerosWhereVisible], ids=lambda c: c.__name__)
def test_zeros_and_minus_inf_chosen_by_position_are_a_causal_mask(cls):
    torch.manual_seed(0)
    block = cls().eval()
    x = torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
        with kvtopo.session(kvtopo.Config.lossless()):
            got = torch.cat([compiled(x[:, i:i + 1]) for i in range(x.shape[1])], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
