"""Refuse attention primitives no pass rewrites, so a session raises instead of running them.

A graph whose attention is not rewritten attends over the chunk it is given and nothing else;
inside a session that silently drops the stored history. `scaled_dot_product_attention` and
softmax-over-a-product attention have their own finders (which refuse what they cannot prove);
this one names the other primitives a model can attend with: FlexAttention (HF's
`attn_implementation="flex_attention"`), the aten SDPA kernels called directly, and
`multi_head_attention_forward` (`nn.MultiheadAttention`, when Dynamo keeps it whole).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph_utils import layer_name
from .site import Refusal


_SDPA_HINT = "call F.scaled_dot_product_attention instead"


def _attention_primitives() -> dict:
    """{call target: (what to call it in a refusal, what to do instead)}."""
    aten = torch.ops.aten
    primitives = {F.multi_head_attention_forward: ("nn.MultiheadAttention", _SDPA_HINT)}
    for name in ("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        if hasattr(aten, name):
            packet = getattr(aten, name)
            primitives[packet] = primitives[packet.default] = (f"aten.{name}", _SDPA_HINT)
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        primitives[flex] = ("flex_attention", "load the model with attn_implementation 'sdpa' or 'eager'")
    return primitives


_PRIMITIVES = _attention_primitives()


def find_other_attention(gm: fx.GraphModule) -> tuple[list, list[Refusal]]:
    """No sites; a refusal for every call of an attention primitive no pass rewrites."""
    refusals = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _PRIMITIVES:
            name, hint = _PRIMITIVES[node.target]
            refusals.append(Refusal(layer_name(node, node.name), name, node.name,
                                    f"{name} is an attention kvtopo does not rewrite ({hint})"))
    return [], refusals
