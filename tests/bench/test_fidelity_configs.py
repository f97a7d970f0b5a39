"""bench/fidelity_configs.py's per-config figures from made-up logits and stats, against a hand
computation: KL(full || config) per forced position and its mean, greedy agreement per position,
achieved ratio and the kept share averaged over layers. The session and the forward are replaced
(the real run takes minutes on SmolLM2)."""

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtopo.runtime.session import CacheStats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fidelity_configs as FC  # noqa: E402
from float64_kl import kl64  # noqa: E402


def test_measure_scores_kl_full_to_config_agreement_per_position_and_kept(monkeypatch):
    """Forced [0, 1, 2]: the config's greedy token differs at position 1 only (agreement 2/3); two
    layers hold 51 and 30 of 102 tokens (kept 81/204); 1,000 fp16 bytes in 250 (4x)."""
    forced = [0, 1, 2]
    ref = torch.tensor([[4.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 2.0]])
    cmp = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 1.0], [-1.0, 0.0, 3.0]])
    stats = CacheStats(total_bytes=250, per_layer={}, per_kind={}, tokens=(102,), fp16_bytes=1000,
                       held_tokens={"a": (51,), "b": (30,)})
    session = SimpleNamespace(config=SimpleNamespace(prefill_chunk_size=8192), stats=lambda: stats)
    monkeypatch.setattr(FC.kvtopo, "session", lambda config: contextlib.nullcontext(session))
    monkeypatch.setattr(FC, "forced_logits", lambda forward, prefix, f: cmp)
    row = FC.measure(None, None, list(range(99)), forced, ref)
    per_position = [kl64(r.tolist(), c.tolist()) for r, c in zip(ref, cmp)]
    assert row["kl_positions"] == [round(k, 5) for k in per_position]
    assert row["kl"] == pytest.approx(sum(per_position) / 3, rel=1e-9)
    assert row["agree"] == pytest.approx(2 / 3) and row["ratio"] == 4.0 and row["kept"] == pytest.approx(81 / 204)
