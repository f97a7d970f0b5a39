"""Continue a chunk's positions from the session's store when the graph computed them from 0, and
check the positions a caller passes.

An HF decoder called without `position_ids` computes them itself,
`arange(T) + past_seen_tokens`, and without a cache `past_seen_tokens` is 0, which Dynamo records
as the literal `add(arange(T), 0)` (older models: `arange(0, T)`; OPT counts a mask of ones,
`cumsum(ones(B, past + T), 1)`). Inside a kvtopo session the store holds the earlier tokens while
the graph has no cache, so a second chunk would be rotated, or given position embeddings, as if
it were at positions 0..T-1 again. This pass finds that position computation and routes it
through `torch.ops.kvtopo.positions(pos, model_key)`, which adds what the session stores for the
calling model (nothing outside a session), as HF's cache would; `model_key` is the parameter the
rewritten attention ops pass to tell the session which model calls them.

Only a computation that is provably the chunk's positions is rewritten: an `arange` with no
tensor input, starting at the literal 0, as long as the query's token dimension, or the `cumsum`
along the token axis of a mask as long as the query, built in the graph as ones or passed by the
caller (a count of the chunk's real tokens: the full history's count sliced at the store's length
is the same count plus that length), or the first T of a buffer the model holds that counts 0, 1, 2,
... (BERT's `position_ids[:, :T]`, read from the buffer Dynamo was given), whose values reach the cos/sin (or `polar`) of a rotary
embedding or an index into a table the model holds (GPT-2's, OPT's, BioGPT's learned position
embeddings) that feeds the query or key of a rewritten kvtopo attention op. A table's first T
rows taken by a slice (`cos_cached[:T]`, `pe[:T]`, `pos_emb[:, :T]`) and met elementwise by the
activations are the same count: the slice becomes a lookup of the routed count's rows. A graph that takes
`position_ids` as an input (kvtopo.generate, HF generate, export) or whose start comes from a
cache (`get_seq_length()`, a SymInt input or a non-zero constant: then the count is longer than
the query) has no such node. An integer input of the query's length named as positions that
reaches the cos/sin or a table the same way (`position_ids`, `cache_position`, or a count a graph
break left in another graph, as CTRL's) goes through `torch.ops.kvtopo.given_positions` instead, which raises when every
row restarts at 0 over a stored history.

Counts the store cannot continue -- an `arange` from another start or by a step (`arange(T) + 2`,
`arange(0, 2 * T, 2)`), a table's rows from another row (`pe[2:T + 2]`), a held count's from
another (`position_ids[:, 2:T + 2]`), a `cumsum` of a mask the graph computed (RoBERTa counts its
token ids that are not padding), or a start a cache gave --
go through `kvtopo.given_positions(fixed=True)` where their values go on to the rotary angles or a
table: a session raises when they start below its stored length plus their start over the empty
store (`Session.computed_positions_start`). A count reaches the rotary angles
as a position only linearly (position x frequency): one that gets there only through a power, as
inverse frequencies computed in forward do (`base ** (-arange(d // 2) / d)`), is no position,
however long it is.

HF's masks stay valid under the shift: with an in-graph `DynamicCache` the mask is built from the
cache's offsets (not from the positions); without a cache, the packed-sequence check only looks at
differences of consecutive positions, which a common shift keeps. The session checks the graph's
mask over the chunk against causal anyway.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

import kvtopo.kernels.ops  # noqa: F401  (registers torch.ops.kvtopo.*, positions included)

from .graph_utils import ancestor_nodes, is_call, model_tensor, source_name

_ATTENTION_OPS = {
    # op -> the names of its arguments that carry RoPE (query and key)
    torch.ops.kvtopo.attention.default: ("query", "key"),
    torch.ops.kvtopo.mla_attention.default: ("query", "rope_key"),
}


@dataclass(frozen=True)
class PositionSite:
    node: fx.Node  # the chunk's count from 0 (`add(arange(T), 0)`, an arange, `cumsum(mask)`) or a position input
    model_key: fx.Node  # the parameter the attention ops it feeds name their model by
    layers: tuple[str, ...]  # the attention ops whose query/key it rotates


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


def _cumsum_along_tokens(node: fx.Node) -> bool:
    """`cumsum(x, dim=-1)` of one tensor along its last axis, where a [B, T] mask has its tokens."""
    if not is_call(node, torch.cumsum, methods=("cumsum",)) or len(node.all_input_nodes) != 1:
        return False
    value = node.meta.get("example_value")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and dim in (value.dim() - 1, -1)


def _count_of_mask(node: fx.Node) -> bool:
    """`cumsum(mask, dim=-1)` of a 2-D mask along its tokens, the mask built in the graph as ones (no
    tensor argument) or passed by the caller: each row counts its real tokens, as OPT numbers them.
    Over a chunk's own mask the count starts at the chunk; the history's count adds what is stored."""
    if not _cumsum_along_tokens(node) or node.meta["example_value"].dim() != 2:
        return False
    mask = node.all_input_nodes[0]
    built_as_ones = is_call(mask, torch.ones) and not _tensor_args(mask)
    passed = mask.op == "placeholder" and not model_tensor(mask)
    return built_as_ones or passed


def _held_count_slice(node: fx.Node) -> slice | None:
    """The last axis's slice of `buffer[..., a:b]` (only full slices before it) when the buffer the
    model holds counts 0, 1, 2, ... along its last axis in every row (BERT's `position_ids`
    buffer): its values are the count from `a`. Read from the buffer Dynamo was given."""
    if not is_call(node, operator.getitem) or not isinstance(node.args[0], fx.Node):
        return None
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not index or not all(isinstance(i, slice) for i in index) or any(i != slice(None) for i in index[:-1]):
        return None
    example = getattr(node.args[0].meta.get("grapharg"), "example", None)
    if not model_tensor(node.args[0]) or not isinstance(example, torch.Tensor) or len(index) != example.dim():
        return None
    if example.is_floating_point() or example.is_complex() or example.numel() == 0:
        return None
    count = torch.arange(example.shape[-1], device=example.device).expand_as(example)
    return index[-1] if torch.equal(example.to(count.dtype), count) else None


def _chunk_length(node: fx.Node) -> str | None:
    """The token count of a position computation: an arange's length, a count's row length, a
    held count's first T (`position_ids[:, :T]`)."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    if _zero_based_arange(node) and value.dim() == 1:
        return str(value.shape[0])
    if _count_of_mask(node):
        return str(value.shape[1])
    rows = _held_count_slice(node)
    if rows is not None and _is_zero(rows.start or 0) and rows.step in (None, 1):
        return str(value.shape[-1])
    return None


