"""An unprojected Mid segment whose values keep per-page, per-channel statistics (like its keys,
``value_stats_per_row=False``) decodes to the values it was quantized from, and the C decode
kernel attends over exactly those keys and values.

The store quantizes unprojected values per token (``value_stats_per_row=True``), but
``MidCodes`` and the kernels also take per-page value statistics (one scale and offset per page
and column, the layout every projected Mid uses). ``MidCodes.dense`` (what the float64 reference
and the CPU history tiles read) must apply each page's scale *and* offset to its rows; checked
against the pages dequantized one by one, and the kernel against float64 attention over them.
"""

from __future__ import annotations

import pytest
import torch

from kvtopo.kernels.cpu_decode import c_kernel_available, cpu_decode_attention
from kvtopo.kernels.decode_inputs import DecodeSegments
from kvtopo.kernels.quant import dequantize

from decode_bound import error_bound
from segments import unprojected_mid

HEADS, GROUP, DK, DV, SCALE = 2, 3, 16, 24, 0.3


def _mid(page_rows, bits: int, seed: int):
    """(MidCodes with per-page value statistics, keys [Hkv, N, dk], values [Hkv, N, dv]) where the
    keys/values are each page dequantized on its own (what the codes stand for)."""
    g = torch.Generator().manual_seed(seed)
    mid, pages = unprojected_mid(lambda *shape: torch.randn(*shape, generator=g), HEADS, DK, DV, page_rows, bits,
                                 value_stats_per_row=False)
    keys = torch.cat([dequantize(k) for k, _ in pages]).transpose(0, 1)
    values = torch.cat([dequantize(v) for _, v in pages]).transpose(0, 1)
    return mid, keys, values


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dense_applies_each_pages_value_statistics(bits):
    mid, keys, values = _mid((4, 1, 3, 4), bits, seed=bits)
    got_k, got_v = mid.dense()
    torch.testing.assert_close(got_k, keys, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_v, values, rtol=0, atol=1e-6)
    tile = mid.rows(3, 8)  # a history tile: rows of several pages, each still reading its own page
    torch.testing.assert_close(tile.dense()[1], values[:, 3:8], rtol=0, atol=1e-6)


@pytest.mark.skipif(not c_kernel_available(), reason="the CPU decode kernel did not build here")
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kernel_attends_the_pages_as_dequantized(bits):
    mid, keys, values = _mid((4, 1, 3, 4, 2), bits, seed=10 + bits)
    q = torch.randn(HEADS * GROUP, DK, generator=torch.Generator().manual_seed(bits))
    segs = DecodeSegments(mid=mid)
    out = cpu_decode_attention(q, segs, SCALE)
    logits = SCALE * q.double().reshape(HEADS, GROUP, DK) @ keys.double().transpose(1, 2)
    want = (torch.softmax(logits, -1) @ values.double()).reshape(HEADS * GROUP, DV)
    assert (out.double() - want).abs().max().item() <= error_bound(q, segs, SCALE)
