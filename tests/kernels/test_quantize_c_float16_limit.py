"""The float16-statistics decision at float16's largest finite value, +-65504 itself: the C
`quantize` (kernels/csrc/quantize.cpp) and the torch version (kernels/quant.py
`float16_holds`: strictly inside, ``lo > -65504 and hi < 65504``) must take the same one, so that
both hold the same bytes.

tests/kernels/test_quantize_c.py's sweep of every float16 minimum never has a slice whose
extreme is exactly +-65504 while every other slice is inside the range (its tensors that reach
the limit also hold slices beyond it, which decide float32 whatever the limit's own side)."""

from __future__ import annotations

import pytest
import torch

from kvtopo.kernels import quant

from test_quantize_c import _same, torch_quantize

LIMIT = torch.finfo(torch.float16).max  # 65504


@pytest.mark.parametrize("bits", quant.SUPPORTED_BITS)
@pytest.mark.parametrize("end", [LIMIT, -LIMIT])
@pytest.mark.parametrize("reduce_dim", [0, 1])
def test_a_slice_reaching_the_float16_limit(bits, end, reduce_dim):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 9, generator=g) * 100
    x[2, 3] = end  # one slice's max (or min) is exactly the limit; every other value is far inside
    assert quant._c_quantize() is not None
    fast, reference = quant._in_c(x, bits, reduce_dim), torch_quantize(x, bits, reduce_dim)
    assert fast is not None and _same(fast, reference)
    assert fast.scale.dtype == torch.float32  # the limit itself is not strictly inside float16's range
    # one step inside the limit: float16 statistics, the same in both
    inside = x.clone()
    inside[2, 3] = torch.nextafter(torch.tensor(end), torch.tensor(0.0)).item()
    fast, reference = quant._in_c(inside, bits, reduce_dim), torch_quantize(inside, bits, reduce_dim)
    assert _same(fast, reference) and fast.scale.dtype == torch.float16
    assert (quant.dequantize(fast) - inside).abs().max() <= fast.scale.float().max()
