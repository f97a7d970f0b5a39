"""Small facts about Dynamo FX graphs that the attention passes share."""

from __future__ import annotations

import math
import operator
import re

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .site import AttentionSite, NotAttention, Refusal

_MODULE_PREFIX = re.compile(r"^L\[[^\]]+\](\[\d+\])?\.?")


def is_call(node, *targets, methods: tuple[str, ...] = ()) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target in targets:
        return True
    return node.op == "call_method" and node.target in methods


def arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def meta_tensor(node) -> torch.Tensor:
    """The fake tensor Dynamo recorded for `node`, or NotAttention if it has none."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        raise NotAttention(f"no tensor metadata for {node}")
    return value


def static_int(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def layer_name(node: fx.Node, fallback: str) -> str:
    """Qualified name of the innermost module that made `node`, e.g. 'model.layers.3.self_attn'."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return fallback
    path = list(stack.values())[-1][0]
    path = _MODULE_PREFIX.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("['", ".").replace("']", "")
    return path.strip(".") or fallback


_TRANSPARENT_CASTS = ("to", "type", "float", "contiguous")


def skip_casts(node):
    """Walk up through dtype casts / contiguous, which do not change attention's math (a cast to
    an integer or bool dtype does: it truncates the scores; `floating_cast`)."""
    while floating_cast(node):
        node = node.args[0]
    return node


def floating_cast(node) -> bool:
    """`node` is a cast (or `contiguous`) of another node whose result is floating point."""
    if not is_call(node, methods=_TRANSPARENT_CASTS) or not isinstance(node.args[0], fx.Node):
        return False
    if node.target == "to" and not _is_dtype_only_to(node):
        return False
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _is_dtype_only_to(node: fx.Node) -> bool:
    rest = list(node.args[1:]) + list(node.kwargs.values())
    return all(isinstance(a, (torch.dtype, torch.device, bool)) or a is None for a in rest)


def strip_repeat_kv(node: fx.Node) -> tuple[fx.Node, int]:
    """Undo a GQA `repeat_kv` (x[:, :, None].expand(B, Hkv, n, S, d).reshape(B, Hkv*n, S, d)).

    Returns the kv-head tensor and the repeat factor (1 if `node` is not a repeat).
    """
    if is_call(node, torch.repeat_interleave, methods=("repeat_interleave",)):
        repeats, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        if isinstance(repeats, int) and dim in (1, -3):
            return node.args[0], repeats
        return node, 1
    if not is_call(node, torch.reshape, methods=("reshape", "view")):
        return node, 1
    expanded = node.args[0]
    if not is_call(expanded, methods=("expand",)):
        return node, 1
    unsqueezed = expanded.args[0]
    source = None
    if is_call(unsqueezed, operator.getitem):
        index = unsqueezed.args[1]
        # x[:, :, None, :, :] or its shorter spelling x[:, :, None] (the trailing axes implied)
        if (isinstance(index, tuple) and 3 <= len(index) <= 5 and index[2] is None
                and all(i == slice(None) for i in index[:2] + index[3:])):
            source = unsqueezed.args[0]
    elif is_call(unsqueezed, torch.unsqueeze, methods=("unsqueeze",)) and arg(unsqueezed, 1, "dim") == 2:
        source = unsqueezed.args[0]
    if source is None:
        return node, 1
    try:
        kv, repeated = meta_tensor(source), meta_tensor(node)
    except NotAttention:
        return node, 1
    if kv.dim() != 4 or repeated.dim() != 4:
        return node, 1
    heads, kv_heads = static_int(repeated.shape[1]), static_int(kv.shape[1])
    if heads is None or kv_heads is None or heads % kv_heads:
        return node, 1
    if any(static_int(repeated.shape[i]) != static_int(kv.shape[i]) for i in (0, 3)) or \
            str(repeated.shape[2]) != str(kv.shape[2]):
        return node, 1
    return source, heads // kv_heads


def source_name(node: fx.Node) -> str:
    """Dynamo's source of a placeholder ('' once compilation ends and `grapharg` is dropped)."""
    source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", "")
    return source() if callable(source) else source


def _weight_placeholder(node: fx.Node) -> bool:
    """A lifted parameter/buffer: by Dynamo's source while compiling, else by its lifted name."""
    source = source_name(node)
    if source:
        return "._parameters[" in source or "._buffers[" in source
    return "_parameters_" in node.name or "_buffers_" in node.name


def model_tensor(node: fx.Node) -> bool:
    """A tensor the model holds rather than one the call passes: a parameter, a buffer, a global
    Dynamo lifted (`G[...]`), or a `get_attr`."""
    if node.op == "get_attr":
        return True
    return node.op == "placeholder" and (_weight_placeholder(node) or source_name(node).startswith("G[")
                                         or node.name.startswith("g_"))


