"""Keys and values expanded along a new axis and reshaped into the token axis
(`k[:, :, None].expand(b, h, 2, s, d).reshape(b, h, 2 * s, d)`: every key twice, as two copies
of the chunk) look like HF's repeat_kv but repeat tokens, not heads. They are not walked back as
a GQA repeat: the SDPA site holds 2t keys for t queries and is refused with that reason, and the
compiled block computes what the eager block computes."""

import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.models.blocks import _Projections


class TokensTiledWithMask(_Projections):
    def __init__(self):
        super().__init__(heads=4, kv_heads=4)

    def forward(self, x):
        q, k, v = self.qkv(x)

        def tile(t):
            b, h, s, d = t.shape
            return t[:, :, None].expand(b, h, 2, s, d).reshape(b, h, 2 * s, d)

        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = torch.cat([causal, causal], 1)  # each copy of the chunk causally
        return self.out(F.scaled_dot_product_attention(q, tile(k), tile(v), attn_mask=mask))


def test_keys_tiled_along_the_token_axis_are_refused_and_left_as_they_are():
    torch.manual_seed(0)
    block = TokensTiledWithMask().eval()
    x = torch.randn(1, 6, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and "12 keys for 6 queries" in report.refusals[0].reason, report.format()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=0)
