"""export/f16.py: float16 rounding in float32 arithmetic equals torch's casts and nextafter."""

import torch

from export_common import export_module
from kvtopo.kernels.quant import _round_toward


def _all_f16():
    v = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return v[torch.isfinite(v)]


def _same(a, b):
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def test_grid_rounding_matches_cast():
    f16 = export_module("f16")
    values = _all_f16()
    up = torch.nextafter(values, torch.full_like(values, float("inf")))
    midpoints = ((values.float() + up.float()) / 2)[torch.isfinite(up)]
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * torch.exp(
        torch.randn(200_000, generator=torch.Generator().manual_seed(1)) * 5)
    for sample in (values.float(), midpoints, x):
        assert _same(f16.to_f16_grid(sample), sample.to(torch.float16).float())


def test_nextafter_and_directed_rounding():
    f16 = export_module("f16")
    values = _all_f16()
    for d in (1.0, -1.0):
        ref = torch.nextafter(values, torch.full_like(values, d * float("inf"))).float()
        assert _same(f16.nextafter_f16(values.float(), d), ref)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(2)) * torch.exp(
        torch.randn(200_000, generator=torch.Generator().manual_seed(3)) * 5)
    for d in (1.0, -1.0):
        assert _same(f16.round_toward_f16(x, d), _round_toward(x, torch.float16, d * float("inf")).float())
