"""Hand-written attention blocks the passes must find, and ones they must refuse (with the reason)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtopo
from kvtopo.models.blocks import BLOCKS, GPT2Legacy, _Projections
from kvtopo.passes.manager import run_passes


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_is_rewritten_and_equal(name):
    block = BLOCKS[name]().eval()
    x = torch.randn(2, 10, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals
    # GQA's repeat walked back, however it is spelled (`x[:, :, None]` too): kv-heads stored once
    assert (report.sites[0].heads, report.sites[0].kv_heads) == (block.heads, block.kv_heads)
    with torch.no_grad():
        expected = block(x)
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_decodes_incrementally_in_a_session(name):
    """Chunks fed through a session give the same outputs as one full causal forward."""
    block = BLOCKS[name]().eval()
    x = torch.randn(2, 11, 32)
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=3)) as s:
        parts = [compiled(x[:, :4]), compiled(x[:, 4:5]), compiled(x[:, 5:])]
        assert s.stats().tokens == (11, 11)
    torch.testing.assert_close(torch.cat(parts, 1), block(x).detach(), atol=1e-5, rtol=0)


def _future(t: int) -> torch.Tensor:
    """[t, t] True where a key lies after its query: what a causal mask hides."""
    return torch.ones(t, t, dtype=torch.bool).triu(1)


class CrossAttention(_Projections):
    def forward(self, x, memory):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k = self.k(memory).view(b, memory.shape[1], 2, 8).transpose(1, 2)
        v = self.v(memory).view(b, memory.shape[1], 2, 8).transpose(1, 2)
        return self.out(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


class SoftmaxOverQueries(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        probs = torch.softmax(q @ self.repeat_kv(k).transpose(-1, -2) * 0.35, dim=-2)
        return self.out(probs @ self.repeat_kv(v))


class HeadMaskAfterSoftmax(_Projections):
    def __init__(self):
        super().__init__()
        self.head_gate = nn.Parameter(torch.rand(1, 4, 1, 1))

    def forward(self, x):
        q, k, v = self.qkv(x)
        probs = torch.softmax(q @ self.repeat_kv(k).transpose(-1, -2) * 0.35, dim=-1)
        return self.out((probs * self.head_gate) @ self.repeat_kv(v))


class ZeroFilledMask(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        keep = torch.ones(t, t, dtype=torch.bool).tril()
        scores = torch.where(keep, q @ self.repeat_kv(k).transpose(-1, -2) * 0.35, 0.0)
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class ReturnsProbabilities(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        probs = torch.softmax(q @ self.repeat_kv(k).transpose(-1, -2) * 0.35, dim=-1)
        return self.out(probs @ self.repeat_kv(v)), probs


class TensorTimesScores(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        slopes = torch.linspace(0.5, 1.0, t)
        probs = torch.softmax((q @ self.repeat_kv(k).transpose(-1, -2)) * slopes, dim=-1)
        return self.out(probs @ self.repeat_kv(v))


class AlibiBias(_Projections):
    """Eager attention plus ALiBi's bias (a head's slope times the key's distance back), then the
    causal fill: the bias is 0 on a token's own key, so a one-token chunk could not show it."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        distance = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        bias = torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None] * distance.float()
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + bias
        scores = scores.masked_fill(_future(t), float("-inf"))
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class SDPAAlibiBias(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        distance = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        bias = (torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None] * distance.float()).masked_fill(
            _future(t), float("-inf"))
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=bias))


class ConstantOverScores(_Projections):
    """`c / scores` is not a scale of the scores."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = 2.0 / (q @ self.repeat_kv(k).transpose(-1, -2))
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class FloorDividedScores(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        scores = torch.div(q @ self.repeat_kv(k).transpose(-1, -2), 0.25, rounding_mode="floor")
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class IntegerDistanceBias(_Projections):
    """ALiBi with slope 1 kept in integers: an integer tensor added to the scores is a bias, not a mask."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        distance = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * 0.35 + distance
        scores = scores.masked_fill(_future(t), float("-inf"))
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class SoftmaxWrittenOut(_Projections):
    """exp / sum in place of softmax: no pass reads it, so the product is refused by its shape."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2) * 0.35).masked_fill(
            _future(t), float("-inf"))
        weights = torch.exp(scores - scores.amax(-1, keepdim=True))
        return self.out(weights / weights.sum(-1, keepdim=True) @ self.repeat_kv(v))


class ScoresSummedFromABroadcast(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q.unsqueeze(-2) * self.repeat_kv(k).unsqueeze(-3)).sum(-1) * 0.35
        scores = scores.masked_fill(_future(t), float("-inf"))
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class CheckpointedAttention(_Projections):
    """SDPA inside torch.utils.checkpoint: a higher-order op's subgraph, which no pass walks."""

    def forward(self, x):
        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), is_causal=True)

        return self.out(torch.utils.checkpoint.checkpoint(attend, *self.qkv(x), use_reentrant=False))


