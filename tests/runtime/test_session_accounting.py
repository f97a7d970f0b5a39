"""Session-level bookkeeping: `clear()` forgets the batch as well as its sequences (the error for a
new batch size tells the caller to clear), and the fp16 bytes a session compares itself with count,
for a sliding-window layer, only the tokens it still holds (its pages that left the window are
gone from an fp16 cache too), in `stats()` and `sequence_stats()`."""

import torch

import kvtopo

HQ, HKV, D = 4, 2, 8
SCALE = D**-0.5


def _chunk(batch, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, n, D, generator=g) for h in (HQ, HKV, HKV)]


def test_clear_lets_the_session_take_a_batch_of_another_size():
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=8)
    with kvtopo.session(config) as s:
        s.attend("l", *_chunk(2, 20), None, SCALE)
        s.clear()
        out = s.attend("l", *_chunk(3, 20, seed=1), None, SCALE)
        assert s.stats().tokens == (20, 20, 20)
    with kvtopo.session(config) as fresh:
        expected = fresh.attend("l", *_chunk(3, 20, seed=1), None, SCALE)
    assert torch.equal(out, expected)


def test_fp16_bytes_of_a_windowed_layer_count_the_tokens_it_still_holds():
    """50 tokens, window 20, pages of 8: the next query sees tokens 31.. (50 - 20 + 1), so pages 0-2
    (tokens 0-23) are released and 26 tokens are held; the global layer holds all 50."""
    per_token = HKV * (D + D) * 2
    with kvtopo.session(kvtopo.Config.lossless(page_size=8)) as s:
        q, k, v = _chunk(1, 50)
        s.attend("global", q, k, v, None, SCALE)
        s.attend("windowed", q, k, v, None, SCALE, window=20)
        assert s.layers["windowed"].first_held(0) == 24
        stats = s.stats()
        assert stats.held_tokens == {"global": (50,), "windowed": (26,)}
        assert stats.fp16_bytes == (50 + 26) * per_token
        assert s.sequence_stats(0).fp16_bytes == (50 + 26) * per_token
