"""`kvtopo::positions`: a chunk's token positions, continued from what the session holds;
`kvtopo::given_positions`: positions the caller passed, checked against what it holds.

An HF decoder called without `position_ids` and without a cache numbers its tokens
`arange(T) + 0`, so a second chunk fed to a kvtopo-compiled model inside a session would get
positions 0..T-1 again although the session's store already holds the earlier tokens (HF's own
cache would start at its length). `passes/find_positions.py` routes that computed `arange` through
this op: outside a session it returns its input; inside one it adds the calling model's length
in the session (`Session.model_length(model_key)`: the batch's columns its forwards attended,
padding included, as HF's cache counts them; the model told by one of its parameters, as the
attention ops tell it).

The op reads session state that the attention ops write, so it is registered with the same
ORDERED effect as they are (kernels/effects.py): the compiler cannot fold `arange` + op into a
constant, drop it, or move it past an attention call. For export (cache-free graphs) it
decomposes to the identity, and the effect is withdrawn there like the attention ops'.

Positions the caller passes (`position_ids`, `cache_position`, a count a graph break left in
another graph, or the cos/sin of a rotary embedding computed from them in another graph) are the
caller's to get right, but one mistake is certain: every row numbered 0..T-1 again while the
session holds the model's earlier tokens. That is a forward recomputing the whole sequence (HF
`generate(use_cache=False)`, which would store it again each step), a new prompt in a session
that holds another, or a model that counts its positions in another graph than its attention
(CTRL; DBRX, whose blocks take the cos/sin): each would attend over a history its positions say
is not there. `kvtopo::given_positions` raises on it. It also checks positions a graph computes
from numbers of its own that cannot follow the store (a count from 2, by steps of 2, a table's rows
from 2): those raise when they start below the stored length plus their start over an empty store.
"""

from __future__ import annotations

import torch
from torch._library.simple_registry import singleton

from .store_hook import active_store

from .effects import _SessionEffect
from .ops import DECOMPOSITIONS


@torch.library.custom_op("kvtopo::positions", mutates_args=())
def positions(positions: torch.Tensor, model_key: torch.Tensor, real_tokens: bool = False) -> torch.Tensor:
    """`positions` (the chunk's positions counted from 0) shifted by the active session's length
    for the model `model_key` belongs to (the parameter its attention ops pass as their
    `model_key`); unchanged (a copy) outside a session. `real_tokens`: the positions count each
    row's real tokens ([B, T], OPT's count of its mask), so each row is shifted by the tokens it
    stores, its padding not counted (the batch's columns count it)."""
    session = active_store()
    if session is None:
        return positions.clone()
    if real_tokens:
        return positions + session.model_row_tokens(model_key, positions.shape[0]).to(positions.device)[:, None]
    return positions + session.model_length(model_key)


@positions.register_fake
def _positions_fake(positions, model_key, real_tokens=False):
    return torch.empty_like(positions)


def _positions_decomposition(positions, model_key, *flags, **named_flags):
    """Either op's identity, for export (`real_tokens` / `fixed` aside): a cache-free graph has no store."""
    return positions.clone()


@torch.library.custom_op("kvtopo::given_positions", mutates_args=())
def given_positions(positions: torch.Tensor, model_key: torch.Tensor, fixed: bool = False) -> torch.Tensor:
    """`positions` ([T] or [B, T], passed to the graph, or a rotary embedding's cos or sin computed
    from them, [..., T, D]) unchanged (a copy); raises inside a session that stores tokens for
    `model_key`'s model when every row of them restarts at 0. `fixed`: integer positions the graph
    computed from numbers of its own (`arange(T) + 2`, `arange(0, 2 * T, 2)`, a table's rows 2..T+1,
    or a start a cache gave): they do not follow the store, so they raise when a row starts below
    the stored length plus the start they had over an empty store, where a continuation's positions
    begin (`Session.computed_positions_start`)."""
    session = active_store()
    if session is None:
        return positions.clone()
    stored = session.model_length(model_key)
    tokens = positions.shape[-1 if _integer(positions) else -2]
    if fixed:
        start = int(positions.reshape(-1, tokens)[:, 0].min())
        empty_store_start = session.computed_positions_start(model_key, start)  # recorded while the store is empty
        wrong = bool(stored) and start < stored + empty_store_start
    else:
        wrong = bool(stored) and restart_at_zero(positions)
    if wrong:
        first = f"from {start}" if fixed else "from 0"
        raise RuntimeError(
            f"kvtopo: this forward numbers its {tokens} token(s) {first} while the session holds "
            f"{stored} earlier token(s) of this model: it would attend over a history its positions say is "
            "not there. A forward that recomputes the whole sequence (generate(use_cache=False)) or starts a "
            "new prompt needs a new session or session.clear(); a continuation's positions start at the "
            "stored length (kvtopo.generate and kvtopo.hf_cache pass them)"
            + (". These positions are computed in the graph from numbers of its own, which kvtopo cannot "
               "continue: pass position_ids instead" if fixed else "."))
    return positions.clone()


def restart_at_zero(positions: torch.Tensor) -> bool:
    """Every row of `positions` ([..., T]) is 0, 1, ..., T-1; for a rotary embedding's cos or sin
    ([..., T, D], or its complex form), every row's first token is at 0: only there is a row the same
    at every frequency (sin 0, cos the embedding's scale; the first frequency is 1 radian per
    position, so no other whole position gives a constant row)."""
    if not _integer(positions):
        first = positions[..., 0, :]
        return bool((first == first[..., :1]).all())
    count = torch.arange(positions.shape[-1], device=positions.device, dtype=positions.dtype)
    return bool((positions == count).all())


def _integer(positions: torch.Tensor) -> bool:
    return not (positions.is_floating_point() or positions.is_complex())


@given_positions.register_fake
def _given_positions_fake(positions, model_key, fixed=False):
    return torch.empty_like(positions)


DECOMPOSITIONS[torch.ops.kvtopo.positions.default] = _positions_decomposition
DECOMPOSITIONS[torch.ops.kvtopo.given_positions.default] = _positions_decomposition

for _qualname in ("kvtopo::positions", "kvtopo::given_positions"):
    _entry = singleton.find(_qualname)
    if not isinstance(_entry.effect, _SessionEffect):
        _entry.effect = _SessionEffect(_qualname)
