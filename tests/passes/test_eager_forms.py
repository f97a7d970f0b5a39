"""Hand-written attention in forms the eager pass must refuse, or take and reproduce exactly.

Each block is a spelling the eager matcher could mistake for plain attention (a softcap met after
the scale, a scale after the mask, a second additive mask, keys laid out another way, scores or
sink logits read elsewhere, a row max over the wrong axis, cross-attention, values alone from
another input), or one it must take (a `where` mask beside a padding mask, the softcap written
with a reciprocal, a -10000 fill, zero dropout in training). Whatever the passes decide, the compiled block equals the block outside a
session, and inside a lossless session it either raises before computing (refused) or equals one
full forward chunk by chunk.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models.blocks import _Projections
from kvtopo.passes.manager import run_passes


def _causal(t: int) -> torch.Tensor:
    """Additive causal mask [t, t]: -inf above the diagonal."""
    return torch.full((t, t), float("-inf")).triu(1)


class SoftcapThenScale(_Projections):
    """`cap * tanh(s / cap)` on the raw product, the scale after it: the op caps the scaled scores,
    which is another function (refused)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = 3.0 * torch.tanh(q @ self.repeat_kv(k).transpose(-1, -2) / 3.0) * 0.35
        return self.out(torch.softmax(scores + _causal(x.shape[1]), dim=-1) @ self.repeat_kv(v))


class ScaleAfterTheMask(_Projections):
    """`masked_fill(future, -1e4) * 1e-4`: scaled after the fill, the future keys get -1, not hidden."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        future = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        scores = (q @ self.repeat_kv(k).transpose(-1, -2)).masked_fill(future, -1e4) * 1e-4
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class SoftcapByReciprocal(_Projections):
    """Gemma-2's softcap with the division written as a product: `cap * tanh(s * (1 / cap))`."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35
        scores = torch.tanh(scores * (1 / 3.0)) * 3.0
        return self.out(torch.softmax(scores + _causal(x.shape[1]), dim=-1) @ self.repeat_kv(v))


class TwoAdditiveMasks(_Projections):
    """A causal mask and a padding mask added one after the other: the op takes one additive mask."""

    def forward(self, x, padding):
        q, k, v = self.qkv(x)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + _causal(x.shape[1])
        return self.out(torch.softmax(scores + padding, dim=-1) @ self.repeat_kv(v))


class CausalWhereThenPadding(_Projections):
    """GPT-2's older form, the causal mask built in the graph: `where(causal, scores, min)`, then an
    additive padding mask: one bool and one additive mask, folded into one for the op."""

    def forward(self, x, padding):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = torch.where(causal, q @ self.repeat_kv(k).transpose(-1, -2) * 0.35, torch.finfo(x.dtype).min)
        return self.out(torch.softmax(scores + padding, dim=-1) @ self.repeat_kv(v))


class EagerCrossAttention(_Projections):
    """Keys and values from a second input of the chunk's length: cross-attention, not cached."""

    def forward(self, x, memory):
        q, _, _ = self.qkv(x)
        _, k, v = self.qkv(memory)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + _causal(x.shape[1])
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class ValuesFromASecondInput(_Projections):
    """Queries and keys from the chunk, values from a second input: the values are not the
    chunk's own, so there is nothing to cache (refused like cross-attention)."""

    def forward(self, x, memory):
        q, k, _ = self.qkv(x)
        _, _, v = self.qkv(memory)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + _causal(x.shape[1])
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class _Square(_Projections):
    """4 heads of 4 dims, no GQA: called on 4 tokens, heads, tokens and dims are all 4, so a
    key tensor in another layout has the shape of [batch, heads, tokens, dim]."""

    def __init__(self):
        super().__init__(hidden=16, heads=4, kv_heads=4)

    def raw_key(self, x):
        b, t, _ = x.shape
        return self.k(x).view(b, t, self.heads, self.head_dim)  # [B, T, H, d], not yet transposed

    def attend(self, x, key_t):
        q, _, v = self.qkv(x)
        scores = q @ key_t * 0.5 + _causal(x.shape[1])
        return self.out(torch.softmax(scores, dim=-1) @ v)


