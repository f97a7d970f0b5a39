"""Asymmetric min/max low-bit quantization of KV-cache tensors.

Mid pages store principal-direction coefficients at 2, 4 or 8 bits; Recent pages store
keys/values at 8 bits. Both use the same scheme: along a chosen dimension, take the minimum
and maximum, spread ``2**bits`` evenly spaced levels between them, round each element to the
nearest level, and keep the codes plus one (scale, offset) pair per slice.

Why the statistics are reduced over a caller-chosen dimension: the error of an element is
bounded by half the scale of its slice, so a slice should group elements of similar range.
Key coefficients differ in range per principal direction (the first direction carries far
more energy than the tenth), so keys reduce over tokens (one scale per direction); value
coefficients are combined per token by the attention probabilities, so values reduce over
the coefficient dimension (one scale per token).

Why float16 statistics, and when not: the offset is rounded *down* and the scale *up* to
float16 before any code is computed, so the float16 grid ``offset + code * scale`` still
covers ``[min, max]``, codes never clamp, and every element is within half a *stored* scale
of its level. What float16 costs is a stored scale wider than the float32 ideal
``(max - min) / (2**bits - 1)`` by one float16 step of the offset divided by the levels, then
rounded up (and at least that step: see `_statistics`): the extra error is at most half a
float16 step of the values themselves, what storing them in float16 (an fp16 cache) costs.
So statistics are float16 whenever float16 can hold them, and float32 only when a scale
cannot hold the values (beyond +-65504). Not a fallback whenever a scale widens past some
tolerance: which tokens a page kept would flip that choice, so two executors of the same
lifecycle (the torch store, the exported compressor) whose near-tied eviction scores differ by
float rounding would hold different bytes; this way the bytes held follow from the token
counts unless a value leaves float16's range. The decision reads one boolean back from the
device per call.

Codes are packed into uint8 along the last dimension, ``8 // bits`` codes per byte, the
first code in the low bits; a last byte that is only partly used is zero-padded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 4, 8)

# `quantize` in one C call (csrc/quantize.cpp), for the store: a page move's four small tensors
# cost ~40 torch ops each here. IEEE flags (no fast-math, no contraction), so its codes and
# statistics are this module's bits; exported graphs trace the torch version.
C_SOURCE = Path(__file__).with_name("csrc") / "quantize.cpp"
C_FLAGS = ["-O3", "-march=native", "-ffp-contract=off"]

@dataclass(frozen=True, eq=False)
class Quantized:
    """Codes plus per-slice statistics of one quantized tensor.

    ``codes`` is uint8, packed along the last dimension (``length`` codes before packing).
    ``scale`` and ``offset`` have the input's shape with ``reduce_dim`` reduced to size 1,
    so they broadcast against the unpacked codes. An element decodes as
    ``offset + code * scale``.
    """

    codes: Tensor
    scale: Tensor
    offset: Tensor
    bits: int
    length: int

    @property
    def nbytes(self) -> int:
        """Bytes a cache spends to store this tensor: codes plus statistics."""
        return self.codes.nbytes + self.scale.nbytes + self.offset.nbytes


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes in ``[0, 2**bits)`` into uint8 along the last dimension.

    The last dimension is zero-padded up to a multiple of ``8 // bits``; ``unpack`` needs the
    original length to drop the padding. 8 bits: the codes as uint8, nothing to pack.
    """
    _check_bits(bits)
    per_byte = 8 // bits
    codes = codes.to(torch.uint8)
    if per_byte == 1:
        return codes
    pad = (-codes.shape[-1]) % per_byte
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    if per_byte == 2:  # two fields: one shift and one or (the general form's broadcast sum is slower)
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    # Code fields do not overlap, so the sum equals a bitwise or and stays below 256.
    return (grouped << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int, length: int) -> Tensor:
    """Inverse of ``pack``: uint8 codes of the last dimension's first ``length`` entries."""
    _check_bits(bits)
    if bits == 8:  # one code per byte: the bytes are the codes
        return packed[..., :length]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    fields = (packed.unsqueeze(-1) >> shifts) & mask
    return fields.flatten(-2)[..., :length]


def _round_toward(values: Tensor, dtype: torch.dtype, direction: float) -> Tensor:
    """Convert float32 ``values`` to ``dtype``, rounding toward ``direction`` (±inf)."""
    rounded = values.to(dtype)
    wide = rounded.float()
    wrong_side = wide > values if direction < 0 else wide < values  # rounded past the value
    stepped = torch.nextafter(rounded, torch.full_like(rounded, direction))
    return torch.where(wrong_side, stepped, rounded)


def float16_holds(lo: Tensor, hi: Tensor) -> Tensor:
    """Whether float16 statistics (`_statistics`) suit slices with range [lo, hi]: both ends
    within float16's finite range (beyond it the offset saturates at +-65504 and the scale
    would have to span the gap). A 0-d bool tensor of comparisons only (false on nan), so
    exported graphs trace the same decision."""
    limit = torch.finfo(torch.float16).max
    return ((lo > -limit) & (hi < limit)).all()


