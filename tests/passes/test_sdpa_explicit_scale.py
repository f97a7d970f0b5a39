"""An explicit `scale` given to `scaled_dot_product_attention` (here 0.2, not 1/sqrt(head_dim))
is the scale of the site the SDPA pass finds: the compiled block equals float64 causal
attention at that scale, outside a session and over a session's history."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.models.blocks import _Projections

SCALE = 0.2  # not 1/sqrt(head_dim) = 0.3536


class ExplicitScale(_Projections):
    """SDPA with a scale of its own (as Gemma's query_pre_attn_scalar gives)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True))


def _reference(block, x):
    """float64 causal GQA attention of the block at SCALE (query head j reads kv head j // 2)."""
    q, k, v = (t.double() for t in block.qkv(x))
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    t = x.shape[1]
    scores = (q @ k.transpose(-1, -2)) * SCALE
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.softmax(scores, -1) @ v
    return (attn.transpose(1, 2).reshape(x.shape[0], t, -1) @ block.o.weight.double().T).float()


def test_an_explicit_scale_is_the_sites_scale_in_and_out_of_a_session():
    torch.manual_seed(0)
    block = ExplicitScale().eval()
    x = torch.randn(1, 6, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals, report.format()
    assert report.sites[0].scale == pytest.approx(SCALE)
    expected = _reference(block, x)
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=0)
        with kvtopo.session(kvtopo.Config.lossless()):
            got = torch.cat([compiled(x[:, :4]), compiled(x[:, 4:5]), compiled(x[:, 5:])], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