def _positions_node(count: fx.Node) -> fx.Node | None:
    """The node holding the positions: `count + 0` when that is the only use of the count (seen
    through views: `arange(T)[None, :] + 0`), the count itself when no start is added; None when
    something else (a cache length) is added, before or after a view."""
    node = count
    while True:
        users = list(node.users)
        if len(users) == 1 and is_call(users[0], operator.add, torch.add, methods=("add",)):
            add = users[0]
            other = add.args[1] if add.args[0] is node else add.args[0]
            return add if len(add.args) == 2 and not add.kwargs and _is_zero(other) else None
        if any(is_call(u, operator.add, torch.add, operator.sub, torch.sub, methods=("add", "sub")) for u in users):
            return None
        if len(users) != 1 or not _same_values(users[0], node):
            return count
        node = users[0]


# Ops whose result is not linear in an input: positions enter a rotary angle linearly (position x
# frequency, or over an interpolation factor), while a count of frequencies (`arange(d // 2)` in
# `base ** (-arange / d)`) reaches the same cos/sin through a power. A count that reaches them only
# through one of these is no position, however long it is.
_NONLINEAR = ((operator.pow, torch.pow, torch.float_power, torch.exp, torch.exp2, torch.log, torch.log2, torch.log1p,
               torch.reciprocal, torch.rsqrt, torch.sqrt),
              ("pow", "float_power", "exp", "exp2", "log", "log2", "log1p", "reciprocal", "rsqrt", "sqrt"))