class InPlaceScaleOfScoresReadElsewhere(_Projections):
    """`scores /= c` where the unscaled product is also kept: the in-place op changes what the other reader sees."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = q @ self.repeat_kv(k).transpose(-1, -2)
        raw = scores.view(scores.shape)
        scores /= 3.0
        probs = torch.softmax(scores.masked_fill(_future(t), float("-inf")), dim=-1)
        return self.out(probs @ self.repeat_kv(v)) + raw.sum()


class TrainingDropout(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), dropout_p=0.1))


class SoftcapOtherDivisor(_Projections):
    """`30 * tanh(scores / 50)`: a tanh with a cap other than its divisor is no softcap the op applies."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = 30.0 * torch.tanh(q @ self.repeat_kv(k).transpose(-1, -2) / 50.0)
        scores = scores.masked_fill(_future(t), float("-inf"))
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class SoftFill(_Projections):
    """`masked_fill(future, -100)` lowers the future keys' scores without hiding them: a bias."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2) * 0.35).masked_fill(
            _future(t), -100.0)
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


class EagerTrainingDropout(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2) * 0.35).masked_fill(
            _future(t), float("-inf"))
        probs = F.dropout(torch.softmax(scores, dim=-1), 0.1, training=True)
        return self.out(probs @ self.repeat_kv(v))


REFUSED = [
    (CrossAttention, "cross-attention"),
    (SoftmaxOverQueries, "not the key axis"),
    (HeadMaskAfterSoftmax, "combined with"),
    (ZeroFilledMask, "not a mask"),
    (ReturnsProbabilities, "used elsewhere"),
    (TensorTimesScores, "multiplied by a tensor"),
    (TrainingDropout, "dropout"),
    (EagerTrainingDropout, "attention dropout p=0.1 training=True"),
    (SoftcapOtherDivisor, "not as `cap * tanh(scores / cap)`"),
    (SoftFill, "fills the scores with -100.0, not a large negative value"),
    (AlibiBias, "not built from a mask"),
    (SDPAAlibiBias, "not built from a mask"),
    (IntegerDistanceBias, "not built from a mask"),
    (ConstantOverScores, "the divisor"),
    (FloorDividedScores, "rounding_mode='floor'"),
    (InPlaceScaleOfScoresReadElsewhere, "scores scaled in place"),
    (SoftmaxWrittenOut, "reaches no softmax"),
    (ScoresSummedFromABroadcast, "reaches no softmax"),
    (CheckpointedAttention, "scaled_dot_product_attention inside the subgraph of higher-order op"),
    (GPT2Legacy, "a tensor of the model"),
]


@pytest.mark.parametrize("cls,reason", REFUSED, ids=[c.__name__ for c, _ in REFUSED])
def test_refused_pattern_leaves_graph_unchanged(cls, reason):
    block = cls().eval()
    args = (torch.randn(1, 6, 32), torch.randn(1, 9, 32)) if cls is CrossAttention else (torch.randn(1, 6, 32),)
    graphs = []

    def check(gm, example_inputs):
        before = [(n.op, n.target, n.args) for n in gm.graph.nodes]
        report = run_passes(gm)
        assert [(n.op, n.target, n.args) for n in gm.graph.nodes] == before
        graphs.append(report)
        return gm.forward

    with torch.no_grad():
        torch.compile(block, backend=check)(*args)
    refusals = [r for rep in graphs for r in rep.refusals]
    assert not any(rep.sites for rep in graphs)
    assert len(refusals) == 1 and reason in refusals[0].reason, refusals


def test_falcon_eager_attention_scaled_in_place_gives_the_uncompiled_tokens():
    """transformers' Falcon (rotary positions, eager) divides its scores in place (`scores /= sqrt(d)`)."""
    import copy

    import transformers

    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, alibi=False, bias=False, initializer_range=0.3, attn_implementation="eager")
    model = transformers.FalconForCausalLM(config).eval()
    uncompiled = copy.deepcopy(model)
    ids = torch.randint(0, 128, (1, 37))
    expected = uncompiled.generate(ids, max_new_tokens=20, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with kvtopo.session(kvtopo.Config.lossless(page_size=8, prefill_chunk_size=16)) as session:
        got = kvtopo.generate(model, ids, max_new_tokens=20)
        assert session.stats().tokens == (got.shape[1] - 1,)  # every token but the last was stored
    assert len(set(expected[0, 37:].tolist())) > 5  # a model whose tokens vary, so agreement means something
    assert torch.equal(got, expected)


class TiledRepeat(_Projections):
    """GQA repeat with the copies outermost (`k[:, None].expand(B, n, Hkv, S, d)`): query head h reads
    kv head h % Hkv, not HF's h // n. Written three ways that put the new axis at dim 1."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def tile(self, t):
        n = self.heads // self.kv_heads
        b, h, s, d = t.shape
        new_axis = {"[:, None]": lambda: t[:, None], "[:, None, :, :, :]": lambda: t[:, None, :, :, :],
                    "unsqueeze(1)": lambda: t.unsqueeze(1)}[self.spelling]()
        return new_axis.expand(b, n, h, s, d).reshape(b, n * h, s, d)

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, self.tile(k), self.tile(v), is_causal=True))


@pytest.mark.parametrize("spelling", ["[:, None]", "[:, None, :, :, :]", "unsqueeze(1)"])
def test_kv_heads_tiled_rather_than_repeated_are_not_taken_for_hf_repeat_kv(spelling):
    """Walked back as HF's repeat_kv, query head 1 would read kv head 0 instead of 1. The tiled
    tensor is attended as it is, 4 heads of keys, compiled and chunk by chunk in a session."""
    block = TiledRepeat(spelling).eval()
    x = torch.randn(2, 9, 32)
    report = kvtopo.inspect(block, x)
    assert [(s.heads, s.kv_heads) for s in report.sites] == [(4, 4)] and not report.refusals
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
        torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=0)
        with kvtopo.session(kvtopo.Config.lossless(page_size=4)):
            parts = [compiled(x[:, :5]), compiled(x[:, 5:])]
    torch.testing.assert_close(torch.cat(parts, 1), expected, atol=1e-5, rtol=0)


class NarrowValues(nn.Module):
    """Queries and keys of 16 dims, values of 8, SDPA without `scale=`: its default is 1/sqrt(16),
    the query's head dim."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(32, 4 * 16, bias=False), nn.Linear(32, 2 * 16, bias=False), \
            nn.Linear(32, 2 * 8, bias=False)
        self.o = nn.Linear(4 * 8, 32, bias=False)

    def heads(self, x):
        b, t, _ = x.shape
        return (self.q(x).view(b, t, 4, 16).transpose(1, 2), self.k(x).view(b, t, 2, 16).transpose(1, 2),
                self.v(x).view(b, t, 2, 8).transpose(1, 2))

    def forward(self, x):
        q, k, v = self.heads(x)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(attn.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


def test_sdpa_default_scale_follows_the_query_head_dim_when_values_are_narrower():
    block = NarrowValues().eval()
    x = torch.randn(2, 7, 32)
    report = kvtopo.inspect(block, x)
    assert [(s.head_dim, s.value_head_dim, s.scale) for s in report.sites] == [(16, 8, 0.25)]
    with torch.no_grad():
        q, k, v = (t.double() for t in block.heads(x))
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # enable_gqa: query head h reads kv head h // 2
        scores = (q @ k.transpose(-1, -2) / 4.0).masked_fill(_future(7), float("-inf"))
        reference = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(2, 7, -1) @ block.o.weight.double().T
        expected = block(x)
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
    torch.testing.assert_close(expected.double(), reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


class ScaledTwice(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = (q @ self.repeat_kv(k).transpose(-1, -2)) / 4.0 * 0.5
        scores = scores.masked_fill(_future(t), float("-inf"))
        return self.out(torch.softmax(scores, dim=-1) @ self.repeat_kv(v))


def test_scale_factors_written_one_after_another_multiply():
    """`/ 4 * 0.5` is one scale of 0.125 (the default for these heads would be 1/sqrt(8))."""
    block = ScaledTwice().eval()
    x = torch.randn(2, 7, 32)
    report = kvtopo.inspect(block, x)
    assert [s.scale for s in report.sites] == [0.125]
    with torch.no_grad():
        expected = block(x)
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
