"""The C `quantize` (kernels/csrc/quantize.cpp) against the torch version it replaces in the store:
the same codes and statistics, bit for bit, on every input it takes; the torch version for the
inputs it does not (a value that is not finite, a masked `quantize_float16`)."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtopo.kernels import quant


def torch_quantize(x, bits, reduce_dim, fn=quant.quantize, **kwargs):
    """`fn` (quant.quantize or quantize_float16) with the C version switched off for the call."""
    built = quant._c_quantize
    quant._c_quantize = lambda: None
    try:
        return fn(x, bits, reduce_dim, **kwargs)
    finally:
        quant._c_quantize = built


def _same(a: quant.Quantized, b: quant.Quantized) -> bool:
    return (a.codes.shape == b.codes.shape and torch.equal(a.codes, b.codes) and a.scale.dtype == b.scale.dtype
            and a.scale.shape == b.scale.shape and torch.equal(a.scale, b.scale)
            and torch.equal(a.offset, b.offset) and (a.bits, a.length) == (b.bits, b.length))


def test_c_quantize_builds():
    assert quant._c_quantize() is not None, "no C compiler? pages are then quantized by torch ops (slower)"


@st.composite
def inputs(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    shape = shape[:-1] + (draw(st.integers(1, 70)),)  # last dims that do and do not fill whole bytes
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    magnitude = 10.0 ** draw(st.floats(-9, 5.5))  # subnormal float16 statistics to beyond float16's range
    x = torch.randn(shape, generator=g) * magnitude + draw(st.sampled_from([0.0, 1.0, -3.0])) * magnitude
    kind = draw(st.sampled_from(["plain", "integers", "constant slice", "signed zeros"]))
    if kind == "integers":  # values on the grid: ties at half a level
        x = x.round()
    elif kind == "constant slice":  # half the values equal: slices of range 0 along any dimension
        x.view(-1)[: x.numel() // 2] = x.view(-1)[0].item()
    elif kind == "signed zeros":
        x[..., ::2] = 0.0
        x[..., 1::3] = -0.0
    return x, draw(st.integers(-ndim, ndim - 1)), draw(st.sampled_from(quant.SUPPORTED_BITS))


@settings(max_examples=300, deadline=None)
@given(case=inputs())
def test_same_bits_as_torch(case):
    x, reduce_dim, bits = case
    fast = quant._in_c(x, bits, reduce_dim)
    assert fast is not None
    assert _same(fast, torch_quantize(x, bits, reduce_dim))
    assert _same(quant.quantize(x, bits, reduce_dim), fast)


@pytest.mark.parametrize("bits", quant.SUPPORTED_BITS)
@pytest.mark.parametrize("nudge", [0.0, 1e-3, -1e-3])
def test_every_float16_offset(bits, nudge):
    """Every finite float16 value as a slice's minimum (nudge 0: on the float16 grid; otherwise
    between two float16 values, so the offset is rounded down one step), with a wide and a
    narrow range above it: each directed rounding and step of `_statistics`."""
    halves = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    lo = halves[torch.isfinite(halves)].float() * (1 + nudge)
    for width in (0.37, 1e-6):
        x = torch.stack([lo, lo + lo.abs() * width + 1e-7, lo + lo.abs() * width / 3], 1)
        inside = x.abs().amax(1) < 60000  # slices whose own statistics are float16
        float16 = torch_quantize(x[inside], bits, 1)
        assert float16.scale.dtype == torch.float16
        assert _same(quant._in_c(x[inside], bits, 1), float16)
        # all slices at once: float32 statistics where one slice passes float16's range
        assert _same(quant._in_c(x, bits, 1), torch_quantize(x, bits, 1))


@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_values_not_finite_take_the_torch_version(bad):
    x = torch.randn(3, 8, 16)
    x[1, 2, 3] = bad
    assert quant._in_c(x, 4, 1) is None
    fast, reference = quant.quantize(x, 4, 1), torch_quantize(x, 4, 1)
    assert torch.equal(fast.codes, reference.codes)
    assert torch.equal(fast.scale.isnan(), reference.scale.isnan())


def test_quantize_float16_agrees():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 24, generator=g)
    assert _same(quant.quantize_float16(x, 4, 1), torch_quantize(x, 4, 1, fn=quant.quantize_float16))
    x[2, 5, 7] = 70000.0  # beyond float16: both say None
    assert quant.quantize_float16(x, 4, 1) is None
    assert torch_quantize(x, 4, 1, fn=quant.quantize_float16) is None
    valid = torch.rand(4, 32, 1, generator=g) > 0.3  # masked: the torch version
    x[2, 5, 7] = 0.0
    assert _same(quant.quantize_float16(x, 4, 1, valid=valid),
                 torch_quantize(x, 4, 1, fn=quant.quantize_float16, valid=valid))


def test_build_failure_warns_once_and_quantizes_by_torch(tmp_path, monkeypatch):
    broken = tmp_path / "broken_quantize.cpp"
    broken.write_text("int main() { return undeclared_name; }\n")
    monkeypatch.setattr(quant, "C_SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))  # leaves the real build alone
    quant._c_quantize.cache_clear()
    x = torch.randn(3, 32, 64)
    try:
        with pytest.warns(RuntimeWarning, match=r"(?s)broken_quantize\.cpp failed.*undeclared_name"):
            first = quant.quantize(x, 4, 1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = quant.quantize(x, 4, 1)  # reported once, not per call
    finally:
        quant._c_quantize.cache_clear()
    reference = torch_quantize(x, 4, 1)
    assert _same(first, reference) and _same(second, reference)
