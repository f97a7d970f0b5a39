"""Attention sinks (gpt-oss): a learned logit per query head joins every row's softmax and its
probability column is dropped before the value matmul.

Checked on plain blocks: what the passes report (the sink parameter, or a refusal with its
reason), the compiled block outside a session and in chunks inside a lossless session against
the block itself, and session attention over compressed (Recent, Mid) pages against explicit
float64 attention with sinks over the same codes.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtopo
from kvtopo.kernels.compressed_attention import LowRankHeads
from kvtopo.models.blocks import _Projections


class EagerSinks(_Projections):
    """gpt-oss's eager attention: scaled scores + causal mask, joined with the per-head sinks,
    less the row max, softmax, the sink column dropped."""

    def __init__(self, seed: int = 0):
        super().__init__(seed=seed)
        self.sinks = nn.Parameter(torch.linspace(-1.0, 2.0, self.heads))

    def scores(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = torch.matmul(q, self.repeat_kv(k).transpose(2, 3)) * (1 / math.sqrt(self.head_dim))
        return q, scores + torch.full((t, t), torch.finfo(x.dtype).min, device=x.device).triu(1), v

    def sink_column(self, q):
        return self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)

    def forward(self, x):
        q, scores, v = self.scores(x)
        combined = torch.cat([scores, self.sink_column(q)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        probs = F.dropout(probs[..., :-1], p=0.0, training=False).to(v.dtype)
        return self.out(torch.matmul(probs, self.repeat_kv(v)))


class EagerSinksFirst(EagerSinks):
    """The sink column first, no row max subtracted, dropped with `[..., 1:]`."""

    def forward(self, x):
        q, scores, v = self.scores(x)
        probs = torch.softmax(torch.cat([self.sink_column(q), scores], dim=-1), dim=-1)[..., 1:]
        return self.out(torch.matmul(probs, self.repeat_kv(v)))


class SinksFromActivations(EagerSinks):
    """Refused: the 'sink' logit is computed from the queries, not a parameter."""

    def sink_column(self, q):
        return q.mean(-1, keepdim=True)


class SinksDroppedFromTheWrongEnd(EagerSinks):
    """Refused: the sink is appended last but the first (a real key's) column is dropped."""

    def forward(self, x):
        q, scores, v = self.scores(x)
        probs = torch.softmax(torch.cat([scores, self.sink_column(q)], dim=-1), dim=-1)[..., 1:]
        return self.out(torch.matmul(probs, self.repeat_kv(v)))


class SinksPerKvHead(EagerSinks):
    """Refused: one sink per kv-head, repeated to the query heads (not a [Hq] parameter)."""

    def __init__(self):
        super().__init__()
        self.sinks = nn.Parameter(torch.linspace(-1.0, 2.0, self.kv_heads))

    def sink_column(self, q):
        per_kv = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        return per_kv.repeat_interleave(self.heads // self.kv_heads, dim=1)


def _compiled(block):
    return torch.compile(block, backend="kvtopo", options={"inductor": False})


def _chunks_in_session(compiled, x, cuts, page_size=2):
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=page_size)):
        return torch.cat([compiled(x[:, a:b]) for a, b in zip((0,) + cuts, cuts + (x.shape[1],))], 1)


@pytest.mark.parametrize("block_cls", [EagerSinks, EagerSinksFirst])
def test_sinks_are_recognised_and_applied(block_cls):
    torch._dynamo.reset()
    block = block_cls().eval()
    x = torch.randn(2, 13, 32)
    report = kvtopo.inspect(block, x)
    assert not report.refusals and len(report.sites) == 1
    site = report.sites[0]
    assert site.sinks is not None and site.sinks.op == "placeholder" and site.describe().endswith("sinks")
    with torch.no_grad():
        expected = block(x)
        without = block_cls().eval()
        without.sinks.data.fill_(-1e4)  # no mass goes to the sinks
        assert (without(x) - expected).abs().max() > 1e-3  # the sinks matter for this input
        torch.testing.assert_close(_compiled(block)(x), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(_chunks_in_session(_compiled(block), x, (5, 6, 7)), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block_cls,reason", [
    (SinksFromActivations, "not a per-head parameter"),
    (SinksDroppedFromTheWrongEnd, "not one sink logit per row"),
    (SinksPerKvHead, "repeat_interleave"),
])
def test_sinks_that_are_not_a_per_head_parameter_are_refused(block_cls, reason):
    torch._dynamo.reset()
    report = kvtopo.inspect(block_cls().eval(), torch.randn(1, 6, 32))
    assert not report.sites and len(report.refusals) == 1
    assert reason in report.refusals[0].reason, report.refusals[0].reason


