"""SDPA inputs built inside the graph that only look like a mask or a GQA repeat.

A float attn_mask that is not 0 / very negative everywhere is a bias; on a one-token chunk it
shows only its 0 on the token's own key, so the session's check of the chunk's mask values
cannot see it, and the history would be attended without it. The passes must refuse it at
compile time: a session run token by token then raises before computing. Keys repeated along
the token axis are not a GQA repeat: walked back, the op would attend over half the keys.
"""

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


class _BiasedSDPA(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        mask = self.mask(x.shape[1])
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class CausalMaskPlusBias(_BiasedSDPA):
    """A causal 0/-inf mask plus ALiBi: a sum of a mask and a bias."""

    def mask(self, t):
        return torch.full((t, t), float("-inf")).triu(1) + _alibi(t)


class BiasWhereVisible(_BiasedSDPA):
    """`where(visible, alibi, -inf)`: the bias on every visible key."""

    def mask(self, t):
        return torch.where(~_future(t), _alibi(t), float("-inf"))


class SoftCausalFill(_BiasedSDPA):
    """Future keys lowered by 5 (`full(-5).triu(1)`), not hidden."""

    def mask(self, t):
        return torch.full((t, t), -5.0).triu(1)


class SoftCausalProduct(_BiasedSDPA):
    """`(1 - visible) * -5`, HF's old `(1 - mask) * min` with a constant that does not hide."""

    def mask(self, t):
        return (1 - (~_future(t)).int()) * -5.0


BIASES = [CausalMaskPlusBias, BiasWhereVisible, SoftCausalFill, SoftCausalProduct]


@pytest.mark.parametrize("cls", BIASES, ids=[c.__name__ for c in BIASES])
def test_a_bias_built_in_the_graph_is_refused_and_a_session_raises_token_by_token(cls):
    block = cls().eval()
    x = torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and len(report.refusals) == 1, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=0)
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            with pytest.raises(RefusedAttention):
                for i in range(x.shape[1]):  # one token per call: the chunk's mask is [[0]]
                    compiled(x[:, i:i + 1])
            assert s.stats().tokens == ()


class KeysRepeatedAlongTokens(_Projections):
    """`repeat_interleave(2, dim=2)`: every key twice, along the token axis, with a causal mask."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        k, v = (self.repeat_kv(t).repeat_interleave(2, dim=2) for t in (k, v))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_keys_repeated_along_the_token_axis_are_not_a_gqa_repeat():
    block = KeysRepeatedAlongTokens().eval()
    x = torch.randn(2, 7, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and "14 keys for 7 queries" in report.refusals[0].reason, report.format()
    with torch.no_grad():
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
    torch.testing.assert_close(got, block(x).detach(), atol=1e-5, rtol=0)


class NoMaskNotCausal(_Projections):
    """SDPA with neither attn_mask nor is_causal: bidirectional, except over a one-token chunk."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_one_query_without_a_mask_is_rewritten():
    """One query sees every key of its chunk either way (HF's decode step passes no mask and
    is_causal=False): rewritten, and token by token in a session it equals causal attention."""
    block = NoMaskNotCausal().eval()
    x = torch.randn(1, 5, 32)
    report = kvtopo.inspect(block, x[:, :1])
    assert len(report.sites) == 1 and not report.refusals, report.format()
    q, k, v = block.qkv(x)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    expected = block.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)).detach()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        got = torch.cat([compiled(x[:, i:i + 1]) for i in range(x.shape[1])], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
