"""The kvtopo ops are effectful: inside a session each call appends its k/v to the session's store.

`kvtopo::attention` and `kvtopo::mla_attention` are declared functional (`mutates_args=()`), which
is true of their tensor arguments but not of what they do: `Session.attend` stores the step's new
keys and values for the layer, and a later step attends over them. Left as pure ops, the compiler
stack is free to treat them like any other function of their inputs, and in torch 2.13 it does:

- AOTAutograd's dead-code elimination drops a call whose output the graph never uses, and
  Inductor drops one whose output only feeds something it folds away (`0 * out`,
  `torch.zeros_like(out)`), so that layer's store never receives its k/v;
- Inductor's scheduler emits independent calls in whatever order suits it, so layers reach the
  session out of program order.

The standard remedy is torch's effect system: an op registered with `EffectType.ORDERED` is
traced by functionalization as `with_effects(token, op, ...)`, a token threaded from one such
call to the next. That makes every call live (the token is a graph output) and chains the calls
in program order (each reads the token the previous one wrote), through AOTAutograd's DCE/CSE,
Inductor's DCE and its scheduler (`ir.EffectfulKernel` depends on the previous effectful kernel).
CSE cannot merge two calls either, since each takes a different token.

Export is the exception. An exported program is cache-free: `ExportedProgram.run_decompositions(
DECOMPOSITIONS)` replaces the ops by plain aten attention, and the ONNX/MLIR exports replace them
by attention over explicit cache tensors. With the effect registered, functionalization wraps the
op in `with_effects` before the decomposition table is consulted, so the op would survive
`run_decompositions` undecomposed (inside the `with_effects` node, where a check of node targets
does not see it). So the effect is reported only while nothing is being exported
(`torch.compiler.is_exporting()`), which is when the op really runs against a session.
"""

from __future__ import annotations

import torch
from torch._library.effects import EffectHolder, EffectType
from torch._library.simple_registry import singleton

# Every op that reaches a session's store. (torch.library keys effects by "namespace::name".)
EFFECTFUL_OPS = ("kvtopo::attention", "kvtopo::mla_attention")


class _SessionEffect(EffectHolder):
    """The effect of an op that touches the session store: ORDERED, except while exporting."""

    @property
    def effect(self) -> EffectType | None:
        return None if torch.compiler.is_exporting() else EffectType.ORDERED

    @effect.setter
    def effect(self, _):
        raise RuntimeError("the kvtopo ops' effect is fixed (see kvtopo.kernels.effects)")


def register_effects() -> None:
    """Mark the kvtopo ops effectful for torch.compile (idempotent; called when ops.py is imported).

    The effect lives in the op's `EffectHolder` in torch.library's registry, which is what
    `torch.library._register_effectful_op` sets and what functionalization, `is_impure` and
    Inductor read; the holder installed here answers ORDERED, or None while exporting."""
    for qualname in EFFECTFUL_OPS:
        entry = singleton.find(qualname)
        if not isinstance(entry.effect, _SessionEffect):
            entry.effect = _SessionEffect(qualname)



register_effects()