def _explicit_with_sinks(q, keys, values, sinks, scale, history):
    """float64 softmax over [q·k ; sink] per row (causal over the chunk after `history` keys),
    the sink column dropped. q [Hq, T, d]; keys/values [Hkv, S, d]; sinks [Hq]."""
    groups = q.shape[0] // keys.shape[0]
    k, v = keys.double().repeat_interleave(groups, 0), values.double().repeat_interleave(groups, 0)
    logits = scale * q.double() @ k.transpose(1, 2)
    t, s = logits.shape[-2:]
    visible = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + history
    logits = logits.masked_fill(~visible, float("-inf"))
    combined = torch.cat([logits, sinks.double()[:, None, None].expand(-1, t, 1)], -1)
    return torch.softmax(combined, -1)[..., :-1] @ v


def _decompressed(seg):
    ks, vs = [seg.exact[0], seg.recent[0]], [seg.exact[1], seg.recent[1]]
    for mk, mv in seg.retired + (seg.mid,):
        ks.append(mk.coefficients @ mk.vectors.transpose(1, 2) + mk.mean[:, None])
        vs.append(mv.coefficients @ mv.vectors.transpose(1, 2) + mv.mean[:, None])
    return torch.cat(ks, 1), torch.cat(vs, 1)


@pytest.mark.parametrize("chunk", [1, 3])
def test_session_sinks_over_compressed_segments_equal_explicit_attention(chunk):
    """The sink is one more segment of the log-sum-exp merge (output 0, lse = the sink): with
    Recent (int8) and Mid (projected, 4-bit) pages held, session attention with sinks equals
    float64 attention with sinks over the keys/values those codes decompress to."""
    gen = torch.Generator().manual_seed(0)
    spectrum = torch.logspace(0, -2, 16)
    k = torch.randn(2, 100, 16, generator=gen) * spectrum
    v = torch.randn(2, 100, 16, generator=gen) * spectrum
    sinks = torch.tensor([0.5, -1.0, 1.5, 2.5])
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None, key_energy=0.95,
                           value_energy=0.95, mid_bits=4, recent_bits=8)
    q = torch.randn(1, 4, chunk, 16, generator=gen) * 3
    new_k, new_v = torch.randn(1, 2, chunk, 16, generator=gen), torch.randn(1, 2, chunk, 16, generator=gen)
    outs = {}
    for name, s_ in (("sinks", sinks), ("none", None)):
        with kvtopo.session(config) as s:
            s.attend("l", torch.randn(1, 4, 100, 16, generator=torch.Generator().manual_seed(1)), k[None], v[None],
                     None, 0.25, sinks=s_)
            seg = s.layers["l"].segments(0)
            assert seg.recent is not None and isinstance(seg.mid[0], LowRankHeads)
            stored_k, stored_v = _decompressed(seg)
            outs[name] = s.attend("l", q, new_k, new_v, None, 0.25, sinks=s_)[0]
    keys, values = torch.cat([stored_k, new_k[0]], 1), torch.cat([stored_v, new_v[0]], 1)
    expected = _explicit_with_sinks(q[0], keys, values, sinks, 0.25, stored_k.shape[1])
    torch.testing.assert_close(outs["sinks"].double(), expected, atol=1e-5, rtol=1e-5)
    assert (outs["sinks"] - outs["none"]).abs().max() > 1e-3


def test_op_with_sinks_outside_a_session_and_in_export():
    """Outside a session the op is exact attention with sinks; a fully masked row attends to the
    sink alone (zero output). The exported decode step refuses sinks."""
    from kvtopo.export.decode_step import kvtopo_cached_attention

    gen = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8,
                                                                                                       generator=gen)
    sinks = torch.tensor([0.0, 1.0, -2.0, 3.0])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[0, 0] = False
    got = torch.ops.kvtopo.attention(q, k, v, mask, 0.3, False, "l", None, None, None, sinks)
    groups = torch.arange(4) // 2
    logits = 0.3 * q[0].double() @ k[0, groups].double().transpose(1, 2)
    logits = logits.masked_fill(~mask, float("-inf"))
    combined = torch.cat([logits, sinks.double()[:, None, None].expand(-1, 5, 1)], -1)
    expected = torch.softmax(combined, -1)[..., :-1] @ v[0, groups].double()
    torch.testing.assert_close(got[0].double(), expected, atol=1e-5, rtol=0)
    assert got[0, :, 0].abs().max() == 0
    plain = torch.ops.kvtopo.attention(q, k, v, mask, 0.3, False, "l")
    assert (plain - got)[:, :, 1:].abs().max() > 1e-3
    with pytest.raises(NotImplementedError, match="sinks"):
        kvtopo_cached_attention(q, k, v, mask, 0.3, False, "l", None, None, None, sinks)
