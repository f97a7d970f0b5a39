"""Sliding windows, logit softcapping and masks a session cannot honour, on plain modules.

Each block is checked three ways: what the passes report (window, softcap, or a refusal with
its reason), the compiled block outside a session against the block itself, and incremental
chunks inside a lossless session against one full forward — or a clear error instead.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.models.blocks import _Projections

WINDOW = 5


def _band(t: int, window: int, device=None) -> torch.Tensor:
    """True where query i may see key j: i - window < j <= i."""
    ones = torch.ones(t, t, dtype=torch.bool, device=device)
    return ones.tril() & ones.triu(-(window - 1))


class SDPABandInGraph(_Projections):
    """The window built inside forward with tril/triu, so the passes can read it."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        mask = _band(x.shape[1], WINDOW, x.device)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class SDPABandComparison(_Projections):
    """The window as HF writes it: kv > q - window, and kv <= q."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        idx = torch.arange(x.shape[1], device=x.device)
        mask = (idx[None, :] > idx[:, None] - WINDOW) & (idx[None, :] <= idx[:, None])
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class SDPAMaskArgument(_Projections):
    """A mask handed in by the caller: the graph cannot show what it means."""

    def forward(self, x, mask):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


class SDPABidirectional(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


class EagerSoftcap(_Projections):
    """Gemma-2's eager attention: scale, cap * tanh(scores / cap), additive causal mask."""

    cap = 3.0

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = torch.matmul(q, self.repeat_kv(k).transpose(2, 3)) * (1 / math.sqrt(self.head_dim))
        scores = torch.tanh(scores / self.cap) * self.cap
        scores = scores + torch.full((t, t), float("-inf"), device=x.device).triu(1)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.out(torch.matmul(probs, self.repeat_kv(v)))


class EagerSoftcapAroundMask(_Projections):
    """The mask added inside the tanh: -inf becomes -cap, so it no longer masks."""

    cap = 3.0

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = torch.matmul(q, self.repeat_kv(k).transpose(2, 3)) * (1 / math.sqrt(self.head_dim))
        scores = scores + torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = torch.tanh(scores / self.cap) * self.cap
        return self.out(torch.matmul(F.softmax(scores, dim=-1), self.repeat_kv(v)))


def _compiled(block):
    return torch.compile(block, backend="kvtopo", options={"inductor": False})


def _chunks_in_session(compiled, x, cuts, page_size=2):
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=page_size)) as s:
        outs = [compiled(x[:, a:b]) for a, b in zip((0,) + cuts, cuts + (x.shape[1],))]
        return torch.cat(outs, 1), s.stats()


@pytest.mark.parametrize("block_cls", [SDPABandInGraph, SDPABandComparison])
def test_window_is_read_from_the_graph_and_honoured(block_cls):
    block = block_cls().eval()
    x = torch.randn(2, 17, 32)
    report = kvtopo.inspect(block, x[:, :3])  # a chunk shorter than the window: the band is invisible in values
    assert [s.window for s in report.sites] == [WINDOW] and not report.refusals
    with torch.no_grad():
        expected = block(x)
        torch.testing.assert_close(_compiled(block)(x), expected, atol=1e-5, rtol=0)
    # decode steps far past the window: only the band may be attended
    got, stats = _chunks_in_session(_compiled(block), x, (3, 4, 9, 10, 11, 12))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert all(WINDOW - 1 <= held[0] <= WINDOW + 2 for held in stats.held_tokens.values())


def test_a_band_the_graph_does_not_show_raises_in_a_session():
    block = SDPAMaskArgument().eval()
    compiled = _compiled(block)
    x = torch.randn(1, 12, 32)
    assert not kvtopo.inspect(block, x, _band(12, WINDOW)).refusals  # a mask input may be causal
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match="hides key .* which a causal mask"):
            compiled(x, _band(12, WINDOW))
        assert s.stats().tokens == ()  # nothing stored
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        with pytest.raises(ValueError, match="shows key"):
            compiled(x, torch.ones(12, 12, dtype=torch.bool))  # bidirectional


def test_a_causal_mask_argument_is_honoured():
    block = SDPAMaskArgument().eval()
    compiled = _compiled(block)
    x = torch.randn(1, 12, 32)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        got = torch.cat([compiled(x[:, :7], _band(7, 99)), compiled(x[:, 7:], _band(5, 99))], 1)
    torch.testing.assert_close(got, block(x, _band(12, 99)).detach(), atol=1e-5, rtol=0)


def test_bidirectional_attention_is_refused_at_compile_time():
    block = SDPABidirectional().eval()
    report = kvtopo.inspect(block, torch.randn(1, 6, 32))
    assert not report.sites and "bidirectional" in report.refusals[0].reason


def test_softcap_is_recognised_and_applied():
    block = EagerSoftcap().eval()
    x = torch.randn(2, 13, 32) * 4  # large logits, so the cap changes the result
    report = kvtopo.inspect(block, x)
    assert [s.softcap for s in report.sites] == [EagerSoftcap.cap] and not report.refusals
    with torch.no_grad():
        expected = block(x)
        uncapped = EagerSoftcap().eval()
        uncapped.cap = 1e9
        assert (uncapped(x) - expected).abs().max() > 1e-2  # the cap matters for this input
        torch.testing.assert_close(_compiled(block)(x), expected, atol=1e-5, rtol=0)
    got, _ = _chunks_in_session(_compiled(block), x, (5, 6, 7))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_softcap_around_the_mask_is_refused():
    report = kvtopo.inspect(EagerSoftcapAroundMask().eval(), torch.randn(1, 6, 32))
    assert not report.sites and "inside the logit softcap" in report.refusals[0].reason


def test_softcap_in_the_compressed_domain_equals_explicit_attention():
    """Session attention over Recent and Mid (projected, quantized) pages applies the cap to the
    compressed-domain logits exactly as to explicit keys (float64 check over the same codes)."""
    from kvtopo.kernels.compressed_attention import merge_partials, partial_dense, partial_lowrank, stack_heads
    from kvtopo.kernels.directions import principal_basis

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 3, 8, generator=gen) * 3
    keys = torch.randn(2, 20, 8, generator=gen)
    values = torch.randn(2, 20, 8, generator=gen)
    bases_k = [principal_basis(keys[h], 0.8) for h in range(2)]
    bases_v = [principal_basis(values[h], 0.8) for h in range(2)]
    ck = [(keys[h] - b.mean) @ b.vectors for h, b in enumerate(bases_k)]
    cv = [(values[h] - b.mean) @ b.vectors for h, b in enumerate(bases_v)]
    low_k, low_v = stack_heads(ck, bases_k), stack_heads(cv, bases_v)
    exact_k, exact_v = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    cap, scale = 2.0, 0.5
    got = merge_partials([partial_lowrank(q, low_k, low_v, scale, softcap=cap),
                          partial_dense(q, exact_k, exact_v, scale, softcap=cap)])
    # explicit: decompress, cap, softmax in float64
    k_full = torch.cat([low_k.coefficients @ low_k.vectors.transpose(1, 2) + low_k.mean[:, None], exact_k], 1).double()
    v_full = torch.cat([low_v.coefficients @ low_v.vectors.transpose(1, 2) + low_v.mean[:, None], exact_v], 1).double()
    logits = scale * q.double().reshape(2, 2, 3, 8) @ k_full[:, None].transpose(-1, -2)
    probs = torch.softmax(cap * torch.tanh(logits / cap), -1)
    expected = (probs @ v_full[:, None]).reshape(4, 3, 8)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
