"""`decode_recent_pages` decodes a list of Recent pages that do not share one layout -- pages of
other token counts, other bit widths, keys with and without values -- each exactly as its own
`RecentPage.decode` does (the batched path only takes pages that agree), and a float64
reference bounds every decoded element by half its quantization step."""

import pytest
import torch

from kvtopo.runtime import codecs


def _page(tokens, bits, seed, with_values=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, tokens, 8, generator=g) * 2
    v = torch.randn(2, tokens, 8, generator=g) if with_values else None
    return codecs.encode_recent(k, v, bits), k, v


@pytest.mark.parametrize("layouts", [
    [(16, 8, True), (8, 8, True), (16, 8, True)],  # token counts differ
    [(16, 8, True), (16, 4, True)],  # bit widths differ
    [(16, 8, True), (16, 8, False)],  # one page keeps its values in the keys
])
def test_pages_that_differ_decode_one_by_one(layouts):
    made = [_page(tokens, bits, seed, values) for seed, (tokens, bits, values) in enumerate(layouts)]
    pages = [page for page, _, _ in made]
    together = codecs.decode_recent_pages(pages)
    assert len(together) == len(pages)
    for (keys, values), (page, k, v), (_, bits, _) in zip(together, made, layouts):
        want_keys, want_values = page.decode()
        assert torch.equal(keys, want_keys)
        assert (values is None) == (v is None)
        if v is not None:
            assert torch.equal(values, want_values)
        # keys per channel (over tokens): error within half a step of that channel's range
        x = k.double()
        step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / (2**bits - 1)
        assert bool(((keys.double() - x).abs() <= step / 2 + 2e-3 * (x.abs().amax(1, keepdim=True) + 1)).all())
