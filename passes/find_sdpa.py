"""Find `scaled_dot_product_attention` calls (HF "sdpa" attention and plain modules)."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .find_window import mask_window
from .graph_utils import (ActivationSources, arg, attention_shapes, built_from_mask, check_self_attention, collect_sites,
                          default_scale, is_call, meta_tensor, static_int, strip_repeat_kv, symbolic_float)
from .site import AttentionSite, NotAttention, Refusal


def find_sdpa_sites(gm: fx.GraphModule) -> tuple[list[AttentionSite], list[Refusal]]:
    return collect_sites(gm, "sdpa", lambda node: is_call(node, F.scaled_dot_product_attention), _match)


def _match(node: fx.Node, layer: str, sources: ActivationSources) -> AttentionSite:
    query, key, value = node.args[:3]
    mask = arg(node, 3, "attn_mask")
    dropout = arg(node, 4, "dropout_p", 0.0)
    is_causal = arg(node, 5, "is_causal", False)
    scale = arg(node, 6, "scale")
    enable_gqa = node.kwargs.get("enable_gqa", False)
    if not isinstance(dropout, (int, float)) or dropout != 0:
        raise NotAttention(f"attention dropout p={dropout} (training mode) is not inference attention")
    if not isinstance(is_causal, bool):
        raise NotAttention(f"is_causal is not a constant ({is_causal})")
    if mask is not None and is_causal:
        raise NotAttention("both attn_mask and is_causal are set")
    if scale is not None and not isinstance(scale, (int, float)) and not symbolic_float(scale):
        raise NotAttention(f"scale is neither a constant nor a Python float ({scale})")
    if not enable_gqa:
        key, _ = strip_repeat_kv(key)
        value, _ = strip_repeat_kv(value)
    check_self_attention(sources, query, key, value)
    heads, kv_heads, head_dim, value_dim = attention_shapes(query, key, value)
    masks = ()
    if mask is not None:
        if not isinstance(mask, fx.Node):
            raise NotAttention(f"attn_mask is a constant ({mask!r}), not a tensor")
        masks = ((mask, "bool" if meta_tensor(mask).dtype == torch.bool else "additive"),)
        if masks[0][1] == "additive" and not built_from_mask(mask):
            raise NotAttention("attn_mask is a float tensor not built from a mask (a positional bias such as "
                               "ALiBi?), which a session cannot carry into the history")
    elif not is_causal and static_int(meta_tensor(query).shape[2]) != 1:
        raise NotAttention("no attn_mask and is_causal=False: bidirectional attention (every query sees every "
                           "key of its chunk), which a causal KV cache cannot reproduce")
    return AttentionSite(
        layer=layer, pattern="sdpa", query=query, key=key, value=value, masks=masks,
        scale=scale if symbolic_float(scale) else float(scale) if scale is not None else default_scale(head_dim),
        is_causal=is_causal,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, value_head_dim=value_dim, output=node,
        window=mask_window([mask]) if mask is not None else None,
    )
