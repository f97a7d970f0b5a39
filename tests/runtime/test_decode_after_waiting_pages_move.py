"""A chunked prompt's last chunk that opens no page still moves the pages that waited in Recent
into Mid (`Lifecycle.write`: "the wait ended in an append that opened no page"). The page count
does not change, but those pages' Recent codes are gone: the decode kernels' cached view of the
pages (`decode_view._PagesView`, built by that chunk's own attention before the move) must be
rebuilt, or a decode step reads those tokens twice (as Recent codes and as Mid rows). Checked
step by step against float64 softmax attention over the segments the store decodes."""

import torch

import kvtopo
from kvtopo.runtime.phases import Phase
from segments_reference import float64_decode

HQ, HKV, D = 4, 2, 16
SCALE = D**-0.5


def test_decode_after_a_last_chunk_that_opens_no_page_reads_each_token_once():
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=8, target_ratio=3.0, observation_window=8,
                           mid_bits=4)
    g = torch.Generator().manual_seed(0)
    total = 54 + 6
    q, k, v = (torch.randn(h, total, D, generator=g) for h in (HQ, HKV, HKV))
    with kvtopo.session(config) as s:
        s.attend_sequence("l", 0, q[:, :50], k[:, :50], v[:, :50], SCALE, prompt_end=54)
        cache = s.layers["l"]
        pages = cache.sequences[0].pages
        assert not any(p.phase is Phase.MID for p in pages) and any(p.recent is not None for p in pages)  # waiting
        count = len(pages)
        s.attend_sequence("l", 0, q[:, 50:54], k[:, 50:54], v[:, 50:54], SCALE, prompt_end=54)
        pages = cache.sequences[0].pages
        assert len(pages) == count and any(p.phase is Phase.MID for p in pages)  # moved without a new page
        for t in range(54, total):
            sl = slice(t, t + 1)
            expected = float64_decode(cache, 0, q[:, sl], k[:, sl], v[:, sl], SCALE)
            out = s.attend_sequence("l", 0, q[:, sl], k[:, sl], v[:, sl], SCALE)
            torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5, msg=f"step at {t}")