class KeyPermutedFromTokensFirst(_Square):
    """`k.permute(0, 2, 3, 1)` of a [B, T, H, d] key is k^T, but its input is not [B, H, T, d]."""

    def forward(self, x):
        return self.attend(x, self.raw_key(x).permute(0, 2, 3, 1))


class KeyTransposedOnOtherAxes(_Square):
    """`k.transpose(1, 3)` of a [B, T, H, d] key: a product, but not q against k^T."""

    def forward(self, x):
        return self.attend(x, self.raw_key(x).transpose(1, 3))


class ScoresAlsoReadElsewhere(_Projections):
    """The scaled scores feed the softmax and a second output."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35
        probs = torch.softmax(scores + _causal(x.shape[1]), dim=-1)
        return self.out(probs @ self.repeat_kv(v)) + scores.mean(-1, keepdim=True).mean(1)


class _Sinks(_Projections):
    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1.0, 2.0, self.heads))

    def joined(self, x):
        q, k, v = self.qkv(x)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + _causal(x.shape[1])
        column = self.sinks.reshape(1, -1, 1, 1).expand(x.shape[0], -1, x.shape[1], -1)
        return torch.cat([scores, column], dim=-1), v


class SinkLogitsAlsoReadElsewhere(_Sinks):
    """The joined [scores ; sink] logits feed the softmax and a second output."""

    def forward(self, x):
        combined, v = self.joined(x)
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        finite = combined.clamp(min=-1e4)
        return self.out(probs @ self.repeat_kv(v)) + finite.mean(-1, keepdim=True).mean(1)


class RowMaxOverQueries(_Sinks):
    """`combined - combined.max(-2)`: a max per key column, not per row, which the softmax does not
    cancel."""

    def forward(self, x):
        combined, v = self.joined(x)
        combined = combined - combined.max(dim=-2, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        return self.out(probs @ self.repeat_kv(v))


class DropoutAtItsDefault(_Projections):
    """`F.dropout(p, 0.1)`: `training` defaults to True, so it drops even in eval mode."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + _causal(x.shape[1])
        return self.out(F.dropout(torch.softmax(scores, dim=-1), 0.1) @ self.repeat_kv(v))


class FilledWithMinus10000(_Projections):
    """Older HF code's mask value, `masked_fill(future, -10000.0)`: at the floor a fill still hides a key."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        future = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        scores = (q @ self.repeat_kv(k).transpose(-1, -2) * 0.35).masked_fill(future, -10000.0)
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class ZeroDropoutInTraining(_Projections):
    """HF's eager attention in train mode with attention_dropout=0: `dropout(p, p=0.0, training=True)`
    is the identity."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + _causal(x.shape[1])
        return self.out(F.dropout(torch.softmax(scores, dim=-1), p=0.0, training=True) @ self.repeat_kv(v))


def _padding(b: int, t: int) -> torch.Tensor:
    """Additive mask [b, 1, 1, t]: the first sequence hides its second key from every query."""
    mask = torch.zeros(b, 1, 1, t)
    mask[0, ..., 1] = float("-inf")
    return mask


