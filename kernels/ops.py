"""The `kvtopo` custom ops, registered with torch.library.

`kvtopo::attention` is what the passes put in place of every attention site. It is opaque to
Dynamo/Inductor (a fake impl gives shapes), so the same compiled graph serves both modes:
outside a session it is exactly the original attention over the given k/v; inside a session it
hands the step's new k/v to that layer's KV store and attends over the stored history.
"""

from __future__ import annotations

import torch

from kvtopo.runtime.context import active_session

from .reference import attention_decomposition, grouped_attention


@torch.library.custom_op("kvtopo::attention", mutates_args=())
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    layer: str,
) -> torch.Tensor:
    """query [B, Hq, T, d]; key/value [B, Hkv, S, d|dv] (kv-heads, not repeated) -> [B, Hq, T, dv]."""
    session = active_session()
    if session is None:
        return grouped_attention(query, key, value, attn_mask, scale, is_causal)
    return session.attend(layer, query, key, value, attn_mask, scale)


@attention.register_fake
def _attention_fake(query, key, value, attn_mask, scale, is_causal, layer):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


def _attention_decomposition(query, key, value, attn_mask, scale, is_causal, layer):
    return attention_decomposition(query, key, value, attn_mask, scale, is_causal)


# For `ExportedProgram.run_decompositions(DECOMPOSITIONS)`: the op in plain aten ops, cache-free.
DECOMPOSITIONS = {torch.ops.kvtopo.attention.default: _attention_decomposition}
