"""Continue a chunk's RoPE positions from the session's store when the graph computed them from 0.

An HF decoder called without `position_ids` computes them itself,
`arange(T) + past_seen_tokens`, and without a cache `past_seen_tokens` is 0, which Dynamo records
as the literal `add(arange(T), 0)` (older models: `arange(0, T)`). Inside a kvtopo session the
store holds the earlier tokens while the graph has no cache, so a second chunk would be rotated
as if it were at positions 0..T-1 again. This pass finds that position computation and routes it
through `torch.ops.kvtopo.positions(pos, model_key)`, which adds what the session stores for the
calling model (nothing outside a session), as HF's cache would; `model_key` is the parameter the
rewritten attention ops pass to tell the session which model calls them.

Only a computation that is provably the chunk's positions is rewritten: an `arange` with no
tensor input, starting at the literal 0, as long as the query's token dimension, whose values
reach the cos/sin of a rotary embedding that feeds the query or key of a rewritten kvtopo
attention op. A graph that takes `position_ids` as an input (kvtopo.generate, HF generate, export)
or whose start comes from a cache (`get_seq_length()`, a SymInt input or a non-zero constant) has
no such node and is left unchanged.

HF's masks stay valid under the shift: with an in-graph `DynamicCache` the mask is built from the
cache's offsets (not from the positions); without a cache, the packed-sequence check only looks at
differences of consecutive positions, which a common shift keeps. The session checks the graph's
mask over the chunk against causal anyway.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

import kvtopo.kernels.ops  # noqa: F401  (registers torch.ops.kvtopo.*, positions included)

from .graph_utils import ancestor_nodes, is_call

_ATTENTION_OPS = {
    # op -> the names of its arguments that carry RoPE (query and key)
    torch.ops.kvtopo.attention.default: ("query", "key"),
    torch.ops.kvtopo.mla_attention.default: ("query", "rope_key"),
}


@dataclass(frozen=True)
class PositionSite:
    node: fx.Node  # the chunk's positions counted from 0: `add(arange(T), 0)` or the arange itself
    model_key: fx.Node  # the parameter the attention ops it feeds name their model by
    layers: tuple[str, ...]  # the attention ops whose query/key it rotates

    def describe(self) -> str:
        return f"positions {self.node.name} (rotating {', '.join(self.layers)}) continue from the store"


def _op_arg(node: fx.Node, name: str):
    """Argument `name` of a call to a kvtopo op, positional or keyword (None when not given)."""
    for i, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name)
    return None


def _is_zero(value) -> bool:
    return type(value) is int and value == 0


def _tensor_args(node: fx.Node) -> bool:
    return any(isinstance(n.meta.get("example_value"), torch.Tensor) for n in node.all_input_nodes)


def _zero_based_arange(node: fx.Node) -> bool:
    """`arange(T)` or `arange(0, T)` (step 1), no tensor argument."""
    if not is_call(node, torch.arange) or _tensor_args(node):
        return False
    if len(node.args) == 1 and not {"start", "step"} & set(node.kwargs):
        return True
    if len(node.args) == 2 and _is_zero(node.args[0]) and "step" not in node.kwargs:
        return True
    return len(node.args) == 3 and _is_zero(node.args[0]) and node.args[2] == 1


def _positions_node(arange: fx.Node) -> fx.Node | None:
    """The node holding the positions: `arange + 0` when that is the arange's only use, the arange
    itself when no start is added; None when something else (a cache length) is added."""
    users = list(arange.users)
    if len(users) == 1 and is_call(users[0], operator.add, torch.add, methods=("add",)):
        add = users[0]
        other = add.args[1] if add.args[0] is arange else add.args[0]
        return add if len(add.args) == 2 and not add.kwargs and _is_zero(other) else None
    if any(is_call(u, operator.add, torch.add, operator.sub, torch.sub, methods=("add", "sub")) for u in users):
        return None
    return arange


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _is_rotary(node: fx.Node) -> bool:
    return is_call(node, torch.cos, torch.sin, methods=("cos", "sin"))


def _token_dim(node) -> str | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    return str(value.shape[-2])


def find_position_sites(gm: fx.GraphModule) -> list[PositionSite]:
    """Every zero-based position computation whose cos/sin rotate a kvtopo attention op's q/k."""
    graph = gm.graph
    attention = [n for n in graph.nodes if n.op == "call_function" and n.target in _ATTENTION_OPS]
    if not attention:
        return []
    # For each op: the ancestors of its RoPE'd inputs, and its query's token count.
    fed = []
    for op in attention:
        ancestors = ancestor_nodes([_op_arg(op, name) for name in _ATTENTION_OPS[op.target]])
        fed.append((ancestors, _token_dim(_op_arg(op, "query")), _op_arg(op, "layer"), _op_arg(op, "model_key")))

    sites = []
    for node in graph.nodes:
        if not _zero_based_arange(node):
            continue
        pos = _positions_node(node)
        value = node.meta.get("example_value")
        if pos is None or not isinstance(value, torch.Tensor) or value.dim() != 1:
            continue
        rotary = {n for n in _descendants(pos) if _is_rotary(n)}
        rotated = [(layer, key) for ancestors, tokens, layer, key in fed
                   if rotary & ancestors and tokens == str(value.shape[0])]
        keys = {key for _, key in rotated}
        # Without a model key a session cannot tell whose store to continue from.
        if len(keys) != 1 or not isinstance(next(iter(keys)), fx.Node):
            continue
        sites.append(PositionSite(pos, keys.pop(), tuple(layer for layer, _ in rotated)))
    return sites


def rewrite_position_sites(gm: fx.GraphModule, sites: list[PositionSite]) -> int:
    """Put `kvtopo.positions(pos, model_key)` between each site's positions and all their users."""
    graph = gm.graph
    for site in sites:
        with graph.inserting_after(site.node):
            new = graph.call_function(torch.ops.kvtopo.positions.default, (site.node, site.model_key))
        new.meta.update({k: v for k, v in site.node.meta.items() if k in ("example_value", "stack_trace")})
        site.node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    graph.lint()
    gm.recompile()
    return len(sites)