def ancestor_nodes(roots) -> set[fx.Node]:
    """The nodes `roots` (fx nodes; other values are ignored) are computed from, themselves
    included, through in-place writes too (`pe[:, 0::2] = sin(...)`: the sin is an ancestor of
    `pe`)."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
            stack.extend(user for user in node.users if _writes_into(user, node))
    return seen


def _writes_into(user: fx.Node, node: fx.Node) -> bool:
    """`user` writes into `node` in place: `node[...] = x`, or an in-place op (`copy_`, `add_`...)."""
    if not user.args or user.args[0] is not node:
        return False
    name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
    return user.target is operator.setitem or (name.endswith("_") and not name.startswith("__"))


_EMBEDDING = (torch.nn.functional.embedding, torch.embedding)


def model_key(graph: fx.Graph) -> fx.Node | None:
    """The graph's first parameter input that no embedding op reads: the kvtopo ops take it so
    that a session can tell which model a call belongs to at run time (Dynamo reuses one compiled
    graph for every instance of a module class, so a name fixed at compile time could not). An
    embedding table is passed over: a draft model sharing its target's embeddings (and a head
    tied to them) would share the target's store. A tensor-subclass parameter (a tensor-parallel
    DTensor) is passed over too: mixed with the op's plain local activations it would send the op
    through DTensor dispatch. The first embedding table when the graph has no other parameter."""
    keys = [n for n in graph.nodes if n.op == "placeholder" and _weight_placeholder(n)
            and isinstance(n.meta.get("example_value"), torch.nn.Parameter)
            and not is_traceable_wrapper_subclass(n.meta["example_value"])]
    return next((n for n in keys if not any(is_call(user, *_EMBEDDING) for user in n.users)),
                keys[0] if keys else None)


class ActivationSources:
    """Which non-weight graph inputs each node depends on (memoised over one graph)."""

    def __init__(self, graph: fx.Graph):
        self._memo: dict[fx.Node, frozenset[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "placeholder":
                tensor = isinstance(node.meta.get("example_value"), torch.Tensor)
                self._memo[node] = frozenset({node}) if tensor and not _weight_placeholder(node) else frozenset()
            elif node.op == "get_attr":
                self._memo[node] = frozenset()
            else:
                deps = frozenset()
                for inp in node.all_input_nodes:
                    deps |= self._memo.get(inp, frozenset())
                self._memo[node] = deps

    def __getitem__(self, node: fx.Node) -> frozenset[fx.Node]:
        return self._memo[node]


def check_self_attention(sources: ActivationSources, query: fx.Node, key: fx.Node, value: fx.Node) -> None:
    """k/v must come from the same inputs as q: cross-attention has no per-step cache to build."""
    extra = (sources[key] | sources[value]) - sources[query]
    if extra:
        names = ", ".join(sorted(n.name for n in extra))
        if any("past_key_values" in n.name or "cache" in n.name for n in extra):
            raise NotAttention(f"keys/values include a cache passed in by the caller ({names}); in a kvtopo session "
                               "the history comes from the session: use kvtopo.generate, or pass "
                               "cache=kvtopo.hf_cache.SessionCache(session, model=model)")
        raise NotAttention(f"keys/values depend on inputs the queries do not ({names}): cross-attention is not cached")


def symbolic_float(value) -> bool:
    """A Python float Dynamo made a graph input (a module attribute whose value changed between
    compiles, e.g. the attention scale of a second model of the same class): its value arrives
    at run time, so the op can take the node as its float argument."""
    return isinstance(value, fx.Node) and isinstance(value.meta.get("example_value"), torch.SymFloat)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def constant_value(node) -> float | None:
    """A Python number, or a 0-d `torch.full`/`torch.tensor` of one, else None."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if is_call(node, torch.full) and len(node.args) >= 2 and tuple(node.args[0]) == ():
        return constant_value(node.args[1])
    if is_call(node, torch.tensor) and node.args:
        return constant_value(node.args[0])
    return None


def attention_shapes(query: fx.Node, key: fx.Node, value: fx.Node) -> tuple[int, int, int, int]:
    """(heads, kv_heads, head_dim, value_head_dim) of a [B, H, T, d] attention, all static."""
    q, k, v = meta_tensor(query), meta_tensor(key), meta_tensor(value)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise NotAttention(f"expected 4-D [batch, heads, tokens, dim] q/k/v, got {q.dim()}-D/{k.dim()}-D/{v.dim()}-D")
    heads, kv_heads = static_int(q.shape[1]), static_int(k.shape[1])
    head_dim, value_dim = static_int(q.shape[3]), static_int(v.shape[3])
    if None in (heads, kv_heads, head_dim, value_dim):
        raise NotAttention("head counts and head dims must be static")
    if static_int(k.shape[3]) != head_dim:
        raise NotAttention(f"query head dim {head_dim} != key head dim {k.shape[3]}")
    if static_int(v.shape[1]) != kv_heads or str(v.shape[2]) != str(k.shape[2]):
        raise NotAttention("keys and values differ in heads or length")
    if str(k.shape[2]) != str(q.shape[2]):
        raise NotAttention(f"{k.shape[2]} keys for {q.shape[2]} queries: the keys hold tokens besides the chunk's own "
                           "(a learned prefix, a history kept by the model); a session attends over its own history only")
    if heads % kv_heads:
        raise NotAttention(f"{heads} query heads are not a multiple of {kv_heads} kv heads")
    return heads, kv_heads, head_dim, value_dim


