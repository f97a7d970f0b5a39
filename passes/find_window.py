"""Read a sliding window off the graph that builds an attention mask.

A windowed layer lets query i see keys j with i - window < j <= i. Models build that band in a
few ways, all of which leave the window as an integer constant in the mask's graph:

* HF transformers' mask functions: `kv_idx > q_idx - window` (`gt(kv, sub(q, window))`), used
  by every sliding-window model for both the `sdpa` and `eager` masks;
* the same bound written `q - kv < window` or with `>=` / `<=`;
* a band cut from a causal mask with `triu(diagonal=-(window - 1))`, or by removing
  `tril(diagonal=-window)`.

The constant found here is only a claim: inside a session the op also checks, on every chunk
long enough to show the band, that the graph's mask equals the causal window it applies
(runtime/session.py), so a misread window raises instead of attending wrongly.

That run-time check only sees the chunk, and a chunk no longer than a block or window shows no
more than causality. So every other comparison in the mask's graph must also be one whose meaning
over the whole history the session knows (`_read_mask`): causal order between two token
indices, a padding mask's 0/1 values, or HF's "same packed sequence" test. A block mask (Llama-4's
`attention_chunk_size`: `kv // c == q // c`), a window written another way (`kv + W > q`) or a
prefix (`kv < 4`) is refused here, before any chunk could hide it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_utils import SUB_OPS, arg, is_call, model_tensor
from .site import NotAttention

# comparison -> (window when the difference is strict, when it is not)
_GREATER = {operator.gt: 0, torch.gt: 0, "gt": 0, "__gt__": 0, operator.ge: 1, torch.ge: 1, "ge": 1, "__ge__": 1}
_LESS = {operator.lt: 0, torch.lt: 0, "lt": 0, "__lt__": 0, operator.le: 1, torch.le: 1, "le": 1, "__le__": 1}
_MAX_NODES = 400  # mask graphs are small; stop walking long before reaching the model's layers


def mask_window(masks: list[fx.Node]) -> int | None:
    """The window the masks' graphs encode, None if they encode none; NotAttention if several, or
    if the graphs hold a comparison the session could not carry into the history."""
    windows = _read_mask(masks)
    if len(windows) > 1:
        raise NotAttention(f"the mask's graph holds several sliding windows {sorted(windows)}")
    if windows and min(windows) < 1:
        raise NotAttention(f"the mask's graph holds a sliding window of {min(windows)} tokens")
    return windows.pop() if windows else None


_EQUALITY = (operator.eq, operator.ne, torch.eq, torch.ne, "eq", "__eq__", "ne", "__ne__")
_COMPARISON_FUNCTIONS = tuple(k for k in (*_EQUALITY, *_GREATER, *_LESS) if not isinstance(k, str))
_COMPARISON_METHODS = tuple(k for k in (*_EQUALITY, *_GREATER, *_LESS) if isinstance(k, str))
_SHIFTS = ((operator.add, torch.add, operator.sub, torch.sub, operator.mul, torch.mul, operator.floordiv,
            torch.floor_divide, operator.mod, torch.remainder, torch.fmod, torch.div, operator.truediv),
           ("add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "mul", "__mul__", "__rmul__", "floor_divide",
            "__floordiv__", "remainder", "__mod__", "fmod", "div", "__truediv__"))
_BLOCKS = ((operator.floordiv, torch.floor_divide, operator.mod, torch.remainder, torch.fmod, torch.clamp,
            torch.clamp_min, torch.clamp_max, operator.rshift, operator.lshift, torch.bucketize),
           ("floor_divide", "__floordiv__", "remainder", "__mod__", "fmod", "clamp", "clamp_min", "clamp_max", "clip",
            "__rshift__", "__lshift__"))  # index arithmetic that cuts tokens into blocks or bounds them
_VIEWS = ((operator.getitem, torch.unsqueeze, torch.reshape), ("to", "view", "reshape", "expand", "unsqueeze",
                                                                 "__getitem__", "long", "int", "contiguous", "bool"))


def _read_mask(masks: list[fx.Node]) -> set[int]:
    """The sliding windows the masks' graphs hold; NotAttention naming the first comparison (or
    `triu`/`tril` band) in them that is none of: a window `_window_of` reads; causal order between two token indices (`kv <= q`,
    `q - kv >= 0`); a padding mask's values against 0 / 1; equality of one tensor looked up at the
    query and at the key (HF's packed-sequence ids, whose own graph is not walked). Also when the
    graphs are too large to walk. Whether a read comparison is exactly causal order is checked on
    every chunk at run time."""
    seen: set[fx.Node] = set()
    windows: set[int] = set()
    stack = [m for m in masks if isinstance(m, fx.Node)]
    while stack:
        if len(seen) >= _MAX_NODES:
            raise NotAttention(f"the mask's graph has more than {_MAX_NODES} nodes; kvtopo cannot prove it causal")
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        key = _key(node)
        if model_tensor(node):
            raise NotAttention(f"the mask's graph reads `{node.name}`, a tensor of the model (a mask or table kept in a "
                               "buffer); what it holds beyond the chunk cannot be proven causal")
        if is_call(node, *_BLOCKS[0], methods=_BLOCKS[1]):
            raise _unread(node)
        if key in ("triu", torch.triu, "tril", torch.tril):
            diagonal = _int_constant(arg(node, 1, "diagonal", 0))
            if diagonal is None or diagonal > (1 if key in ("triu", torch.triu) else 0):
                raise _unread(node)
        if _reads_metadata(node):  # a size, dtype or device: no tensor values flow from its input
            continue
        if (window := _window_of(node)) is not None:
            windows.add(window)
        elif _is_comparison(node):
            lookups = _same_tensor_lookups(node)
            if lookups is not None:  # segment ids: walk the indices, not how the ids were made
                stack.extend(i for lookup in lookups for i in lookup.all_input_nodes if i is not lookup.args[0])
                continue
            if not (_causal_order(node) or _padding_values(node)):
                raise _unread(node)
        stack.extend(node.all_input_nodes)
    return windows


_METADATA = ((torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
              torch.ops.aten.sym_storage_offset.default), ("size", "dim", "numel", "stride", "get_device"))


def _reads_metadata(node: fx.Node) -> bool:
    """`x.size(1)`, `x.shape`, `x.dtype`, `x.device`: what a mask reads of a tensor without its values
    (a dynamic-shape graph builds its masks from the embeddings' sizes)."""
    if is_call(node, *_METADATA[0], methods=_METADATA[1]):
        return True
    return is_call(node, getattr) and len(node.args) == 2 and node.args[1] in ("shape", "dtype", "device")


def _unread(node: fx.Node) -> NotAttention:
    return NotAttention(
        f"the mask's graph holds `{_describe(node)}`, which is neither causal order, a sliding window nor "
        "padding (a block mask such as Llama-4's attention_chunk_size, a window written another way, a prefix?); "
        "a session would attend over the whole history where the model does not")


def _describe(node, depth: int = 2) -> str:
    """`eq(floordiv(sub_1, 8), floordiv(sub_2, 8))`: a node's op and arguments, two levels deep."""
    if not isinstance(node, fx.Node):
        return repr(node)
    if depth == 0 or node.op not in ("call_function", "call_method"):
        return node.name
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    args = [_describe(a, depth - 1) for a in node.args] + [f"{k}={_describe(v, depth - 1)}" for k, v in node.kwargs.items()]
    return f"{name}({', '.join(args)})"


def _is_comparison(node: fx.Node) -> bool:
    return is_call(node, *_COMPARISON_FUNCTIONS, methods=_COMPARISON_METHODS) and len(node.args) == 2


def _through_views(node):
    while isinstance(node, fx.Node) and is_call(node, *_VIEWS[0], methods=_VIEWS[1]) and (
            not is_call(node, operator.getitem, methods=("__getitem__",)) or not _indexes_by_tensor(node)):
        node = node.args[0]
    return node


def _indexes_by_tensor(node: fx.Node) -> bool:
    return any(isinstance(i, fx.Node) for i in _index_entries(node))


def _index_entries(node: fx.Node) -> tuple:
    index = node.args[1] if len(node.args) > 1 else None
    return index if isinstance(index, tuple) else (index,)


def _moved_index(node) -> bool:
    """An index moved, scaled or cut into blocks (`kv + W`, `q + t`, `2 * kv`, `q // c`), seen through
    views; adding 0 (HF's `arange + kv_offset`) is not a move."""
    node = _through_views(node)
    return is_call(node, *_SHIFTS[0], methods=_SHIFTS[1]) and not (
        len(node.args) == 2 and isinstance(node.args[0], fx.Node) and node.args[1] == 0
        and not isinstance(node.args[1], fx.Node) and is_call(node, operator.add, torch.add, methods=("add", "__add__")))


def _causal_order(node: fx.Node) -> bool:
    """`kv <= q` (or `<`, either way round) of two nodes neither shifted by a constant, or a
    difference of two such nodes against 0; not when the operands' shapes show the order runs
    the other way (keys after the query: a model seeing the future, which a cache cannot)."""
    if _key(node) in _EQUALITY:
        return False
    a, b = node.args
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        constant_first = not isinstance(a, fx.Node)
        difference, constant = (b, a) if constant_first else (a, b)
        difference = _through_views(difference)
        if constant != 0 or not _is_difference(difference):
            return False
        # x - y <= 0 (also written 0 >= x - y) reads x <= y; x - y >= 0 reads y <= x
        at_most_zero = (_key(node) in _LESS) != constant_first
        a, b = difference.args if at_most_zero else difference.args[::-1]
    elif _key(node) in _GREATER:
        a, b = b, a
    # now the comparison reads a <= b (or a < b): causal when a is the key's index, b the query's
    return _faces_back(a, b)


def _index_axis(node) -> str | None:
    """Which index a mask operand varies with: "query" (shape [..., T, 1]) or "key" ([..., 1, T]).
    Read from its shape, or, in a one-token graph where both are 1, from where the index was given
    its axis: `x[:, None]` / `unsqueeze(-1)` / `view(-1, 1)` make a query index, `x[None, :]` /
    `unsqueeze(0)` / `view(1, -1)` a key index; a lookup `table[b, i]` has the axis of its last
    index. None when neither tells."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if isinstance(value, torch.Tensor) and value.dim() >= 2:
        rows, cols = (n if isinstance(n, int) else None for n in value.shape[-2:])  # no int(): it would specialise
        if rows == 1 and cols != 1:
            return "key"
        if cols == 1 and rows != 1:
            return "query"
    for _ in range(_AXIS_STEPS):
        if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or not node.args:
            return None
        axis = _axis_given(node)
        if axis is not None:
            return axis
        if is_call(node, operator.getitem, methods=("__getitem__",)) and _indexes_by_tensor(node):
            node = [i for i in _index_entries(node) if isinstance(i, fx.Node)][-1]
        elif is_call(node, *_SHIFTS[0], methods=_SHIFTS[1]) or is_call(node, *_VIEWS[0], methods=_VIEWS[1]):
            node = node.args[0]
        else:
            return None
    return None


_AXIS_STEPS = 8


def _axis_given(node: fx.Node) -> str | None:
    """The axis a 1-D index gets from `node` (see `_index_axis`), None if `node` gives none."""
    if is_call(node, operator.getitem, methods=("__getitem__",)) and isinstance(node.args[1], tuple):
        kept = [i for i, entry in enumerate(node.args[1]) if entry is not None]
        if len(kept) == 1 and node.args[1][kept[0]] == slice(None):
            return {1: "key", 2: "query"}.get(len(node.args[1]) - kept[0])
    elif is_call(node, torch.unsqueeze, methods=("unsqueeze",)) and len(node.args) > 1:
        return {0: "key", -2: "key", 1: "query", -1: "query"}.get(node.args[1])
    elif is_call(node, torch.reshape, methods=("view", "reshape")):
        shape = tuple(node.args[1]) if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
        return {(-1, 1): "query", (1, -1): "key"}.get(tuple(shape))
    return None


def _padding_values(node: fx.Node) -> bool:
    """A graph input's values (an attention mask of 0/1) compared with 0 or 1."""
    a, b = node.args
    value, constant = (a, b) if isinstance(a, fx.Node) else (b, a)
    if not isinstance(value, fx.Node) or isinstance(constant, fx.Node) or constant not in (0, 1):
        return False
    source = _through_views(value)
    while is_call(source, operator.getitem, methods=("__getitem__",)):
        source = _through_views(source.args[0])
    return source.op == "placeholder"


def _same_tensor_lookups(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two lookups when `node` is `T[..., q] == T[..., kv]` (or !=): one tensor, two indices."""
    if _key(node) not in _EQUALITY:
        return None
    a, b = (_through_views(x) if isinstance(x, fx.Node) else x for x in node.args)
    if all(is_call(x, operator.getitem, methods=("__getitem__",)) and _indexes_by_tensor(x) for x in (a, b)) \
            and a.args[0] is b.args[0] and a.args[1] != b.args[1] and _is_cumsum(_through_views(a.args[0])):
        return a, b
    return None


def _is_cumsum(node) -> bool:
    """HF's packed-sequence ids: a running count of the places where positions restart."""
    return is_call(node, torch.cumsum, methods=("cumsum",))


def _key(node: fx.Node):
    return node.target if node.op in ("call_function", "call_method") else None


def _int_constant(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _sub_constant(node) -> int | None:
    """c when `node` is `x - c` for a node x and an int constant c."""
    if is_call(node, *SUB_OPS[0], methods=SUB_OPS[1]) and isinstance(node.args[0], fx.Node):
        return _int_constant(node.args[1])
    return None


def _is_difference(node) -> bool:
    """`a - b` of two nodes (an index difference)."""
    return (is_call(node, *SUB_OPS[0], methods=SUB_OPS[1]) and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[1], fx.Node))


def _window_of(node: fx.Node) -> int | None:
    key = _key(node)
    if key is None:
        return None
    if key in ("triu", torch.triu) or key in ("tril", torch.tril):
        diagonal = _int_constant(arg(node, 1, "diagonal", 0))
        if diagonal is None or diagonal >= 0:
            return None
        # triu(d) keeps j >= i + d: window 1 - d; tril(d) marks j <= i + d to remove: window -d.
        return 1 - diagonal if key in ("triu", torch.triu) else -diagonal
    if len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    try:
        greater, less = _GREATER.get(key), _LESS.get(key)
    except TypeError:  # unhashable target
        return None
    if greater is not None:  # a > b  (or >=)
        if (c := _sub_constant(b)) is not None and _faces_back(a, b.args[0]):  # kv > q - c
            return c + greater
        if (c := _int_constant(a)) is not None and _is_difference(b) and _faces_back(*b.args[::-1]):  # c > q - kv
            return c + greater
    if less is not None:  # a < b  (or <=)
        if (c := _sub_constant(a)) is not None and _faces_back(b, a.args[0]):  # q - c < kv
            return c + less
        if (c := _int_constant(b)) is not None and _is_difference(a) and _faces_back(*a.args[::-1]):  # q - kv < c
            return c + less
    return None


def _faces_back(key_index, query_index) -> bool:
    """Two plain token indices (neither scaled nor shifted by a constant), unless their shapes show
    them the other way round (the band would reach ahead)."""
    return (not _moved_index(key_index) and not _moved_index(query_index)
            and _index_axis(key_index) != "query" and _index_axis(query_index) != "key")
