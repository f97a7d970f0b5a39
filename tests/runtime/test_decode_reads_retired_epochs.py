"""After a refit, the rows of the retired Mid epoch (under its own bases) stay part of the history
every decode step attends: checked step by step against float64 softmax attention over the K/V
the store's segments decompress to (exact, Recent, every Mid epoch, retired ones included)."""

import torch

import kvtopo
from segments_reference import explicit_kv

HQ, HKV, D = 4, 2, 4
SCALE = D**-0.5
CONFIG = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=8, target_ratio=None, key_energy=0.9,
                       value_energy=0.9, refit_after=16, mid_bits=4, recent_bits=8)


def test_decode_steps_after_a_refit_attend_the_retired_epoch_too():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(h, 110, D, generator=g) for h in (HQ, HKV, HKV))
    with kvtopo.session(CONFIG) as s:
        s.attend_sequence("l", 0, q[:, :42], k[:, :42], v[:, :42], SCALE)
        cache = s.layers["l"]
        checked_retired = 0
        for t in range(42, 110):
            seg = cache.segments(0)
            keys, values = explicit_kv(seg)
            kk = torch.cat([keys, k[:, t:t + 1]], 1).double().repeat_interleave(HQ // HKV, 0)
            vv = torch.cat([values, v[:, t:t + 1]], 1).double().repeat_interleave(HQ // HKV, 0)
            expected = torch.softmax(q[:, t:t + 1].double() @ kk.transpose(1, 2) * SCALE, -1) @ vv
            out = s.attend_sequence("l", 0, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], SCALE)
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5, msg=f"step at {t}")
            checked_retired += bool(seg.retired)
    assert checked_retired >= 10  # steps after the refit at 84 read a retired epoch
