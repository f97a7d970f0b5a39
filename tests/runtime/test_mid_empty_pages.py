"""A Mid page that keeps no token (evicted whole) takes no statistics row: its neighbours' rows
decode with their own page's statistics, whether the pages were appended one by one or together
(`CodedRows.append_pages`), and the decode kernel's view of the codes (`decode_view.mid_codes`)
maps every row to its own page's statistics. Checked against float64 references: each page's own
min/max grid, and softmax attention over the rows as decoded."""

import pytest
import torch

from kvtopo.kernels.decode_inputs import DecodeSegments
from kvtopo.kernels.fast_decode import decode_attention_batch
from kvtopo.runtime import decode_view
from kvtopo.runtime.codecs import CodedRows, MidSegment
from kvtopo.runtime.policies import MidEncoding

COUNTS = [3, 0, 5, 0, 2]  # rows each page keeps; pages 1 and 3 are evicted whole
HEADS, DIM = 2, 8


def _pages(seed=0):
    g = torch.Generator().manual_seed(seed)
    # Each page on its own offset and spread, so a row decoded with another page's statistics is far off.
    return [torch.randn(n, HEADS, DIM, generator=g) * (1 + 3 * i) + 10 * i for i, n in enumerate(COUNTS)]


def _within_own_page_grid(decoded, pages, bits):
    """|decoded - x| <= half a step of the page's own per-channel grid (float64), row by row."""
    start = 0
    for page in pages:
        n = page.shape[0]
        if n:
            x = page.double()
            step = (x.amax(0) - x.amin(0)) / (2**bits - 1)
            err = (decoded[start:start + n].double() - x).abs()
            # float16 statistics round the grid outward by at most a float16 ulp of the range's ends
            slack = 2e-3 * (x.abs().amax(0) + 1)
            assert bool((err <= step / 2 + slack).all()), float((err - step / 2).max())
        start += n
    assert decoded.shape[0] == start


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_after_a_page_evicted_whole_decode_with_their_own_statistics(bits):
    coded = CodedRows(bits=bits, per_row_stats=False, float_dtype=torch.float32)
    pages = _pages()
    for page in pages:
        coded.append(page)
    assert coded.page_rows.tolist() == COUNTS
    assert coded.scale.shape[0] == sum(n > 0 for n in COUNTS)  # one statistics row per page that kept rows
    _within_own_page_grid(coded.decode(), pages, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_pages_appended_together_with_an_empty_one_decode_as_one_by_one(bits):
    pages = _pages(seed=1)
    one_by_one = CodedRows(bits=bits, per_row_stats=False, float_dtype=torch.float32)
    for page in pages:
        one_by_one.append(page)
    padded = torch.zeros(len(pages), max(COUNTS), HEADS, DIM)
    for b, page in enumerate(pages):
        padded[b, : page.shape[0]] = page
    together = CodedRows(bits=bits, per_row_stats=False, float_dtype=torch.float32)
    together.append_pages(padded, torch.tensor(COUNTS))
    assert together.page_rows.tolist() == COUNTS
    assert together.scale.shape == one_by_one.scale.shape
    _within_own_page_grid(together.decode(), pages, bits)
    torch.testing.assert_close(together.decode(), one_by_one.decode(), rtol=0, atol=0)


def test_decode_kernel_reads_the_rows_after_an_evicted_page_with_their_own_statistics():
    """The C kernel's Mid codes view against float64 softmax attention over the decoded rows."""
    g = torch.Generator().manual_seed(2)
    mid = MidSegment(MidEncoding(evict=True, key_bits=4, value_bits=4), None, None, torch.float32)
    for i, n in enumerate(COUNTS):
        keys = torch.randn(HEADS, n, DIM, generator=g) * (1 + i) + 3 * i
        values = torch.randn(HEADS, n, DIM, generator=g) * (1 + i) - 2 * i
        mid.append_page(keys, values)
    codes = decode_view.mid_codes(mid)
    assert codes is not None and codes.tokens == sum(COUNTS)
    q = torch.randn(1, 2 * HEADS, DIM, generator=g)
    k_new, v_new = torch.randn(HEADS, 1, DIM, generator=g), torch.randn(HEADS, 1, DIM, generator=g)
    out = decode_attention_batch(q, [DecodeSegments(exact=(k_new, v_new), mid=codes)], DIM**-0.5)[0]
    mk, mv = mid.attention_inputs()  # [Hkv, N, d] as decoded (pinned by the tests above)
    keys = torch.cat([mk, k_new], 1).double().repeat_interleave(2, 0)
    values = torch.cat([mv, v_new], 1).double().repeat_interleave(2, 0)
    expected = (torch.softmax(q[0, :, None].double() @ keys.transpose(1, 2) * DIM**-0.5, -1) @ values)[:, 0]
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