def _statistics(lo: Tensor, hi: Tensor, levels: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Offset and scale in ``dtype`` whose grid covers [lo, hi].

    float32: the exact min and ``(max - min) / levels``. float16: the offset rounded down, and
    the scale rounded up from ``(max - min + step) / levels``, where ``step`` is float16's
    spacing just above the offset (``lo - offset < step``, so the grid reaches ``max``), and
    never below ``step`` itself: a slice narrower than float16's resolution at its offset (a
    page's single survivor, range 0) gets the grid float16 storage of its values would have.
    A finer one would only resolve what float16 cannot (the last bits of whichever kernel
    computed the values), so two executors of one lifecycle would store different scales."""
    if dtype == torch.float32:
        return lo, (hi - lo) / levels
    offset = _round_toward(lo, dtype, -float("inf"))
    step = torch.nextafter(offset, torch.full_like(offset, float("inf"))).float() - offset.float()
    scale = _round_toward(torch.maximum((hi - lo + step) / levels, step), dtype, float("inf"))
    return offset, scale


def quantize(x: Tensor, bits: int, reduce_dim: int) -> Quantized:
    """Quantize ``x`` to ``bits`` per element with min/max statistics over ``reduce_dim``.

    Each element is rounded to the nearest level, so ``|dequantize(q) - x| <= q.scale / 2``
    elementwise (up to float32 arithmetic rounding). Statistics are float16 unless a value
    is beyond float16's range, then float32 for the whole tensor (see the module docstring).
    """
    x = _checked(x, bits, reduce_dim)
    coded = _in_c(x, bits, reduce_dim)
    if coded is not None:
        return coded
    lo = x.amin(dim=reduce_dim, keepdim=True)
    hi = x.amax(dim=reduce_dim, keepdim=True)
    return _encode(x, lo, hi, bits, torch.float16 if float16_holds(lo, hi).item() else torch.float32)


def quantize_float16(x: Tensor, bits: int, reduce_dim: int, valid: Tensor | None = None) -> Quantized | None:
    """``quantize`` when its statistics are float16; None when some slice is beyond float16's
    range (where ``quantize`` would take float32 for the whole tensor).

    For quantizing many tensors (pages) as one: stacked, their slices are quantized as each
    one's own ``quantize`` would, as long as all of them take float16 statistics, which is
    what a non-None result says. ``valid``: a bool mask broadcastable to ``x``; elements
    outside it are padding, left out of the statistics (their codes mean nothing).
    """
    x = _checked(x, bits, reduce_dim)
    coded = _in_c(x, bits, reduce_dim) if valid is None else None
    if coded is not None:
        return coded if coded.scale.dtype == torch.float16 else None
    lo = (x if valid is None else x.masked_fill(~valid, float("inf"))).amin(dim=reduce_dim, keepdim=True)
    hi = (x if valid is None else x.masked_fill(~valid, -float("inf"))).amax(dim=reduce_dim, keepdim=True)
    if not float16_holds(lo, hi).item():
        return None
    return _encode(x, lo, hi, bits, torch.float16)


@functools.cache
def _c_quantize():
    """The C `quantize`, or None: KVTOPO_NO_CKERNEL set, or the build failed (warned once)."""
    from .cpu_decode import built_or_warned  # it imports this module

    built = built_or_warned(C_SOURCE, "kvtopo_quantize", C_FLAGS, "pages are quantized by torch ops")
    return None if built is None else built.quantize


def _in_c(x: Tensor, bits: int, reduce_dim: int) -> Quantized | None:
    """`quantize` of float32 `x` by the C version, where it applies (a CPU tensor outside autograd,
    every value finite); None otherwise."""
    if x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()) or _c_quantize() is None:
        return None
    coded = _c_quantize()(x.contiguous(), bits, reduce_dim % x.dim())
    if coded is None:
        return None
    codes, scale, offset = coded
    return Quantized(codes=codes, scale=scale, offset=offset, bits=bits, length=x.shape[-1])


def _checked(x: Tensor, bits: int, reduce_dim: int) -> Tensor:
    _check_bits(bits)
    if x.shape[reduce_dim] == 0:
        raise ValueError(f"cannot quantize over empty dimension {reduce_dim} of shape {tuple(x.shape)}")
    return x.float()


def _encode(x: Tensor, lo: Tensor, hi: Tensor, bits: int, dtype: torch.dtype) -> Quantized:
    """Codes of float32 ``x`` on the grid of statistics in ``dtype`` covering [lo, hi] per slice."""
    levels = (1 << bits) - 1
    offset, scale = _statistics(lo, hi, levels, dtype)
    # A zero scale means every element of the slice equals the offset: all codes are 0.
    step = torch.where(scale > 0, scale.float(), torch.ones_like(lo))
    codes = torch.round((x - offset.float()) / step).clamp_(0, levels)
    return Quantized(
        codes=pack(codes, bits),
        scale=scale,
        offset=offset,
        bits=bits,
        length=x.shape[-1],
    )


def dequantize(q: Quantized) -> Tensor:
    """Float32 reconstruction ``offset + code * scale``."""
    codes = unpack(q.codes, q.bits, q.length)
    return torch.addcmul(q.offset.float(), codes.float(), q.scale.float())