def collect_sites(gm: fx.GraphModule, pattern: str, is_candidate, match) -> tuple[list[AttentionSite], list[Refusal]]:
    """Every node `is_candidate` accepts, proven by `match(node, layer, sources)`: the sites it
    proves, and a `Refusal` carrying the reason for each it cannot."""
    sources = ActivationSources(gm.graph)
    sites, refusals = [], []
    for node in gm.graph.nodes:
        if not is_candidate(node):
            continue
        layer = layer_name(node, node.name)
        try:
            sites.append(match(node, layer, sources))
        except NotAttention as why:
            refusals.append(Refusal(layer, pattern, node.name, str(why)))
    return sites, refusals


MASK_FLOOR = -1e4  # an additive mask value at or below this hides a key (as runtime/session.py reads it)
_FILLS = ((torch.zeros, torch.zeros_like), ("new_zeros", "zero_"))
_FILLED = ((torch.full, torch.full_like), ("new_full", "fill_"))  # the fill value is the last positional argument
_UNCHANGED = ((torch.reshape, torch.unsqueeze, torch.squeeze, torch.permute, torch.transpose, torch.narrow, torch.clone,
               operator.getitem, torch.triu, torch.tril),  # (triu / tril zero the rest: still 0 or hidden)
              ("to", "type", "float", "half", "bfloat16", "double", "view", "reshape", "expand", "expand_as",
               "unsqueeze", "squeeze", "contiguous", "clone", "permute", "transpose", "repeat", "narrow",
               "__getitem__", "type_as", "view_as", "reshape_as", "triu", "tril"))
_BOTH = ((operator.add, torch.add, torch.minimum, torch.min), ("add", "__add__", "minimum", "min"))
_WHERE = ((torch.where,), ())
_MASKED_FILL = ((torch.masked_fill,), ("masked_fill", "masked_fill_"))
MUL_OPS = ((operator.mul, torch.mul), ("mul", "__mul__"))  # op groups: (functions, method names)
SUB_OPS = ((operator.sub, torch.sub), ("sub", "__sub__"))
_RSUB = ((torch.rsub,), ("rsub", "__rsub__"))


def in_group(node, group) -> bool:
    """Whether `node` calls one of a group's functions or methods."""
    return is_call(node, *group[0], methods=group[1])


def _mask_valued(value) -> bool:
    """A constant that is 0 or hides a key (very negative, -inf included)."""
    number = constant_value(value)
    return number is not None and (number == 0 or number <= MASK_FLOOR)


def _boolean_valued(node) -> bool:
    """A node of 0/1 values by construction: a bool or integer tensor (an attention_mask is 0/1), or
    one of those cast, negated as `1 - x`."""
    if not isinstance(node, fx.Node):
        return False
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor) and not value.is_floating_point():
        return True
    if in_group(node, _UNCHANGED):
        return _boolean_valued(node.args[0])
    if in_group(node, SUB_OPS) and constant_value(node.args[0]) == 1:
        return _boolean_valued(node.args[1])
    if in_group(node, _RSUB) and len(node.args) > 1 and constant_value(node.args[1]) == 1:
        return _boolean_valued(node.args[0])
    return False


def built_from_mask(node, depth: int = 0) -> bool:
    """Whether the float tensor `node` holds only 0 and very negative values by construction: a
    graph input (a mask passed in; the session checks its values), 0 / -inf fills, `where` or
    `masked_fill` choosing between such values, a 0/1 mask times a very negative constant, and
    sums, minima, casts and views of those. A positional bias (ALiBi: slopes times distances) is
    not: a session would keep its 0 on a token's own key and drop it on the whole history."""
    if not isinstance(node, fx.Node):
        return _mask_valued(node)
    if depth > 64:
        return False
    if node.op == "placeholder":
        return True
    if _mask_valued(node) or in_group(node, _FILLS):
        return True
    inner = lambda x: built_from_mask(x, depth + 1)  # noqa: E731
    if in_group(node, _FILLED):
        return _mask_valued(node.args[-1] if node.args else node.kwargs.get("fill_value"))
    if in_group(node, _WHERE) and len(node.args) == 3:
        return inner(node.args[1]) and inner(node.args[2])
    if in_group(node, _MASKED_FILL) and len(node.args) == 3:
        return inner(node.args[0]) and inner(node.args[2])
    if in_group(node, MUL_OPS) and len(node.args) == 2:
        a, b = node.args
        return any(_boolean_valued(x) and (constant_value(c) or 0) <= MASK_FLOOR for x, c in ((a, b), (b, a)))
    if in_group(node, _BOTH) and len(node.args) == 2:
        return inner(node.args[0]) and inner(node.args[1])
    if in_group(node, _UNCHANGED):
        return inner(node.args[0])
    return False
