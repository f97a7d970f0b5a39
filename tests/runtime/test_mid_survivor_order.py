"""A page entering Mid keeps its survivors in position order, per kv-head, whichever path ranks
them (`best_tokens` under eviction_scope="page", the joint plan under "append"): the documented
order the exported compressor reproduces. With float Mid the rows are the appended K/V bit for bit,
so each row is matched to its token by hand."""

import pytest
import torch

import kvtopo
from kvtopo.runtime.phases import Phase

P, HKV, D = 8, 2, 16


@pytest.mark.parametrize("scope", ["page", "append"])
def test_each_heads_mid_rows_are_its_survivors_in_position_order(scope):
    config = kvtopo.Config(page_size=P, sink_tokens=8, recent_tokens=16, recent_bits=None, mid_bits=None,
                           key_energy=None, value_energy=None, target_ratio=1.25, eviction_scope=scope,
                           observation_window=8)
    g = torch.Generator().manual_seed(0)
    n = 200  # float Mid costs what exact pages do: a mild ratio leaves pages 1-8 survivors
    q, k, v = torch.randn(4, n, D, generator=g), torch.randn(HKV, n, D, generator=g), torch.randn(HKV, n, D, generator=g)
    with kvtopo.session(config) as s:
        for start in range(0, n, 40):
            s.attend_sequence("l", 0, q[:, start:start + 40], k[:, start:start + 40], v[:, start:start + 40], 0.25)
        entry = s.layers["l"].sequences[0]
    rows_k = entry.mid.keys.rows  # [N, Hkv, D], floats, page by page
    rows_v = entry.mid.values.rows
    row = 0
    evicting = False
    for i, page in enumerate(entry.pages):
        if page.phase is not Phase.MID:
            continue
        assert page.kept is not None
        evicting |= 2 <= page.kept < P  # an order to check, and an eviction
        for h in range(HKV):
            page_keys = k[h, i * P:(i + 1) * P]
            kept = rows_k[row:row + page.kept, h]
            match = (kept[:, None, :] == page_keys[None]).all(-1)  # [kept, P]
            assert bool((match.sum(1) == 1).all()), (i, h)  # each row is one token of its own page
            positions = match.float().argmax(1)
            assert bool((positions[1:] > positions[:-1]).all()), (i, h, positions.tolist())
            assert torch.equal(rows_v[row:row + page.kept, h], v[h, i * P + positions])  # values paired
        row += page.kept
    assert row == rows_k.shape[0]
    assert evicting  # some page kept 2..P-1 of its tokens
