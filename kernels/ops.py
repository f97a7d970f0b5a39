"""The `kvtopo` custom ops, registered with torch.library.

`kvtopo::attention` is what the passes put in place of every attention site. It is opaque to
Dynamo/Inductor (a fake impl gives shapes), so the same compiled graph serves both modes:
outside a session it is exactly the original attention over the given k/v; inside a session (found
through kernels/store_hook.py) it hands the step's new k/v to that layer's KV store and attends over
the stored history.
"""

from __future__ import annotations

import torch

from .store_hook import active_store

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
    window: int | None = None,
    softcap: float | None = None,
    model_key: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, T, d]; key/value [B, Hkv, S, d|dv] (kv-heads, not repeated) -> [B, Hq, T, dv].

    `window`: the site's sliding window (query i sees keys i - window < j <= i); outside a session
    `attn_mask` already encodes it, inside one the store keeps and attends only that band.
    `softcap`: logits are `softcap * tanh(logits / softcap)` before the mask and softmax.
    `model_key`: a parameter of the calling model; a session keeps one store per model by it.
    `sinks`: [Hq] attention sinks (gpt-oss): a learned logit per query head joins every row's
    softmax and its column is dropped, so part of each row's mass goes to no value.
    """
    session = active_store()
    if session is None:
        return grouped_attention(query, key, value, attn_mask, scale, is_causal, softcap, sinks)
    return session.attend(layer, query, key, value, attn_mask, scale, is_causal=is_causal, window=window,
                          softcap=softcap, model_key=model_key, sinks=sinks)


@attention.register_fake
def _attention_fake(query, key, value, attn_mask, scale, is_causal, layer, window=None, softcap=None,
                    model_key=None, sinks=None):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("kvtopo::mla_attention", mutates_args=())
def mla_attention(
    query: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    kv_up_weight: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    layer: str,
    nope_dim: int,
    model_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-head latent attention computed in the latent space (DeepSeek-V2/V3).

    query [B, H, T, nope + rope]; latent [B, 1, T, r] (normalised); rope_key [B, 1, T, rope];
    kv_up_weight [H * (nope + v), r] (kv_b_proj) -> [B, H, T, v]. The up-projection is absorbed
    into the query (keys) and applied once to the attended latent (values), so per-head K/V are
    never formed and a session caches only [latent ; rope key] per token.
    """
    q_latent, keys, w_value = absorbed_mla_inputs(query, latent, rope_key, kv_up_weight, nope_dim)
    session = active_store()
    if session is None:
        out_latent = grouped_attention(q_latent, keys, latent, attn_mask, scale, is_causal)
    else:
        out_latent = session.attend(layer, q_latent, keys, latent, attn_mask, scale, is_causal=is_causal,
                                    shared_value_dim=latent.shape[-1], model_key=model_key)
    return latent_to_heads(out_latent, w_value).contiguous()


def absorbed_mla_inputs(query: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor,
                        kv_up_weight: torch.Tensor, nope_dim: int):
    """What `kvtopo::mla_attention` attends with: (absorbed queries [B, H, T, r + rope] =
    [q_nope · W_uk ; q_rope] per head, keys [B, 1, T, r + rope] = [latent ; rope key] (one shared
    "kv-head"), W_uv [H, v, r] to apply to the attended latent)."""
    heads, latent_dim = query.shape[1], latent.shape[-1]
    weight = kv_up_weight.view(heads, -1, latent_dim)
    w_key, w_value = weight[:, :nope_dim], weight[:, nope_dim:]
    q_nope, q_rope = query[..., :nope_dim], query[..., nope_dim:]
    q_latent = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_key), q_rope], dim=-1)
    return q_latent, torch.cat([latent, rope_key], dim=-1), w_value


def latent_to_heads(out_latent: torch.Tensor, w_value: torch.Tensor) -> torch.Tensor:
    """Attended latent [B, H, T, r] -> per-head values [B, H, T, v], the up-projection applied once."""
    return torch.einsum("bhtr,hvr->bhtv", out_latent, w_value)


@mla_attention.register_fake
def _mla_attention_fake(query, latent, rope_key, kv_up_weight, attn_mask, scale, is_causal, layer, nope_dim,
                        model_key=None):
    value_dim = kv_up_weight.shape[0] // query.shape[1] - nope_dim
    return query.new_empty(*query.shape[:-1], value_dim)


def _attention_decomposition(query, key, value, attn_mask, scale, is_causal, layer, window=None, softcap=None,
                             model_key=None, sinks=None):
    return attention_decomposition(query, key, value, attn_mask, scale, is_causal, softcap, sinks)


def _mla_attention_decomposition(query, latent, rope_key, kv_up_weight, attn_mask, scale, is_causal, layer, nope_dim,
                                 model_key=None):
    q_latent, keys, w_value = absorbed_mla_inputs(query, latent, rope_key, kv_up_weight, nope_dim)
    return latent_to_heads(attention_decomposition(q_latent, keys, latent, attn_mask, scale, is_causal), w_value)


# For `ExportedProgram.run_decompositions(DECOMPOSITIONS)`: the ops in plain aten ops, cache-free.
DECOMPOSITIONS = {
    torch.ops.kvtopo.attention.default: _attention_decomposition,
    torch.ops.kvtopo.mla_attention.default: _mla_attention_decomposition,
}

from . import effects  # noqa: E402,F401  (the ops append to the session store: registered effectful there)
from . import positions  # noqa: E402,F401  (kvtopo::positions: RoPE positions continued from the session store)
