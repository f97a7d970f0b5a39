"""Directed rounding to float16 with graph-exportable ops (no `nextafter`, no bit casts).

`kernels.quant` rounds Mid-page quantization statistics to float16 *toward* -inf (offsets) or
+inf (scales) with `torch.nextafter`, which neither ONNX nor the torch-mlir lowerings offer.
The same result comes from arithmetic: for a float16 value ``a = m * 2**e`` (1 <= m < 2, normal
range) the neighbour away from zero is ``a + 2**(e-10)`` and the one toward zero is
``a - 2**(e-10)`` (``a - 2**(e-11)`` when m == 1). Multiplying ``a`` by ``1 ± 1.25 * 2**-11``
in float32 lands strictly inside the rounding interval of exactly that neighbour for every m
(the margins are at least a quarter of a float16 step, far above float32 rounding), so a
round-to-nearest cast back to float16 yields it. Below ``2**-13`` float16 steps are the constant
``2**-24`` (subnormals and the first binade above them), added directly. Checked against
`torch.nextafter` on every finite float16 value in both directions (tests/export).
"""

from __future__ import annotations

import torch
from torch import Tensor

_FACTOR = 1.25 * 2.0**-11
_SMALL = 2.0**-13
_TINY_STEP = 2.0**-24
_F16_MAX = 65504.0


def nextafter_f16(r: Tensor, direction: float) -> Tensor:
    """The float16 neighbour of float16 ``r`` toward ``direction`` (+1.0 or -1.0), as float16."""
    rf = r.float()
    away = (rf * direction > 0) | (rf == 0)
    factor = torch.where(away, torch.full_like(rf, 1.0 + _FACTOR), torch.full_like(rf, 1.0 - _FACTOR))
    stepped = torch.where(rf.abs() < _SMALL, rf + direction * _TINY_STEP, rf * factor)
    # An overflowed +-inf steps back to the largest finite float16, as nextafter does.
    stepped = torch.where(rf.abs() > _F16_MAX, rf.clamp(-_F16_MAX, _F16_MAX), stepped)
    return stepped.to(torch.float16)


def round_toward_f16(values: Tensor, direction: float) -> Tensor:
    """float32 ``values`` -> float16 rounded toward ``direction`` (+1.0: up, -1.0: down).

    Equals `kernels.quant._round_toward(values, torch.float16, direction * inf)` everywhere
    (overflow included: rounding toward zero from beyond the float16 range gives +-65504).
    """
    rounded = values.to(torch.float16)
    wrong_side = (rounded.float() - values) * direction < 0
    return torch.where(wrong_side, nextafter_f16(rounded, direction), rounded)
