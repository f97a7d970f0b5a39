"""Quantization: the per-element error bound, the float16-statistics decision, and packing."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo.kernels.quant import (
    SUPPORTED_BITS,
    dequantize,
    pack,
    quantize,
    unpack,
)

EPS32 = torch.finfo(torch.float32).eps


@st.composite
def tensors_and_dims(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    reduce_dim = draw(st.integers(-ndim, ndim - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e5]))
    centre = draw(st.sampled_from([0.0, 1.0, -50.0]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * magnitude + centre
    return x.float(), reduce_dim


def _check_bound(x: torch.Tensor, bits: int, reduce_dim: int):
    q = quantize(x, bits, reduce_dim)
    levels = 2**bits - 1
    x64 = x.double()
    err = (dequantize(q).double() - x64).abs()
    scale = q.scale.double()
    # float32 arithmetic in quantize/dequantize: a few ulps of the magnitudes involved.
    slack = 4 * EPS32 * (x64.abs() + q.offset.double().abs() + levels * scale)
    assert torch.all(err <= scale / 2 + slack), (err - scale / 2).max()
    lo = x64.amin(reduce_dim, keepdim=True)
    ideal = (x64.amax(reduce_dim, keepdim=True) - lo) / levels
    ideal_slack = 4 * EPS32 * x64.abs().amax(reduce_dim, keepdim=True)
    if q.scale.dtype == torch.float16:
        # The offset's float16 step (relative 2**-10, absolute 2**-24 below the normal range;
        # twice that for an offset rounded down into the next binade), spread over the levels
        # and at least one step, then the scale rounded up to float16 (the same steps).
        step16 = 2 * torch.clamp(lo.abs() * 2.0**-10, min=2.0**-24)
        widest = torch.maximum(ideal + step16 / levels, step16)
        assert torch.all(scale <= widest * (1 + 2.0**-10) + 2.0**-24 + ideal_slack)
    else:
        assert torch.all(scale <= ideal + ideal_slack)
    return q


@settings(max_examples=150, deadline=None)
@given(tensors_and_dims(), st.sampled_from(SUPPORTED_BITS))
def test_error_within_half_scale(case, bits):
    x, reduce_dim = case
    q = _check_bound(x, bits, reduce_dim)
    per_byte = 8 // bits
    assert q.codes.dtype == torch.uint8
    assert q.codes.shape == (*x.shape[:-1], math.ceil(x.shape[-1] / per_byte))
    stats_shape = list(x.shape)
    stats_shape[reduce_dim] = 1
    assert q.scale.shape == q.offset.shape == tuple(stats_shape)
    assert dequantize(q).shape == x.shape and dequantize(q).dtype == torch.float32


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(SUPPORTED_BITS),
    st.lists(st.integers(0, 3), min_size=0, max_size=2),
    st.integers(0, 13),
    st.integers(0, 2**31 - 1),
)
def test_pack_round_trip_is_exact(bits, lead, length, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, length), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, math.ceil(length / (8 // bits)))
    assert torch.equal(unpack(packed, bits, length), codes)


def test_pack_layout_first_code_in_low_bits():
    assert pack(torch.tensor([1, 2, 3]), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack(torch.tensor([0xA, 0x5, 0x7]), 4).tolist() == [0x5A, 0x07]
    assert pack(torch.tensor([200, 7]), 8).tolist() == [200, 7]


@pytest.mark.parametrize("bits", [0, 1, 3, 16])
def test_unsupported_bits_raise_naming_the_value(bits):
    with pytest.raises(ValueError, match=f"got {bits}"):
        quantize(torch.randn(4, 4), bits, 0)
    with pytest.raises(ValueError, match=f"got {bits}"):
        pack(torch.zeros(4, dtype=torch.uint8), bits)


def test_empty_reduce_dimension_raises():
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.zeros(0, 4), 4, 0)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_nbytes_counts_codes_and_statistics(bits):
    x = torch.randn(64, 13)
    q = quantize(x, bits, reduce_dim=0)
    assert q.nbytes == q.codes.nbytes + q.scale.nbytes + q.offset.nbytes
    assert q.nbytes == 64 * math.ceil(13 * bits / 8) + 2 * 13 * 2  # float16 statistics


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(256, 16, generator=g),
        lambda g: torch.randn(256, 16, generator=g) * torch.logspace(1, -1, 16),
        lambda g: torch.randn(256, 16, generator=g) ** 3,
    ],
    ids=["normal", "decaying-energy", "heavy-tailed"],
)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("reduce_dim", [0, -1])
def test_centred_data_keeps_float16_statistics(make, bits, reduce_dim):
    x = make(torch.Generator().manual_seed(bits))
    q = _check_bound(x, bits, reduce_dim)
    assert q.scale.dtype == q.offset.dtype == torch.float16


@pytest.mark.parametrize(
    "x",
    [torch.randn(64, 16) * 0.01 + 5.0, torch.full((1, 16), 1.0001), torch.randn(64, 16) * 1e3],
    ids=["narrow-far-from-zero", "one-row", "large"],
)
def test_float16_statistics_wherever_float16_holds_them(x):
    """A scale wider than the float32 ideal is kept (within the offset's float16 step), so the
    choice does not depend on how narrow the slices are, only on float16's range."""
    q = _check_bound(x, 4, -1)
    assert q.scale.dtype == q.offset.dtype == torch.float16


def test_statistics_of_a_single_row_ignore_its_last_bits():
    """A range-0 slice (a page's one survivor) gets float16's own step as its scale, so values
    differing only in float32's last bits (two kernels' rounding) get the same statistics."""
    x = torch.randn(1, 256) * 3
    nudged = torch.nextafter(x, torch.full_like(x, float("inf")))
    a, b = quantize(x, 4, reduce_dim=0), quantize(nudged, 4, reduce_dim=0)
    same_offset = a.offset == b.offset
    assert same_offset.float().mean() > 0.99 and torch.equal(a.scale[same_offset], b.scale[same_offset])
    step = torch.nextafter(a.offset, torch.full_like(a.offset, float("inf"))) - a.offset
    assert torch.equal(a.scale, step)
    assert torch.all((dequantize(a) - x).abs() <= step.float() / 2)


def test_float32_statistics_beyond_float16_range():
    x = torch.randn(64, 16) * 1e5
    q = _check_bound(x, 4, -1)
    assert q.scale.dtype == q.offset.dtype == torch.float32


def test_constant_float16_slices_are_exact():
    x = torch.zeros(5, 7)
    x[2] = 1.5
    q = quantize(x, 2, reduce_dim=-1)
    assert torch.all(q.codes == 0)
    assert torch.equal(dequantize(q), x)


def test_int8_path_for_recent_pages():
    keys = torch.randn(16, 128)  # one Recent page: tokens x head_dim, one scale per token
    q = _check_bound(keys, 8, -1)
    assert q.codes.shape == keys.shape
    rel = (dequantize(q) - keys).norm() / keys.norm()
    assert rel < 0.01
