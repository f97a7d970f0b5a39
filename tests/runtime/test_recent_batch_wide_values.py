"""Recent pages encoded together (`encode_recent_pages`) hold what encoding them one by one
(`encode_recent`) holds, also when only the VALUES of one page leave float16's range (its value
statistics need float32) while every key fits: the batch either declines (None, so the store
encodes page by page) or gives each page the same keys and values -- never a page without its
values. Also checked against float64: every decoded value within half a step of its token's grid."""

import pytest
import torch

from kvtopo.runtime import codecs


@pytest.mark.parametrize("wide_side", ["values", "keys", "both"])
def test_pages_encoded_together_keep_their_values_when_one_page_needs_float32(wide_side):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, 16, 8, generator=g)  # [pages, Hkv, tokens, dk]
    values = torch.randn(3, 2, 16, 8, generator=g)
    if wide_side in ("values", "both"):
        values[1, 0, 2, 5] = 70000.0
    if wide_side in ("keys", "both"):
        keys[2, 1, 4, 3] = -90000.0
    stacked = codecs.encode_recent_pages(keys, values, 8)
    for i in range(3):
        want_keys, want_values = codecs.encode_recent(keys[i], values[i], 8).decode()
        if stacked is None:
            continue
        got_keys, got_values = codecs.recent_page_at(stacked, i).decode()
        assert got_values is not None, f"page {i} lost its values"
        assert torch.equal(got_keys, want_keys) and torch.equal(got_values, want_values)
    # The page-by-page codes themselves are right: values per token within half a step.
    for i in range(3):
        _, decoded = codecs.encode_recent(keys[i], values[i], 8).decode()
        x = values[i].double()
        step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 255
        assert bool(((decoded.double() - x).abs() <= step / 2 + 2e-3 * (x.abs().amax(-1, keepdim=True) + 1)).all())


def test_pages_that_all_fit_float16_are_encoded_together_as_one_by_one():
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(4, 2, 16, 8, generator=g) * 3, torch.randn(4, 2, 16, 8, generator=g)
    stacked = codecs.encode_recent_pages(keys, values, 8)
    assert stacked is not None
    for i in range(4):
        page, alone = codecs.recent_page_at(stacked, i), codecs.encode_recent(keys[i], values[i], 8)
        for a, b in ((page.keys, alone.keys), (page.values, alone.values)):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.offset, b.offset)
