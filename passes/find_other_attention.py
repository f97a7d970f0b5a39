"""Refuse attention primitives no pass rewrites, so a session raises instead of running them.

A graph whose attention is not rewritten attends over the chunk it is given and nothing else;
inside a session that silently drops the stored history. `scaled_dot_product_attention` and
softmax-over-a-product attention have their own finders (which refuse what they cannot prove);
this one names the other primitives a model can attend with: FlexAttention (HF's
`attn_implementation="flex_attention"`), the aten SDPA kernels called directly, and
`multi_head_attention_forward` (`nn.MultiheadAttention`, when Dynamo keeps it whole), and any
attention inside a higher-order op's subgraph (`torch.utils.checkpoint`), which no pass walks,
and token-by-token products of the activations that reach no softmax a pass judged (attention
written in a form no pass matches).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .find_eager import is_attention_softmax
from .graph_utils import ActivationSources, in_group, layer_name
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
    """No sites; a refusal for every call of an attention primitive no pass rewrites, and for
    every higher-order op (torch.utils.checkpoint, Dynamo's `wrap`, `cond`, ...) whose subgraph
    attends: the passes rewrite the top-level graph only."""
    refusals = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _PRIMITIVES:
            name, hint = _PRIMITIVES[node.target]
            refusals.append(Refusal(layer_name(node, node.name), name, node.name,
                                    f"{name} is an attention kvtopo does not rewrite ({hint})"))
        elif node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            attention = _attention_under(gm, node)
            if attention is not None:
                op = getattr(node.target, "__name__", str(node.target))
                refusals.append(Refusal(layer_name(node, node.name), op, node.name,
                                        f"{attention} inside the subgraph of higher-order op {op} (e.g. "
                                        "torch.utils.checkpoint), which kvtopo does not rewrite; call the attention "
                                        "outside it"))
    refusals += _token_by_token_products(gm)
    return [], refusals


# Products and reductions whose [..., T, T] result can be attention's scores: q @ k^T, or
# (q[..., None, :] * k[..., None, :, :]).sum(-1).
_SCORE_PRODUCTS = ((torch.matmul, operator.matmul, torch.bmm, torch.baddbmm, torch.einsum, torch.sum, torch.mean),
                   ("matmul", "__matmul__", "bmm", "baddbmm", "sum", "mean"))


def _token_by_token_products(gm: fx.GraphModule) -> list[Refusal]:
    """A refusal for each 4-D float [..., T, T] product of the graph's inputs (T > 1) that does
    not lead to a softmax the eager pass judged: attention written in a form no pass matches (a
    softmax spelt out as exp / sum, `log_softmax(...).exp()`, scores summed from a broadcast
    product), which would otherwise attend over the chunk alone beside the rewritten layers."""
    sources = ActivationSources(gm.graph)
    refusals, flagged = [], set()
    for node in gm.graph.nodes:
        if not (in_group(node, _SCORE_PRODUCTS) and _square_scores(node) and sources[node]):
            continue
        if _near(node, "users", is_attention_softmax) or \
                _near(node, "all_input_nodes", lambda n: n in flagged or is_attention_softmax(n)):
            continue  # scores or probabilities of a softmax judged (rewritten, or refused with its reason), or of one flagged
        flagged.add(node)
        refusals.append(Refusal(layer_name(node, node.name), "token-by-token product", node.name,
                                f"{node.name} is a [..., T, T] product of the activations that reaches no softmax "
                                "kvtopo reads (a softmax written out with exp and sum, log_softmax, scores summed "
                                "from a broadcast product?): attention kvtopo does not recognise; use "
                                "torch.softmax over q @ k^T, or F.scaled_dot_product_attention"))
    return refusals


def _square_scores(node: fx.Node) -> bool:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or not value.is_floating_point():
        return False
    rows, cols = value.shape[-2], value.shape[-1]
    return str(rows) == str(cols) and not (isinstance(rows, int) and rows <= 1)


def _near(node: fx.Node, direction: str, found, depth: int = 8) -> bool:
    """Whether a node within `depth` steps along `direction` ("users" or "all_input_nodes") is `found`."""
    frontier = [node]
    for _ in range(depth):
        frontier = [other for n in frontier for other in getattr(n, direction)]
        if any(found(n) for n in frontier):
            return True
    return False


def _subgraphs(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The graph modules a higher-order op's call takes (its `get_attr` arguments)."""
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            sub = getattr(gm, arg.target, None)
            if isinstance(sub, fx.GraphModule):
                found.append(sub)
    return found


def _attention_in(gm: fx.GraphModule) -> str | None:
    """What in `gm` or its own subgraphs attends (an attention primitive, SDPA, a softmax over a
    product), named; None if nothing does."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _PRIMITIVES or node.target is F.scaled_dot_product_attention:
            return _PRIMITIVES.get(node.target, ("scaled_dot_product_attention",))[0]
        if is_attention_softmax(node):
            return f"a softmax over a product ({node.name})"
        if isinstance(node.target, torch._ops.HigherOrderOperator) and (inner := _attention_under(gm, node)):
            return inner
    return None


def _attention_under(gm: fx.GraphModule, hop: fx.Node) -> str | None:
    """What attends in the subgraphs a higher-order op's call takes, named; None if nothing does."""
    return next(filter(None, (_attention_in(sub) for sub in _subgraphs(gm, hop))), None)
