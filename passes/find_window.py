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
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_utils import ancestor_nodes, arg, is_call
from .site import NotAttention

_SUB = ((operator.sub, torch.sub), ("sub", "__sub__"))
# comparison -> (window when the difference is strict, when it is not)
_GREATER = {operator.gt: 0, torch.gt: 0, "gt": 0, "__gt__": 0, operator.ge: 1, torch.ge: 1, "ge": 1, "__ge__": 1}
_LESS = {operator.lt: 0, torch.lt: 0, "lt": 0, "__lt__": 0, operator.le: 1, torch.le: 1, "le": 1, "__le__": 1}
_MAX_NODES = 400  # mask graphs are small; stop walking long before reaching the model's layers


def mask_window(masks: list[fx.Node]) -> int | None:
    """The window the masks' graphs encode, None if they encode none; NotAttention if several."""
    windows = {w for node in ancestor_nodes(masks, _MAX_NODES) if (w := _window_of(node)) is not None}
    if len(windows) > 1:
        raise NotAttention(f"the mask's graph holds several sliding windows {sorted(windows)}")
    if windows and min(windows) < 1:
        raise NotAttention(f"the mask's graph holds a sliding window of {min(windows)} tokens")
    return windows.pop() if windows else None


def _key(node: fx.Node):
    return node.target if node.op in ("call_function", "call_method") else None


def _int_constant(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _sub_constant(node) -> int | None:
    """c when `node` is `x - c` for a node x and an int constant c."""
    if is_call(node, *_SUB[0], methods=_SUB[1]) and isinstance(node.args[0], fx.Node):
        return _int_constant(node.args[1])
    return None


def _is_difference(node) -> bool:
    """`a - b` of two nodes (an index difference)."""
    return (is_call(node, *_SUB[0], methods=_SUB[1]) and isinstance(node.args[0], fx.Node)
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
        if (c := _sub_constant(b)) is not None:  # kv > q - c
            return c + greater
        if (c := _int_constant(a)) is not None and _is_difference(b):  # c > q - kv
            return c + greater
    if less is not None:  # a < b  (or <=)
        if (c := _sub_constant(a)) is not None:  # q - c < kv
            return c + less
        if (c := _int_constant(b)) is not None and _is_difference(a):  # q - kv < c
            return c + less
    return None
