"""Mid statistics are float16 until a page's values need float32 (beyond float16's range): the
rows already held must widen with them (`GrowingRows.append`), never narrow the new ones to
float16 (inf scale/offset: the page decodes to inf/NaN). Checked against each page's own min/max
grid in float64, for statistics per page (keys) and per row (unprojected values)."""

import pytest
import torch

from kvtopo.runtime.codecs import CodedRows, GrowingRows


def test_growing_rows_widen_to_the_rows_appended():
    rows = GrowingRows()
    rows.append(torch.ones(3, 2, dtype=torch.float16))
    big = torch.full((2, 2), 1e6, dtype=torch.float32)
    rows.append(big)
    assert rows.tensor.dtype == torch.float32
    assert torch.equal(rows.tensor[3:], big) and torch.equal(rows.tensor[:3], torch.ones(3, 2))


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_page_beyond_float16_range_after_small_pages_decodes_on_its_own_grid(per_row, bits):
    g = torch.Generator().manual_seed(0)
    pages = [torch.randn(5, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g) * 1e6 + 3e5,
             torch.randn(3, 2, 8, generator=g)]
    coded = CodedRows(bits=bits, per_row_stats=per_row, float_dtype=torch.float32)
    for page in pages:
        coded.append(page)
    decoded = coded.decode().double()
    assert torch.isfinite(decoded).all()
    start = 0
    for page in pages:
        x = page.double()
        n = x.shape[0]
        lo, hi = (x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)) if per_row else (x.amin(0), x.amax(0))
        step = (hi - lo) / (2**bits - 1)
        slack = 2e-3 * (x.abs().amax() + 1)  # statistics rounded to float16 where they fit
        assert bool(((decoded[start:start + n] - x).abs() <= step / 2 + slack).all())
        start += n
