"""Find hand-written attention: matmul -> scale -> (+mask | where(mask)) -> softmax -> matmul.

This is HF "eager" attention (with or without an fp32 softmax upcast) and GPT-2's older
`where(causal_mask, scores, min)` form, and gpt-oss's attention sinks: a per-head parameter
joined to the scores as one more column (`cat([scores, sinks.reshape(1, -1, 1, 1).expand(...)],
-1)`, less the row max), whose probability column is dropped before the value matmul. Anything
else between the two matmuls — a tensor multiplied into the scores, a fill that is not -inf-like,
the probabilities mixed with another tensor or used elsewhere, a sink column that is not a
per-head parameter — makes the candidate a refusal, never a rewrite.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .find_window import mask_window
from .graph_utils import MUL_OPS as _MUL
from .graph_utils import SUB_OPS as _SUB
from .graph_utils import (MASK_FLOOR, ActivationSources, _weight_placeholder, arg, attention_shapes, built_from_mask,
                          check_self_attention, collect_sites, constant_value, floating_cast, is_call, meta_tensor,
                          skip_casts, strip_repeat_kv, symbolic_float)
from .graph_utils import in_group as _is
from .site import AttentionSite, NotAttention, Refusal

_SOFTMAX = ((F.softmax, torch.softmax), ("softmax",))
_MATMUL = ((torch.matmul, operator.matmul), ("matmul", "__matmul__"))
# Products that also score queries against keys, in forms the rewrite does not take (heads merged
# into the batch axis, XGLM's `bmm`; an added bias, BLOOM's `baddbmm`; `einsum` subscripts).
_OTHER_PRODUCTS = ((torch.bmm, torch.baddbmm, torch.einsum), ("bmm", "baddbmm"))
_DIV = ((operator.truediv, torch.div), ("div", "__truediv__"))
# `scores /= c` (Falcon's eager attention) and `scores *= c`: a scale when no other node reads
# the scores the op overwrites.
_IN_PLACE_DIV = ((operator.itruediv,), ("div_", "__itruediv__"))
_IN_PLACE_MUL = ((operator.imul,), ("mul_", "__imul__"))
_ADD = ((operator.add, torch.add), ("add", "__add__"))
_CAT = ((torch.cat, torch.concat, torch.concatenate), ())
_SHAPE_OPS = ("reshape", "view", "unsqueeze", "expand")


def find_eager_sites(gm: fx.GraphModule) -> tuple[list[AttentionSite], list[Refusal]]:
    # A softmax not fed by a product of tensors (e.g. an MoE router's over linear logits) is not
    # attention at all; one fed by a product other than matmul is attention the rewrite refuses.
    return collect_sites(gm, "eager", is_attention_softmax, _match)


def is_attention_softmax(node: fx.Node) -> bool:
    return _is(node, _SOFTMAX) and _product_above(node) is not None


def _product_above(softmax: fx.Node, depth: int = 8) -> fx.Node | None:
    """The nearest tensor product (matmul, bmm, baddbmm, einsum) within `depth` nodes above the
    softmax: a softmax fed by one is an attention candidate."""
    frontier = [softmax]
    for _ in range(depth):
        frontier = [inp for n in frontier for inp in n.all_input_nodes]
        for node in frontier:
            if _is(node, _MATMUL) or _is(node, _OTHER_PRODUCTS):
                return node
    return None


def _single_user(node: fx.Node, what: str) -> fx.Node:
    if len(node.users) != 1:
        raise NotAttention(f"{what} ({node.name}) is also used elsewhere ({len(node.users)} users)")
    return next(iter(node.users))


def _match(softmax: fx.Node, layer: str, sources: ActivationSources) -> AttentionSite:
    product = _product_above(softmax)
    if _is(product, _OTHER_PRODUCTS):
        raise NotAttention(f"scores come from {_describe(product)}, not a matmul of [batch, heads, tokens, dim] "
                           "query and key (heads merged into the batch axis, or a bias added in the product)")
    dim = arg(softmax, 1, "dim")
    rank = meta_tensor(softmax).dim()
    if dim not in (-1, rank - 1):
        raise NotAttention(f"softmax over dim {dim}, not the key axis (-1)")
    output, value, dropped = _probabilities_to_output(softmax)
    logits, sink_column = skip_casts(softmax.args[0]), None
    if dropped is not None:
        logits, sink_column = _split_sink_column(logits, dropped)
    query, key_t, masks, scale, softcap = _scores_from_logits(logits)
    key = _untranspose(key_t)
    key, _ = strip_repeat_kv(key)
    value, _ = strip_repeat_kv(value)
    check_self_attention(sources, query, key, value)
    heads, kv_heads, head_dim, value_dim = attention_shapes(query, key, value)
    sinks = _sink_parameter(sink_column, heads, logits) if sink_column is not None else None
    kinds = sorted(kind for _, kind in masks)
    if len(masks) > 2 or kinds.count("additive") > 1 or (len(masks) == 2 and "additive" not in kinds):
        raise NotAttention(f"{len(masks)} masks ({', '.join(kinds)}) are applied to the scores")
    return AttentionSite(
        layer=layer, pattern="eager", query=query, key=key, value=value, masks=tuple(masks),
        scale=scale, is_causal=False, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        value_head_dim=value_dim, output=output, window=mask_window([m for m, _ in masks]) if masks else None,
        softcap=softcap, sinks=sinks,
    )


def _probabilities_to_output(softmax: fx.Node) -> tuple[fx.Node, fx.Node, str | None]:
    """Follow the probabilities through casts, inference dropout and the drop of one end column
    (an attention sink's) to `matmul(p, v)`; also which column was dropped ("last", "first", None)."""
    node, dropped = softmax, None
    while True:
        user = _single_user(node, "attention probabilities")
        if floating_cast(user) or _is_inference_dropout(user):
            node = user
            continue
        if dropped is None and (side := _dropped_column(user)) is not None:
            node, dropped = user, side
            continue
        if _is(user, _MATMUL) and user.args[0] is node:
            return user, user.args[1], dropped
        raise NotAttention(f"attention probabilities are combined with {_describe(user)} before the value matmul")


def _dropped_column(node: fx.Node) -> str | None:
    """"last" for `p[..., :-1]`, "first" for `p[..., 1:]` (any spelling of the leading axes), else None."""
    if not is_call(node, operator.getitem) or not isinstance(node.args[1], tuple) or not node.args[1]:
        return None
    *lead, last = node.args[1]
    full = slice(None)
    if lead != [Ellipsis] and not (all(i == full for i in lead) and len(lead) == meta_tensor(node.args[0]).dim() - 1):
        return None
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    if last.start in (None, 0) and last.stop == -1:
        return "last"
    if last.start == 1 and last.stop is None:
        return "first"
    return None


def _split_sink_column(logits: fx.Node, dropped: str) -> tuple[fx.Node, fx.Node]:
    """(scores, sink column) of softmax logits `cat([scores, sinks], -1)` whose `dropped` column
    the probabilities lose, with or without the row max subtracted (the softmax cancels it)."""
    joined, row_max = _strip_row_max(logits)
    if not _is(joined, _CAT):
        raise NotAttention(f"a probability column is dropped but the softmax's logits are {_describe(joined)}, "
                           "not scores joined with a sink column")
    users = set(joined.users)
    if (row_max is None and len(users) != 1) or (row_max is not None and not users <= {logits, row_max}):
        raise NotAttention(f"the logits joined with the sinks ({joined.name}) are also used elsewhere")
    tensors, dim = arg(joined, 0, "tensors"), arg(joined, 1, "dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or dim not in (-1, meta_tensor(joined).dim() - 1):
        raise NotAttention(f"the softmax's logits are {_describe(joined)}, not [scores ; one sink column] on the key axis")
    scores, column = tensors if dropped == "last" else tensors[::-1]
    if not isinstance(column, fx.Node) or meta_tensor(column).shape[-1] != 1:
        raise NotAttention(f"the dropped {dropped} column is {_describe(column)}, not one sink logit per row")
    return skip_casts(scores), column


def _strip_row_max(node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(x, the max node) when `node` is `x - x.max(-1, keepdim=True).values` (or `amax`), else (node, None)."""
    if not _is(node, _SUB) or not isinstance(node.args[0], fx.Node):
        return node, None
    x, m = node.args[0], node.args[1]
    while is_call(m, torch.detach, methods=("detach",)):
        m = m.args[0]
    if is_call(m, operator.getitem) and m.args[1] == 0 and is_call(m.args[0], torch.max, methods=("max",)):
        row_max = m.args[0]
    elif is_call(m, torch.amax, methods=("amax",)):
        row_max = m
    else:
        return node, None
    dim, keepdim = arg(row_max, 1, "dim"), arg(row_max, 2, "keepdim", False)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if row_max.args[0] is not x or keepdim is not True or dim not in (-1, meta_tensor(x).dim() - 1):
        return node, None
    return x, row_max


def _sink_parameter(column: fx.Node, heads: int, scores: fx.Node) -> fx.Node:
    """The [Hq] parameter behind a sink column [B, Hq, T, 1], e.g. `sinks.reshape(1, -1, 1, 1)
    .expand(B, -1, T, -1)`: only reshapes that keep head h on axis -3 and broadcasts over the rest."""
    want = tuple(meta_tensor(scores).shape[:-1])
    got = tuple(meta_tensor(column).shape)
    if len(got) != len(want) + 1 or str(got[:-1]) != str(want):
        raise NotAttention(f"the sink column has shape {got}, not the scores' rows {want} with one logit each")
    node = skip_casts(column)
    while is_call(node, torch.reshape, torch.unsqueeze, methods=_SHAPE_OPS):
        shape = tuple(meta_tensor(node).shape)
        if len(shape) < 3 or shape[-3] != heads or (not is_call(node, methods=("expand",))
                                                    and any(n != 1 for i, n in enumerate(shape) if i != len(shape) - 3)):
            raise NotAttention(f"the sinks pass through {_describe(node)} of shape {shape}, not a per-head [Hq] "
                               "vector placed on the head axis")
        node = skip_casts(node.args[0])
    if not (isinstance(node, fx.Node) and node.op == "placeholder" and _weight_placeholder(node)):
        raise NotAttention(f"the sink column comes from {_describe(node)}, not a per-head parameter")
    shape = tuple(meta_tensor(node).shape)
    if shape != (heads,):
        raise NotAttention(f"the sink parameter {node.name} has shape {shape}, not one logit per query head ({heads})")
    return node


def _is_inference_dropout(node: fx.Node) -> bool:
    if not is_call(node, F.dropout):
        return False
    p, training = arg(node, 1, "p", 0.5), arg(node, 2, "training", True)
    if training is False or p == 0:
        return True
    raise NotAttention(f"attention dropout p={p} training={training} is not inference attention")


def _scores_from_logits(node: fx.Node):
    """Walk up from the softmax's logits to `matmul(q, k^T)`, collecting masks, the scale and a
    logit softcap (`cap * tanh(scores / cap)`, applied after the scale and before the masks)."""
    masks: list[tuple[fx.Node, str]] = []
    scale = 1.0
    softcap = None
    scaled = False  # walking upwards: a mask met after a scale was applied to masked scores
    while True:
        if _is(node, _MATMUL):
            return node.args[0], node.args[1], masks, scale, softcap
        _single_user(node, "attention scores")
        if softcap is None and not scaled and (capped := _softcap(node)) is not None:
            softcap, node = capped
            continue
        if softcap is not None and (_is(node, _ADD) or is_call(node, torch.where)
                                    or is_call(node, torch.masked_fill, methods=("masked_fill",))):
            raise NotAttention("a mask is applied inside the logit softcap's tanh")
        divides = _is(node, _DIV) or _is(node, _IN_PLACE_DIV)
        in_place = _is(node, _IN_PLACE_DIV) or _is(node, _IN_PLACE_MUL)
        if divides or in_place or _is(node, _MUL):
            a, b = node.args[0], node.args[1]
            scores, other = (a, b) if not symbolic_float(a) and isinstance(a, fx.Node) else (b, a)
            if divides:
                _require_true_division(node, numerator=scores)
            if in_place:
                _single_user(scores, "scores scaled in place")
            if symbolic_float(other) and not divides and scale == 1.0 and not scaled:
                scale = other  # the only scale: a Python float Dynamo made an input, taken by the op as is
            elif symbolic_float(other) or isinstance(scale, fx.Node):
                raise NotAttention(f"the scores are scaled by a Python float input ({_describe(node)}) together with "
                                   "another factor; only a lone multiplier is taken as the scale")
            elif (factor := constant_value(other)) is None or not isinstance(scores, fx.Node):
                raise NotAttention(f"scores are multiplied by a tensor ({_describe(node)}), not a constant scale")
            else:
                scale = scale / factor if divides else scale * factor
            scaled = True
            node = skip_casts(scores)
        elif scaled and (_is(node, _ADD) or is_call(node, torch.where)
                         or is_call(node, torch.masked_fill, methods=("masked_fill",))):
            raise NotAttention("the scale is applied after the mask")
        elif _is(node, _ADD):
            scores, mask = _split_scores(node.args[0], node.args[1])
            if not built_from_mask(mask):
                raise NotAttention(f"the scores add {_describe(mask)}, a tensor not built from a mask (a "
                                   "positional bias such as ALiBi?), which a session cannot carry into the history")
            masks.append((mask, "additive"))
            node = skip_casts(scores)
        elif is_call(node, torch.where):
            cond, scores, fill = node.args[:3]
            _require_mask_fill(fill, "where()")
            masks.append((cond, "bool"))
            node = skip_casts(scores)
        elif is_call(node, torch.masked_fill, methods=("masked_fill",)):
            scores, cond, fill = node.args[:3]
            _require_mask_fill(fill, "masked_fill()")
            masks.append((cond, "bool_inverted"))
            node = skip_casts(scores)
        else:
            raise NotAttention(f"scores pass through {_describe(node)} between the matmul and the softmax")


def _softcap(node: fx.Node) -> tuple[float, fx.Node] | None:
    """(cap, scores) when `node` is `tanh(scores / cap) * cap` (or `* (1 / cap)` inside), else None."""
    if not _is(node, _MUL):
        return None
    a, b = node.args[0], node.args[1]
    cap, outer = (constant_value(b), a) if isinstance(a, fx.Node) else (constant_value(a), b)
    tanh = skip_casts(outer)
    if cap is None or not is_call(tanh, torch.tanh, methods=("tanh",)):
        return None
    _single_user(tanh, "softcapped scores")
    inner = skip_casts(tanh.args[0])
    _single_user(inner, "scores divided by the softcap")
    x, y = inner.args[0], inner.args[1] if len(inner.args) > 1 else None
    divisor = None
    if _is(inner, _DIV):
        _require_true_division(inner, numerator=x)
        divisor = constant_value(y)
    if _is(inner, _MUL):
        factor, x = (constant_value(y), x) if isinstance(x, fx.Node) else (constant_value(x), y)
        divisor = 1.0 / factor if factor else None
    if divisor is None or not isinstance(x, fx.Node) or abs(divisor - cap) > 1e-6 * abs(cap) or cap <= 0:
        raise NotAttention(f"scores pass through tanh ({tanh.name}) but not as `cap * tanh(scores / cap)`")
    return cap, skip_casts(x)


def _require_true_division(div: fx.Node, numerator) -> None:
    """A division of the scores is a scale only as `scores / c` with no rounding: `c / scores`
    and `div(..., rounding_mode=...)` are other functions of the scores."""
    if div.args[0] is not numerator:
        raise NotAttention(f"the scores are the divisor of {_describe(div)}, not divided by a scale")
    if (mode := div.kwargs.get("rounding_mode")) is not None:
        raise NotAttention(f"the scores are divided with rounding_mode={mode!r} ({_describe(div)}), not scaled")


def _split_scores(a, b) -> tuple[fx.Node, fx.Node]:
    """Which operand of `a + b` is the score chain (leads to matmul) and which the mask."""
    for scores, mask in ((a, b), (b, a)):
        if isinstance(scores, fx.Node) and _leads_to_matmul(scores):
            if not isinstance(mask, fx.Node):
                raise NotAttention(f"a constant ({mask!r}) is added to the scores")
            return scores, mask
    raise NotAttention("neither operand of the score addition comes from a q·k matmul")


def _leads_to_matmul(node) -> bool:
    node = skip_casts(node)
    while _is(node, _MUL) or _is(node, _DIV) or _is(node, _IN_PLACE_MUL) or _is(node, _IN_PLACE_DIV) \
            or _is(node, _ADD) or is_call(node, torch.where) \
            or is_call(node, torch.masked_fill, methods=("masked_fill",)) or is_call(node, torch.tanh, methods=("tanh",)):
        args = [a for a in node.args[:3] if isinstance(a, fx.Node)]
        if not args:
            return False
        node = skip_casts(args[0] if not is_call(node, torch.where) else node.args[1])
    return _is(node, _MATMUL)


def _require_mask_fill(fill, what: str) -> None:
    value = constant_value(fill)
    if value is None or value > MASK_FLOOR:  # a fill above it is a bias, not a mask
        raise NotAttention(f"{what} fills the scores with {fill!r}, not a large negative value: not a mask")


def _untranspose(key_t) -> fx.Node:
    """k from k^T: transpose of the last two dims, or the equivalent permute."""
    if is_call(key_t, torch.transpose, methods=("transpose",)):
        dims = {arg(key_t, 1, "dim0"), arg(key_t, 2, "dim1")}
        if dims in ({-1, -2}, {2, 3}):
            return key_t.args[0]
    if is_call(key_t, torch.permute, methods=("permute",)):
        perm = tuple(key_t.args[1]) if isinstance(key_t.args[1], (tuple, list)) else tuple(key_t.args[1:])
        if perm == (0, 1, 3, 2):
            return key_t.args[0]
    raise NotAttention(f"the score matmul's right operand is {_describe(key_t)}, not a transposed key")


def _describe(node) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{target} ({node.name})"
