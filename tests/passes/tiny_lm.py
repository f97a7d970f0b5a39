"""A one-layer language model for the position tests: token embedding, 4 heads of 8 dims, causal
SDPA, the output head; each test adds its positions its own way (rotary angles, a table)."""

import torch
import torch.nn.functional as F


def rotary(angles):
    """cos and sin [t, 8] of rotary `angles` [t, 4] (each angle for a pair of columns 4 apart)."""
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 256)

    def attend(self, x, cos=None, sin=None, query_scale=None):
        """The logits of `x` [1, t, 32] through causal attention, q and k rotated by `cos`/`sin` and
        q then scaled by `query_scale`, when given."""
        t = x.shape[1]
        q, k, v = (z.view(1, t, 4, 8).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        if cos is not None:
            q, k = (z * cos + torch.cat([-z[..., 4:], z[..., :4]], -1) * sin for z in (q, k))
        if query_scale is not None:
            q = q * query_scale
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(1, t, 32))
