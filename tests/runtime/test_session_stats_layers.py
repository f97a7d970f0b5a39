"""`budget_missed` in `Session.stats()` and `sequence_stats()` says whether ANY layer holds more
than its budget, whatever the order the layers were made in."""

import pytest
import torch

import kvtopo

PAGE = 8


@pytest.mark.parametrize("order", [("w", "g"), ("g", "w")])
def test_a_layer_over_its_budget_is_reported_whichever_layer_comes_last(order):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 100, 16, generator=g), torch.randn(1, 2, 100, 16, generator=g), \
        torch.randn(1, 2, 100, 16, generator=g)
    cap = 5_000
    config = kvtopo.Config(page_size=PAGE, sink_tokens=8, recent_tokens=16, target_ratio=None,
                           layer_budget_bytes=cap, over_budget="evict")
    with kvtopo.session(config) as s:
        for layer in order:
            if layer == "w":  # a window of 32 exact tokens: more than 5000 bytes
                s.attend("w", q, k, v, None, 0.25, window=32)
            else:  # one exact page: within the cap
                s.attend("g", q[:, :, :4], k[:, :, :4], v[:, :, :4], None, 0.25)
        held = {name: c.sequence_nbytes(c.sequences[0]) for name, c in s.layers.items()}
        assert held["w"] > cap >= held["g"], held  # one layer on each side of the cap
        assert s.stats().budget_missed
        assert s.sequence_stats(0).budget_missed


def test_fp16_bytes_count_every_sequence_of_the_batch():
    """A lossless batch of three sequences of 20, 7 and 13 real tokens in two layers: the fp16
    cache they are compared with holds 40 tokens per layer (hand count), in `stats()` as in the
    sum of `sequence_stats()`."""
    heads, dim = 2, 16
    per_token = heads * (dim + dim) * 2  # fp16 keys and values
    lengths = (20, 7, 13)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, 4, 20, dim, generator=g), torch.randn(3, heads, 20, dim, generator=g), \
        torch.randn(3, heads, 20, dim, generator=g)
    valid = torch.stack([torch.arange(20) >= 20 - n for n in lengths])
    with kvtopo.session(kvtopo.Config.lossless(page_size=8)) as s:
        with s.step(valid):
            for layer in ("a", "b"):
                s.attend(layer, q, k, v, None, 0.25)
        stats = s.stats()
        assert stats.tokens == lengths
        assert stats.fp16_bytes == 2 * sum(lengths) * per_token
        assert sum(s.sequence_stats(b).fp16_bytes for b in range(3)) == stats.fp16_bytes
