"""Rounding float32 to float16 values, without float16 tensors, nextafter or bit casts.

`kernels.quant` rounds Mid-page quantization statistics to float16 *toward* -inf (offsets) or
+inf (scales) with `.to(torch.float16)` and `torch.nextafter`. In an exported graph neither
works as such: ONNX has no nextafter, and onnxruntime's CPU provider (like other graph
compilers) drops a Cast float32 -> float16 -> float32 pair as "redundant", silently skipping the
rounding. So everything here is float32 arithmetic that lands on the float16 grid:

* round to nearest float16 (ties to even) — Veltkamp splitting: with ``g = x * (2**13 + 1)``,
  ``g - (g - x)`` is x rounded to 11 significant bits, float16's precision; below ``2**-14``
  (float16 subnormals: a fixed step of ``2**-24``) ``(x + 0.75) - 0.75`` rounds to that step;
  beyond 65520 the result is +-inf, as a float16 cast gives;
* the float16 neighbour of a float16 value ``a = m * 2**e`` (1 <= m < 2) away from zero is
  ``a + 2**(e-10)``, toward zero ``a - 2**(e-10)`` (``a - 2**(e-11)`` when m == 1). ``a * (1 ±
  1.25 * 2**-11)`` lands strictly inside the rounding interval of exactly that neighbour for
  every m, so rounding it to nearest yields it; below ``2**-13`` steps are ``2**-24``, added.

Checked against `torch.Tensor.to(float16)` and `torch.nextafter` on every finite float16 value
and every float16 midpoint, and on random float32 values (tests/export).
"""

from __future__ import annotations

import torch
from torch import Tensor

_FACTOR = 1.25 * 2.0**-11
_SMALL = 2.0**-13
_SUBNORMAL = 2.0**-14
_TINY_STEP = 2.0**-24
_F16_MAX = 65504.0
_OVERFLOW = 65520.0  # the midpoint past 65504: round-to-nearest gives inf from here


def to_f16_grid(x: Tensor) -> Tensor:
    """float32 x rounded to the nearest float16 value (ties to even), kept as float32."""
    g = x * 8193.0
    normal = g - (g - x)
    subnormal = (x + 0.75) - 0.75
    r = torch.where(x.abs() < _SUBNORMAL, subnormal, normal)
    return torch.where(x.abs() >= _OVERFLOW, x * float("inf"), r)


def nextafter_f16(r: Tensor, direction: float) -> Tensor:
    """The float16 neighbour of a float16 value r (float32) toward `direction` (+1.0 or -1.0)."""
    away = (r * direction > 0) | (r == 0)
    factor = torch.where(away, torch.full_like(r, 1.0 + _FACTOR), torch.full_like(r, 1.0 - _FACTOR))
    stepped = torch.where(r.abs() < _SMALL, r + direction * _TINY_STEP, r * factor)
    # An overflowed +-inf steps back to the largest finite float16, as nextafter does.
    stepped = torch.where(r.abs() > _F16_MAX, r.clamp(-_F16_MAX, _F16_MAX), stepped)
    return to_f16_grid(stepped)


def round_toward_f16(values: Tensor, direction: float) -> Tensor:
    """float32 values rounded to float16 toward `direction` (+1.0: up, -1.0: down), as float32.

    Equals `kernels.quant._round_toward(values, torch.float16, direction * inf).float()`.
    """
    rounded = to_f16_grid(values)
    wrong_side = (rounded - values) * direction < 0
    return torch.where(wrong_side, nextafter_f16(rounded, direction), rounded)