# (block, inputs of its full forward, chunk cuts, refusal reason or None for a rewritten site)
CASES = [
    (SoftcapThenScale, lambda: (torch.randn(2, 9, 32) * 4,), (4, 5), "scores pass through tanh"),
    (ScaleAfterTheMask, lambda: (torch.randn(2, 9, 32),), (4, 5), "the scale is applied after the mask"),
    (TwoAdditiveMasks, lambda: (torch.randn(2, 9, 32), _padding(2, 9)), None, "2 masks (additive, additive)"),
    (CausalWhereThenPadding, lambda: (torch.randn(2, 9, 32), _padding(2, 9)), None, None),
    (EagerCrossAttention, lambda: (torch.randn(2, 9, 32), torch.randn(2, 9, 32)), None, "cross-attention"),
    (ValuesFromASecondInput, lambda: (torch.randn(2, 9, 32), torch.randn(2, 9, 32)), None, "cross-attention"),
    (KeyPermutedFromTokensFirst, lambda: (torch.randn(2, 4, 16),), None, "not a transposed key"),
    (KeyTransposedOnOtherAxes, lambda: (torch.randn(2, 4, 16),), None, "not a transposed key"),
    (ScoresAlsoReadElsewhere, lambda: (torch.randn(2, 9, 32),), (4, 5), "attention scores"),
    (SinkLogitsAlsoReadElsewhere, lambda: (torch.randn(2, 9, 32),), (4, 5), "also used elsewhere"),
    (RowMaxOverQueries, lambda: (torch.randn(2, 9, 32),), (4, 5), "not scores joined with a sink column"),
    (SoftcapByReciprocal, lambda: (torch.randn(2, 9, 32) * 4,), (4, 5), None),
    (FilledWithMinus10000, lambda: (torch.randn(2, 9, 32),), (4, 5), None),
    (ZeroDropoutInTraining, lambda: (torch.randn(2, 9, 32),), (4, 5), None),
]


@pytest.mark.parametrize("cls,inputs,cuts,reason", CASES, ids=[c[0].__name__ for c in CASES])
def test_refused_or_exact(cls, inputs, cuts, reason):
    torch.manual_seed(0)
    block = cls().eval()
    args = inputs()
    report = kvtopo.inspect(block, *args)
    if reason is None:
        assert len(report.sites) == 1 and not report.refusals, report.format()
    else:
        assert not report.sites and len(report.refusals) == 1 and reason in report.refusals[0].reason, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(*args)
        torch.testing.assert_close(compiled(*args), expected, atol=1e-5, rtol=0)
    if cuts is None:
        return
    x = args[0]
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=2)) as s:
        if reason is not None:
            with pytest.raises(RefusedAttention):
                compiled(x[:, :cuts[0]])
            assert s.stats().tokens == ()
        else:
            got = torch.cat([compiled(x[:, a:b]) for a, b in zip((0,) + cuts, cuts + (x.shape[1],))], 1)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_dropout_left_at_its_training_default_is_refused():
    """Taken as inference dropout, the compiled block would stop dropping what the block drops."""
    report = kvtopo.inspect(DropoutAtItsDefault().eval(), torch.randn(1, 6, 32))
    assert not report.sites and len(report.refusals) == 1
    assert "attention dropout p=0.1 training=True" in report.refusals[0].reason


class ScaleAttributeTimesConstant(_Projections):
    """`scores * 0.5 * self.scaling`: a second instance with another `scaling` makes Dynamo pass it
    as a Python float input, beside the constant factor."""

    def __init__(self, scaling):
        super().__init__()
        self.scaling = scaling

    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.5 * self.scaling
        return self.out(torch.softmax(scores + _causal(x.shape[1]), dim=-1) @ self.repeat_kv(v))


def test_a_float_input_scale_beside_a_constant_factor_is_refused():
    """The op takes a lone float input as its scale; with another factor the site is refused (not
    folded, nor a compile error) and the graph runs unchanged."""
    reports = []

    def backend(gm, example_inputs):
        reports.append(run_passes(gm))
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        for scaling in (0.7, 0.3):
            block = ScaleAttributeTimesConstant(scaling).eval()
            torch.testing.assert_close(torch.compile(block, backend=backend)(x), block(x), atol=1e-5, rtol=0)
    assert [s.scale for s in reports[0].sites] == [0.35] and not reports[0].refusals
    assert not reports[-1].sites and "together with another factor" in reports[-1].refusals[0].reason
    torch._dynamo.reset()
