"""An SDPA call given both an attn_mask and is_causal=True (PyTorch's CPU kernels accept it) is
refused by name: which of the two the model means is not the pass's to guess. The compiled
block stays the eager block outside a session, and a session raises instead of attending."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models.blocks import _Projections


class MaskAndCausal(_Projections):
    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        window = torch.ones(t, t, dtype=torch.bool).tril().triu(-2)  # the token and the 2 before it
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=window,
                                                       is_causal=True))


def test_a_mask_together_with_is_causal_is_refused():
    torch.manual_seed(0)
    block = MaskAndCausal().eval()
    x = torch.randn(1, 7, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and len(report.refusals) == 1, report.format()
    assert "both attn_mask and is_causal" in report.refusals[0].reason
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=0)
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            with pytest.raises(RefusedAttention):
                compiled(x)
            assert s.stats().tokens == ()