_DIVISIONS = ((operator.truediv, operator.floordiv, torch.div, torch.true_divide, torch.floor_divide),
              ("div", "true_divide", "floor_divide"))


def _linear_in(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` is linear in `node` (or no arithmetic at all): not a power, exponential,
    logarithm or root of it, nor a division by it."""
    if is_call(user, *_NONLINEAR[0], methods=_NONLINEAR[1]):
        return False
    return not (is_call(user, *_DIVISIONS[0], methods=_DIVISIONS[1]) and node in user.args[1:])


def _linear_descendants(node: fx.Node) -> set[fx.Node]:
    """The nodes `node` reaches through ops linear in what they take from it."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user not in seen and _linear_in(user, current):
                seen.add(user)
                stack.append(user)
    return seen


def _is_rotary(node: fx.Node) -> bool:
    """cos/sin of a rotary embedding, or its complex form (`polar`: Llama-4, DeepSeek-V2)."""
    return is_call(node, torch.cos, torch.sin, torch.polar, methods=("cos", "sin"))


_SAME_VALUES = ("view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "flatten", "contiguous", "clone",
                "to", "long", "int", "type", "type_as")


def _same_values(user: fx.Node, node: fx.Node) -> bool:
    """`user` holds `node`'s values unchanged: a view or cast, a slice."""
    if is_call(user, torch.reshape, torch.unsqueeze, torch.squeeze, torch.flatten, methods=_SAME_VALUES):
        return user.args[0] is node
    if is_call(user, operator.getitem):
        index = user.args[1] if isinstance(user.args[1], tuple) else (user.args[1],)
        return user.args[0] is node and all(i is None or i is Ellipsis or isinstance(i, slice) for i in index)
    return False


def _keeps_positions(user: fx.Node, node: fx.Node) -> bool:
    """`user` still holds `node`'s positions, moved by at most a constant: a view or cast, a slice,
    `+`/`-` a number, `*` an all-ones tensor built in the graph or the mask a count counts (OPT's
    `cumsum(mask) * mask - 1`: padding stays at -1 under any shift)."""
    if _same_values(user, node):
        return True
    other = [a for a in user.args if a is not node]
    if is_call(user, operator.add, torch.add, operator.sub, torch.sub, methods=("add", "sub")):
        return len(user.args) == 2 and user.args[0] is node and len(other) == 1 and isinstance(other[0], (int, float))
    if is_call(user, operator.mul, torch.mul, methods=("mul",)):  # by ones, or by the counted mask (pads to 0)
        return len(other) == 1 and ((is_call(other[0], torch.ones) and not _tensor_args(other[0]))
                                    or other[0] is _counted_mask(node))
    return False


def _counted_mask(node: fx.Node):
    """The mask a count (`cumsum(mask)`) counts, seen through the views and casts after it."""
    while not _cumsum_along_tokens(node) and node.op in ("call_function", "call_method") and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node.all_input_nodes[0] if _cumsum_along_tokens(node) else None


def _row_index(index):
    """The tensor picking rows in `table[index]`: `index` itself, or the first of `(index, :, ...)`."""
    if isinstance(index, tuple) and index and all(i is None or i is Ellipsis or isinstance(i, slice) for i in index[1:]):
        return index[0]
    return index


def _held_table(table) -> bool:
    """A table the model holds, possibly cast or moved first (CTRL's `pos_encoding.to(dtype)`)."""
    while is_call(table, methods=("to", "type", "float", "half", "bfloat16", "contiguous")):
        table = table.args[0]
    return isinstance(table, fx.Node) and model_tensor(table)


def _looked_up_tables(positions: fx.Node, users=None) -> set[fx.Node]:
    """Rows picked from a table the model holds by `positions` (as `_keeps_positions` carries them):
    `embedding(idx, table)`, `table.index_select(0, idx)`, `table[idx]`, `table[idx, :]` (learned or
    sinusoidal position embeddings); through `users` of `positions` only, when given."""
    found, stack, seen = set(), [positions], {positions}
    while stack:
        node = stack.pop()
        for user in users if node is positions and users is not None else node.users:
            if is_call(user, F.embedding):
                table, index = user.args[1] if len(user.args) > 1 else user.kwargs.get("weight"), user.args[0]
            elif is_call(user, torch.embedding):  # (weight, indices), the other way round
                table, index = user.args[0], user.args[1] if len(user.args) > 1 else user.kwargs.get("indices")
            elif is_call(user, torch.index_select, methods=("index_select",)):
                table, index = user.args[0], user.args[2] if len(user.args) > 2 else user.kwargs.get("index")
            elif is_call(user, operator.getitem) and isinstance(user.args[0], fx.Node):
                table, index = user.args[0], _row_index(user.args[1])
            else:
                table = index = None
            if index is node and _held_table(table):
                found.add(user)
            elif user not in seen and _keeps_positions(user, node):
                seen.add(user)
                stack.append(user)
    return found


def _token_dim(node) -> str | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    return str(value.shape[-2])


def _fed_attention(graph: fx.Graph) -> list[tuple[set[fx.Node], str | None, object, object]]:
    """For each kvtopo attention op: the ancestors of its RoPE'd inputs, its query's token count,
    its layer and its model key."""
    fed = []
    for op in graph.nodes:
        if op.op == "call_function" and op.target in _ATTENTION_OPS:
            ancestors = ancestor_nodes([_op_arg(op, name) for name in _ATTENTION_OPS[op.target]])
            fed.append((ancestors, _token_dim(_op_arg(op, "query")), _op_arg(op, "layer"), _op_arg(op, "model_key")))
    return fed


def _site(pos: fx.Node, tokens: str, fed: list, users=None) -> PositionSite | None:
    """`pos` as a site when its cos/sin or table rows reach the q/k of attention ops of one model
    whose queries are as long as it (through `users` of `pos` only, when given)."""
    if users is None:
        reached = {n for n in _linear_descendants(pos) if _is_rotary(n)}
    else:
        reached = {n for u in users if _linear_in(u, pos) for n in {u} | _linear_descendants(u) if _is_rotary(n)}
    reached |= _looked_up_tables(pos, users)
    if _given_rotary(pos) is not None:  # the cos/sin themselves, passed in
        reached.add(pos)
    rotated = [(layer, key) for ancestors, query_tokens, layer, key in fed if reached & ancestors and query_tokens == tokens]
    keys = {key for _, key in rotated}
    # Without a model key a session cannot tell whose store to continue from.
    if len(keys) != 1 or not isinstance(next(iter(keys)), fx.Node):
        return None
    return PositionSite(pos, keys.pop(), tuple(layer for layer, _ in rotated))


def find_position_sites(gm: fx.GraphModule) -> list[PositionSite]:
    """Every position computation counted from the chunk's start whose cos/sin or table rows reach a
    kvtopo attention op's q/k."""
    return _sites(gm, _counted_positions)


def _counted_positions(node: fx.Node) -> tuple[fx.Node, str] | None:
    """(the node holding the positions, their token count) when `node` is a chunk's count from 0."""
    tokens = _chunk_length(node)
    pos = _positions_node(node) if tokens is not None else None
    return (pos, tokens) if pos is not None else None


def _sites(gm: fx.GraphModule, positions_at) -> list[PositionSite]:
    """The sites of the nodes `positions_at(node)` takes for positions ((node, token count), or None)."""
    fed = _fed_attention(gm.graph)
    sites = []
    for node in gm.graph.nodes if fed else ():
        found = positions_at(node)
        site = _site(*found, fed) if found is not None else None
        if site is not None:
            sites.append(site)
    return sites


def rewrite_position_sites(gm: fx.GraphModule, sites: list[PositionSite]) -> int:
    """Put `kvtopo.positions(pos, model_key, real_tokens)` between each site's positions and all
    their users; `real_tokens` for a count of a mask, which numbers each row's real tokens."""
    return _route(gm, sites, torch.ops.kvtopo.positions.default,
                  lambda site: (_counted_mask(site.node) is not None,))


@dataclass(frozen=True)
class SlicedTable:
    node: fx.Node  # `table[:T]` (or `table[:, :T]`, `table[2:T + 2]`...): rows of a table the model holds
    table: fx.Node
    dim: int  # the sliced dimension
    rows: slice  # the rows taken: start and step ints, stop an int or the graph's node for it
    model_key: fx.Node

    @property
    def counted_from_zero(self) -> bool:
        """Rows 0..T-1: the chunk's positions, continued from the store."""
        return self.rows.start == 0 and self.rows.step == 1


def _sliced_rows(node: fx.Node) -> tuple[fx.Node, int, slice] | None:
    """(table, dim, rows) when `node` is `table[..., start:stop:step, ...]` of a table the model
    holds: one dimension cut (a constant start and step, a stop), the others whole."""
    if not is_call(node, operator.getitem) or not _held_table(node.args[0]):
        return None
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if not all(isinstance(i, slice) for i in index):
        return None
    cut = [d for d, i in enumerate(index) if i != slice(None)]
    if len(cut) != 1:
        return None
    # Positions run along a table's rows, its second-to-last axis (`pe[:T]` of [rows, D],
    # `cos_cached[:, :, :T]` of [1, 1, rows, D]): a cut elsewhere (a per-channel `scale[:d]`, d as
    # long as the chunk by chance) takes no positions.
    table = node.args[0].meta.get("example_value")
    if not isinstance(table, torch.Tensor) or cut[0] - table.dim() != -2:
        return None
    part = index[cut[0]]
    start, step = 0 if part.start is None else part.start, 1 if part.step is None else part.step
    if type(start) is not int or start < 0 or type(step) is not int or step < 1 or part.stop is None:
        return None
    return (node.args[0], cut[0], slice(start, part.stop, step)) if _only_combined_elementwise(node) else None


_ELEMENTWISE = ((operator.add, torch.add, operator.mul, torch.mul, operator.sub, torch.sub), ("add", "mul", "sub"))


def _only_combined_elementwise(node: fx.Node) -> bool:
    """Whether `node`'s rows only meet the activations elementwise (`x + pe`, `q * cos`), through
    views and casts: as positions do, and a slice of weights (`w[:n]` into a linear, n equal to
    the chunk's length by chance) does not."""
    users = list(node.users)
    while users:
        user = users.pop()
        if is_call(user, torch.reshape, torch.unsqueeze, torch.squeeze, operator.getitem, methods=_SAME_VALUES):
            users.extend(user.users)
        elif not is_call(user, *_ELEMENTWISE[0], methods=_ELEMENTWISE[1]):
            return False
    return bool(node.users)


def find_sliced_table_sites(gm: fx.GraphModule, counted_from_zero: bool = True) -> list[SlicedTable]:
    """Every slice of a table the model holds to T rows that reaches the q/k of the attention ops of
    one model whose queries are T long: the chunk's first T rows (`cos_cached[:T]`, a sinusoidal
    `pe[:T]`, learned `pos_emb[:, :T]`), its positions counted from 0; with `counted_from_zero`
    False, the slices from another row or by a step (`pe[2:T + 2]`, `pe[:2 * T:2]`), positions the
    store cannot continue."""
    fed = _fed_attention(gm.graph)
    sites = []
    for node in gm.graph.nodes if fed else ():
        found = _sliced_rows(node)
        if found is None:
            continue
        site = SlicedTable(node, *found, model_key=None)
        if site.counted_from_zero != counted_from_zero:
            continue
        tokens = str(node.meta["example_value"].shape[site.dim]) if "example_value" in node.meta else None
        keys = {key for ancestors, query_tokens, _, key in fed if node in ancestors and query_tokens == tokens}
        if len(keys) == 1 and isinstance(next(iter(keys)), fx.Node):
            sites.append(dataclasses.replace(site, model_key=keys.pop()))
    return sites


def find_offset_table_sites(gm: fx.GraphModule) -> list[SlicedTable]:
    """`find_sliced_table_sites` of the slices from another row than 0 or by a step."""
    return find_sliced_table_sites(gm, counted_from_zero=False)


def rewrite_sliced_table_sites(gm: fx.GraphModule, sites: list[SlicedTable]) -> int:
    """Each `table[start:stop:step]` becomes `table.index_select(dim, op(arange(start, stop, step),
    model_key))`: the same rows outside a session. `op` is `kvtopo.positions` for rows from 0 (the
    rows after the stored history inside a session), `kvtopo.given_positions(fixed=True)` for the
    others (a session raises when they start below its stored length plus their start over the
    empty store)."""
    graph = gm.graph
    for site in sites:
        value = site.node.meta["example_value"]
        if site.counted_from_zero:
            op, arange_args, flags = torch.ops.kvtopo.positions.default, (site.rows.stop,), ()
        else:
            op, arange_args, flags = (torch.ops.kvtopo.given_positions.default,
                                      (site.rows.start, site.rows.stop, site.rows.step), (True,))
        with graph.inserting_before(site.node):
            count = graph.call_function(torch.arange, arange_args, {"device": value.device})
            positions = graph.call_function(op, (count, site.model_key, *flags))
            rows = graph.call_function(torch.index_select, (site.table, site.dim, positions))
        rows.meta.update({k: v for k, v in site.node.meta.items() if k in ("example_value", "stack_trace")})
        site.node.replace_all_uses_with(rows)
        graph.erase_node(site.node)
    graph.lint()
    gm.recompile()
    return len(sites)


_ROUTED = (torch.ops.kvtopo.positions.default, torch.ops.kvtopo.given_positions.default)


def _shifted(user: fx.Node, node: fx.Node) -> bool:
    """`user` is `node` plus, minus or times a number or a size (`arange(T) + 2`, `arange(T) + past`)."""
    if not is_call(user, operator.add, torch.add, operator.sub, torch.sub, operator.mul, torch.mul,
                   methods=("add", "sub", "mul")) or len(user.args) != 2 or user.kwargs:
        return False
    other = user.args[1] if user.args[0] is node else user.args[0]
    if isinstance(other, fx.Node):
        other = other.meta.get("example_value")
    return isinstance(other, (int, float, torch.SymInt))


def _count_ends(count: fx.Node) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Where a count's values leave its chain of views, casts and shifts (`_same_values`,
    `_shifted`): each integer node of the chain with users outside it, and those users."""
    ends, stack, seen = [], [count], {count}
    while stack:
        node = stack.pop()
        chained = [u for u in node.users if _same_values(u, node) or _shifted(u, node)]
        others = [u for u in node.users if u not in chained]
        value = node.meta.get("example_value")
        if others and isinstance(value, torch.Tensor) and not value.is_floating_point():
            ends.append((node, others))
        for user in chained:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return ends


def _computed_count(node: fx.Node) -> str | None:
    """The token count of integers the graph counts from numbers of its own, which no store
    follows: an `arange` with no tensor argument, a slice of a held count (`position_ids[:, 2:T + 2]`),
    a `cumsum` along the tokens of a mask other than a chunk's own (RoBERTa counts its token ids
    that are not padding)."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.is_floating_point():
        return None
    if is_call(node, torch.arange):
        return str(value.shape[0]) if value.dim() == 1 and not _tensor_args(node) else None
    if _held_count_slice(node) is not None:
        return str(value.shape[-1])
    if _cumsum_along_tokens(node) and not _count_of_mask(node):
        return str(value.shape[-1])
    return None


def find_fixed_position_sites(gm: fx.GraphModule) -> list[PositionSite]:
    """Every count the store cannot continue whose cos/sin or table rows reach a kvtopo attention
    op's q/k: an `arange` with no tensor argument that no kvtopo op routes yet (a count from 2 or
    by steps of 2, or from a start a cache gave), at each place its values, through views, casts and
    shifts, go on to the rotary angles or a table (checked there by `kvtopo.given_positions(fixed=True)`:
    positions that start below the stored length plus their start over the empty store raise)."""
    fed = _fed_attention(gm.graph)
    sites = []
    for node in gm.graph.nodes if fed else ():
        tokens = _computed_count(node)
        for end, users in _count_ends(node) if tokens is not None else ():
            if any(is_call(user, *_ROUTED) for user in users):
                continue
            site = _site(end, tokens, fed, users)
            if site is not None:
                sites.append(site)
    return sites


def rewrite_fixed_position_sites(gm: fx.GraphModule, sites: list[PositionSite]) -> int:
    """Put `kvtopo.given_positions(pos, model_key, fixed=True)` between each count and its users."""
    return _route(gm, sites, torch.ops.kvtopo.given_positions.default, lambda site: (True,))


def _given_positions(node: fx.Node) -> tuple[fx.Node, str] | None:
    """(node, token count) for integer positions passed to the graph, [T], [B, T] or mrope's
    [3, B, T] (Qwen2-VL: a temporal, height and width position per token), named as
    positions (`position_ids`, `cache_position`, `pos`, as Dynamo names an input after its source):
    token ids pick rows of a table too (the token embedding), and a mask may be counted into
    positions, so an input is taken for positions by its name."""
    value = node.meta.get("example_value")
    if node.op != "placeholder" or model_tensor(node) or not isinstance(value, torch.Tensor):
        return None
    if value.dim() not in (1, 2, 3) or value.dtype not in (torch.int64, torch.int32):  # 3: mrope's [3, B, T]
        return None
    return (node, str(value.shape[-1])) if "pos" in (source_name(node) or node.name).lower() else None


_ROTARY_INPUT_WORDS = {"cos", "sin", "freqs", "rotary"}


def _given_rotary(node: fx.Node) -> tuple[fx.Node, str] | None:
    """(node, token count) for a rotary embedding's cos or sin (or complex form) passed to the graph,
    [..., T, D], named as such (`position_embeddings`, `cos`, `sin`, `freqs_cis`): a model whose
    layers compile to graphs of their own (DBRX's) passes them from the graph that counted the
    positions. Other floats reach q/k too (the hidden states), so an input is taken by its name."""
    value = node.meta.get("example_value")
    if node.op != "placeholder" or model_tensor(node) or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if not (value.is_floating_point() or value.is_complex()):
        return None
    name = (source_name(node) or node.name).lower()
    named = "position_embeddings" in name or _ROTARY_INPUT_WORDS & set(re.split(r"[^a-z]+", name))
    return (node, str(value.shape[-2])) if named else None


def find_given_position_sites(gm: fx.GraphModule) -> list[PositionSite]:
    """Every graph input of positions, or of their rotary cos/sin, whose cos/sin or table rows reach a
    kvtopo attention op's q/k (checked by `kvtopo.given_positions`: a restart at 0 over a stored
    history raises)."""
    return _sites(gm, lambda node: _given_positions(node) or _given_rotary(node))


def rewrite_given_position_sites(gm: fx.GraphModule, sites: list[PositionSite]) -> int:
    """Put `kvtopo.given_positions(pos, model_key)` between each site's input and all its users."""
    return _route(gm, sites, torch.ops.kvtopo.given_positions.default)


def _route(gm: fx.GraphModule, sites: list[PositionSite], op, more=lambda site: ()) -> int:
    """Put `op(pos, model_key, *more(site))` between each site's positions and all their users,
    after both (and after the graph's inputs)."""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    for site in sites:
        after = max(site.node, site.model_key, key=order.__getitem__)
        while after.next.op == "placeholder":
            after = after.next
        with graph.inserting_after(after):
            new = graph.call_function(op, (site.node, site.model_key, *more(site)))
        new.meta.update({k: v for k, v in site.node.meta.items() if k in ("example_value", "stack_trace")})
        site.node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    graph.lint()
    gm.recompile()
    return len(sites)
