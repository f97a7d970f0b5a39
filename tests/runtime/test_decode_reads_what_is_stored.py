"""Each decode step attends to the history as it is stored right before it (exact pages, Recent
codes, every Mid row, the rows pages added to Mid in earlier decode steps included) plus its own
token: the decode kernels' cached views of the store (`decode_view.mid_codes`, the pages view) are
checked step by step against float64 softmax attention over the segments the store decodes
(`LayerCache.segments`), while pages keep entering Recent and Mid."""

import pytest
import torch

import kvtopo
from segments_reference import float64_decode

HQ, HKV, D = 4, 2, 16
SCALE = D**-0.5
PROMPT, STEPS = 40, 30


@pytest.mark.parametrize("fields", [
    dict(target_ratio=None, mid_bits=4),  # quantized Mid, nothing evicted: read by the C kernel's codes view
    dict(target_ratio=3.0, mid_bits=4),  # evicting, pages keeping few or no rows
    dict(target_ratio=None, mid_bits=8, recent_bits=None),  # exact Recent
])
def test_every_decode_step_reads_the_rows_the_store_holds_before_it(fields):
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=8, observation_window=8, **fields)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, PROMPT + STEPS, D, generator=g) for h in (HQ, HKV, HKV))
    mid_pages = []
    with kvtopo.session(config) as s:
        s.attend_sequence("l", 0, q[:, :PROMPT], k[:, :PROMPT], v[:, :PROMPT], SCALE)
        cache = s.layers["l"]
        for t in range(PROMPT, PROMPT + STEPS):
            sl = slice(t, t + 1)
            expected = float64_decode(cache, 0, q[:, sl], k[:, sl], v[:, sl], SCALE)
            mid_pages.append(sum(p.kept is not None for p in cache.sequences[0].pages))
            out = s.attend_sequence("l", 0, q[:, sl], k[:, sl], v[:, sl], SCALE)
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5, msg=f"step at {t}")
    assert mid_pages[-1] - mid_pages[0] >= 3  # pages entered Mid while decoding
