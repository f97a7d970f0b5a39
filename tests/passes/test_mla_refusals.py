"""MLA-shaped blocks that `kvtopo::mla_attention` would compute otherwise than the model: the MLA
pass refuses each with its reason, the compiled block stays the block outside a session, and a
session raises instead of attending over the chunk alone."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.passes.find_mla import find_mla_sites

WINDOW = 3


class _MLABlock(torch.nn.Module):
    """DeepSeek's MLA as HF writes it (see test_mla.py), but with one change, `how`: an up-projection
    with a bias, a no-RoPE key scaled after the split, a RoPE key scaled as it is copied in (not an
    expand of one shared key), a latent without its head axis, or a sliding window mask."""

    def __init__(self, how, heads=2, latent=8, nope=4, rope=4, v=4):
        super().__init__()
        torch.manual_seed(0)
        self.how, self.h, self.nope, self.rope, self.v = how, heads, nope, rope, v
        self.embed = torch.nn.Linear(16, 16)
        self.q = torch.nn.Linear(16, heads * (nope + rope), bias=False)
        self.kv_a = torch.nn.Linear(16, latent + rope, bias=False)
        self.kv_b = torch.nn.Linear(latent, heads * (nope + v), bias=how == "bias")

    def forward(self, x):
        b, t, _ = x.shape
        x = self.embed(x)
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        latent, k_rope = torch.split(self.kv_a(x), [self.kv_b.in_features, self.rope], dim=-1)
        latent, k_rope = latent.view(b, 1, t, -1) if self.how != "flat latent" else latent, k_rope.view(b, 1, t, -1)
        kv = self.kv_b(latent).view(b, t, -1, self.nope + self.v).transpose(1, 2)
        k_nope, value = torch.split(kv, [self.nope, self.v], dim=-1)
        if self.how == "scaled nope":
            k_nope = k_nope * 2.0
        key = kv.new_empty(b, self.h, t, self.nope + self.rope)
        key[..., : self.nope].copy_(k_nope)
        key[..., self.nope:].copy_(k_rope * 2.0 if self.how == "scaled rope" else k_rope.expand(-1, self.h, -1, -1))
        if self.how == "window":
            idx = torch.arange(t, device=x.device)
            mask = (idx[None, :] <= idx[:, None]) & (idx[None, :] > idx[:, None] - WINDOW)
            return F.scaled_dot_product_attention(q, key, value, attn_mask=mask)
        out = F.scaled_dot_product_attention(q, key, value, is_causal=True)
        return out + key.mean(dim=-1, keepdim=True) if self.how == "key read elsewhere" else out


REASONS = {
    "bias": "not a bias-free linear",
    "scaled nope": "not the first split of the up-projection",
    "scaled rope": "not one shared key expanded over heads",
    "flat latent": "the latent is not one shared",
    "window": "sliding window",
    "key read elsewhere": "not only by the attention",
}


@pytest.mark.parametrize("how", sorted(REASONS))
def test_mla_the_latent_op_cannot_compute_is_refused(how):
    """Taken for MLA, the bias or the scale would be dropped (the op rebuilds the keys from the
    latent and kv_b's weight) or the window ignored: silently wrong, in a session or not."""
    x = torch.randn(1, 10, 16)
    found = []

    def check(gm, example_inputs):
        found.append(find_mla_sites(gm))
        return gm.forward

    block = _MLABlock(how).eval()
    with torch.no_grad():
        torch.compile(block, backend=check)(x[:, :4])
        expected = block(x)
    (sites, refusals), = found
    assert not sites and len(refusals) == 1 and REASONS[how] in refusals[0].reason, refusals
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=0)
        with kvtopo.session(kvtopo.Config.lossless()) as s, pytest.raises(RefusedAttention, match=REASONS[how]):
            compiled(x[:, :4])
        assert s.stats().tokens == ()
