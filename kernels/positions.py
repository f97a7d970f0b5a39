"""`kvtopo::positions`: a chunk's token positions, continued from what the session holds.

An HF decoder called without `position_ids` and without a cache numbers its tokens
`arange(T) + 0`, so a second chunk fed to a kvtopo-compiled model inside a session would get
positions 0..T-1 again although the session's store already holds the earlier tokens (HF's own
cache would start at its length). `passes/find_positions.py` routes that computed `arange` through
this op: outside a session it returns its input; inside one it adds the number of tokens the
session stores for the calling model (`Session.model_length(model_key)`, the model told by one of
its parameters, as the attention ops tell it), as HF's cache does.

The op reads session state that the attention ops write, so it is registered with the same
ORDERED effect as they are (kernels/effects.py): the compiler cannot fold `arange` + op into a
constant, drop it, or move it past an attention call. For export (cache-free graphs) it
decomposes to the identity, and the effect is withdrawn there like the attention ops'.
"""

from __future__ import annotations

import torch
from torch._library.simple_registry import singleton

from .store_hook import active_store

from .effects import _SessionEffect
from .ops import DECOMPOSITIONS


@torch.library.custom_op("kvtopo::positions", mutates_args=())
def positions(positions: torch.Tensor, model_key: torch.Tensor) -> torch.Tensor:
    """`positions` (the chunk's positions counted from 0) shifted by the tokens the active session
    stores for the model `model_key` belongs to (the parameter its attention ops pass as their
    `model_key`); unchanged (a copy) outside a session."""
    session = active_store()
    if session is None:
        return positions.clone()
    return positions + session.model_length(model_key)


@positions.register_fake
def _positions_fake(positions, model_key):
    return torch.empty_like(positions)


def _positions_decomposition(positions, model_key):
    return positions.clone()


DECOMPOSITIONS[torch.ops.kvtopo.positions.default] = _positions_decomposition

_entry = singleton.find("kvtopo::positions")
if not isinstance(_entry.effect, _SessionEffect):
    _entry.effect = _SessionEffect("kvtopo::positions")
