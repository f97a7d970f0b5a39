"""A refit (`Lifecycle.next_refit`) waits for an append that brings at least REFIT_ROWS_PER_DIM (4)
rows per head dimension to fit on (`starts_epoch`): decode steps past the refit point, holding only
the sinks, Recent and Terminal pages beside the token, must not refit bases on ~20 rows of a
16-dim head; the next prefill chunk that brings 64 tokens does. Every existing refit test uses a
4-dim head or 64-token chunks, where the condition always holds."""

import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import make_policy

HKV, D = 2, 16  # 4 x 16 = 64 rows needed
CONFIG = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=8, target_ratio=None, key_energy=0.9,
                       value_energy=0.9, refit_after=16, mid_bits=4, recent_bits=8)


def test_decode_steps_past_the_refit_point_do_not_refit_on_too_few_rows():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(HKV, 200, D, generator=g), torch.randn(HKV, 200, D, generator=g)
    cache = LayerCache(CONFIG, make_policy(CONFIG))
    cache.scale = D**-0.5
    starts, mid = [], None

    def feed(start, end):
        nonlocal mid
        cache.append(0, k[:, start:end], v[:, start:end])
        entry = cache.sequences[0]
        if entry.mid is not mid:
            mid = entry.mid
            starts.append(end)

    feed(0, 42)  # the first epoch: 42 tokens bring pages to Mid; the refit is due at 2 x 42 = 84
    for t in range(42, 120):  # decode steps: at most sinks 8 + Recent 8 + Terminal 8 + 1 < 64 rows held
        feed(t, t + 1)
        entry = cache.sequences[0]
        assert entry.length - entry.mid_tokens <= 8 + 8 + 8  # rows outside Mid: sink, Recent, Terminal pages
    feed(120, 184)  # a 64-token chunk: enough rows, the refit starts here
    assert starts == [42, 184]
    assert len(cache.sequences[0].retired) == 1
