"""A causal additive mask that goes through a chain of views, casts and sums before SDPA (as
HF's mask preparation does: expand to [b, 1, t, t], cast, clone, add a padding mask of zeros)
is still read as a mask: the site is rewritten, and token by token in a session the compiled
block equals the eager block."""

import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.models.blocks import _Projections


class ChainedCausalMask(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        b, t, _ = x.shape
        mask = torch.full((t, t), float("-inf")).triu(1)
        mask = mask[None, None].expand(b, 1, t, t).to(x.dtype).clone().contiguous()
        mask = mask + torch.zeros(b, 1, 1, t, dtype=x.dtype)  # no padding
        mask = torch.minimum(mask.float().reshape(b, 1, t, t), torch.zeros(1, dtype=x.dtype))
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


def test_a_long_chain_of_mask_operations_is_read_as_a_mask():
    torch.manual_seed(0)
    block = ChainedCausalMask().eval()
    x = torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert len(report.sites) == 1 and not report.refusals, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
        with kvtopo.session(kvtopo.Config.lossless()):
            got = torch.cat([compiled(x[:, :2])] + [compiled(x[:, i:i + 1]) for i in range(2, 7)], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
