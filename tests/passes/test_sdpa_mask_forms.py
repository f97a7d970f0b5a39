"""SDPA inputs built inside the graph that only look like a mask or a GQA repeat.

A float attn_mask that is not 0 / very negative everywhere is a bias; on a one-token chunk it
shows only its 0 on the token's own key, so the session's check of the chunk's mask values
cannot see it, and the history would be attended without it. The passes must refuse it at
compile time: a session run token by token then raises before computing. Keys repeated along
the token axis are not a GQA repeat: walked back, the op would attend over half the keys.

What counts as a mask: a float built only of 0 and values at or below -1e4 (the value the
session reads as hidden); a product with a hiding constant only of a tensor holding 0/1 by
construction (bool, integer, `1 - ` one); a sum only of masks; a `masked_fill` / `where` only
between masks; through any chain of views, casts and copies. Each bias below breaks one of those
rules by a little; each mask is rewritten and exact chunk by chunk.
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


class FillAboveTheFloor(_BiasedSDPA):
    """Future keys lowered by 5000: a large penalty, above the -1e4 that hides."""

    def mask(self, t):
        return torch.full((t, t), -5000.0).triu(1)


class BiasFilled(_BiasedSDPA):
    """`alibi.masked_fill(future, -inf)`: the bias on every visible key."""

    def mask(self, t):
        return _alibi(t).masked_fill(_future(t), float("-inf"))


class EarlierKeysLoweredFilled(_BiasedSDPA):
    """Every earlier key lowered by 3, then the future filled: a bias with no position arithmetic."""

    def mask(self, t):
        return (torch.ones(t, t).tril(-1) * -3.0).masked_fill(_future(t), float("-inf"))


class EarlierKeysLoweredWhereVisible(_BiasedSDPA):
    def mask(self, t):
        return torch.where(~_future(t), torch.ones(t, t).tril(-1) * -3.0, float("-inf"))


class ScaledFloatPenalty(_BiasedSDPA):
    """A float of 0.1 times a hiding constant: -1000 on every earlier key."""

    def mask(self, t):
        return torch.full((t, t), 0.1).tril(-1) * -1e4 + torch.full((t, t), float("-inf")).triu(1)


class CausalPlusPenalty(_BiasedSDPA):
    """A causal mask plus -3 on every earlier key: a sum with one addend a mask."""

    def mask(self, t):
        return torch.ones(t, t).tril(-1) * -3.0 + torch.full((t, t), float("-inf")).triu(1)


BIASES = [CausalMaskPlusBias, BiasWhereVisible, SoftCausalFill, SoftCausalProduct, FillAboveTheFloor, BiasFilled,
          EarlierKeysLoweredFilled, EarlierKeysLoweredWhereVisible, ScaledFloatPenalty, CausalPlusPenalty]


def _refused_and_a_session_raises_token_by_token(block, x):
    """The site refused; the compiled block equals the eager one outside a session, and inside
    one raises before storing a token. Returns the report."""
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
    return report


@pytest.mark.parametrize("cls", BIASES, ids=[c.__name__ for c in BIASES])
def test_a_bias_built_in_the_graph_is_refused_and_a_session_raises_token_by_token(cls):
    torch.manual_seed(0)
    _refused_and_a_session_raises_token_by_token(cls().eval(), torch.randn(1, 7, 32))


class ZerosFilled(_BiasedSDPA):
    def mask(self, t):
        return torch.zeros(t, t).masked_fill(_future(t), float("-inf"))


class ZerosWhereVisible(_BiasedSDPA):
    def mask(self, t):
        return torch.where(~_future(t), torch.zeros(t, t), float("-inf"))


class ScaledIntegerMask(_BiasedSDPA):
    """`(1 - visible.int()) * -1e4`, HF's old form of a causal mask."""

    def mask(self, t):
        return (1 - torch.ones(t, t, dtype=torch.bool).tril().int()) * -1e4


class FillAtTheFloor(_BiasedSDPA):
    def mask(self, t):
        return torch.full((t, t), -1e4).triu(1)


class ChainedCausalMask(_Projections):
    """A causal mask through views, casts, a copy and sums, as HF's mask preparation goes."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        b, t, _ = x.shape
        mask = torch.full((t, t), float("-inf")).triu(1)
        mask = mask[None, None].expand(b, 1, t, t).to(x.dtype).clone().contiguous()
        mask = mask + torch.zeros(b, 1, 1, t, dtype=x.dtype)  # no padding
        mask = torch.minimum(mask.float().reshape(b, 1, t, t), torch.zeros(1, dtype=x.dtype))
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


MASKS = [ZerosFilled, ZerosWhereVisible, ScaledIntegerMask, FillAtTheFloor, ChainedCausalMask]


@pytest.mark.parametrize("cls", MASKS, ids=[c.__name__ for c in MASKS])
def test_a_mask_built_in_the_graph_is_rewritten_and_exact_chunk_by_chunk(cls):
    torch.manual_seed(0)
    block, x = cls().eval(), torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
        with kvtopo.session(kvtopo.Config.lossless()):
            got = torch.cat([compiled(x[:, :2])] + [compiled(x[:, i:i + 1]) for i in range(2, 7)], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


class MaskAndCausal(_Projections):
    """attn_mask (the token and the 2 before it) and is_causal=True together: PyTorch's CPU
    kernels accept it; which of the two the model means is not the pass's to guess."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        window = torch.ones(t, t, dtype=torch.bool).tril().triu(-2)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=window,
                                                       is_causal=True))


def test_a_mask_together_with_is_causal_is_refused_by_name():
    torch.manual_seed(0)
    report = _refused_and_a_session_raises_token_by_token(MaskAndCausal().eval(), torch.randn(1, 7, 32))
    assert "both attn_mask and is_causal" in report.refusals[0].reason


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


class KeysTiledAlongTokens(_Projections):
    """`k[:, :, None].expand(b, h, 2, s, d).reshape(b, h, 2s, d)`: shaped like HF's repeat_kv,
    but two copies of the chunk's tokens, each attended causally."""

    def __init__(self):
        super().__init__(heads=4, kv_heads=4)

    def forward(self, x):
        q, k, v = self.qkv(x)

        def tile(t):
            b, h, s, d = t.shape
            return t[:, :, None].expand(b, h, 2, s, d).reshape(b, h, 2 * s, d)

        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return self.out(F.scaled_dot_product_attention(q, tile(k), tile(v), attn_mask=torch.cat([causal, causal], 1)))


def test_keys_tiled_along_the_token_axis_are_not_a_gqa_repeat():
    torch.manual_seed(0)
    block, x = KeysTiledAlongTokens().eval(), torch.randn(1, 6, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and "12 keys for 6 queries" in report.refusals[0].reason, report.format()
    with torch.no_grad():
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
    torch.testing.assert_close(got, block(x), atol=1e-5, rtol=0)



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
