"""A block whose SDPA mask is built in the graph from the token indices: the mask forms the
mask tests (test_unread_masks.py, test_window_forms.py) feed the passes."""

import torch
import torch.nn.functional as F

from kvtopo.models.blocks import _Projections


def token_indices(x):
    """The query and key indices of `x`'s tokens, [t, 1] and [1, t]."""
    idx = torch.arange(x.shape[1], device=x.device)
    return idx[:, None], idx[None, :]


class MaskedAttention(_Projections):
    """SDPA with the mask `build_mask(query indices, key indices)`."""

    def __init__(self, build_mask):
        super().__init__()
        self.build_mask = build_mask

    def forward(self, x):
        q, k, v = self.qkv(x)
        mask = self.build_mask(*token_indices(x))
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))
