"""bench/fidelity_trace.py's summary from made-up logits: the mean KL, the agreement and the share
of the KL carried by the tokens that recite the prompt, against a hand computation. The model,
its continuation and the compressed run are replaced (the real trace takes minutes)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fidelity_trace as FT  # noqa: E402
import quality  # noqa: E402
import real_quality as RQ  # noqa: E402
from float64_kl import kl64  # noqa: E402


def test_summary_splits_the_kl_between_recited_and_other_tokens(monkeypatch, tmp_path):
    """Forced: two tokens not in the prompt, then prompt[0:9] recited; the last two (runs of 8 and
    9) count as recited. Row i's KL grows with i; the compressed cache disagrees at rows 0 and 10."""
    import kvtopo
    import kvtopo.models.pretrained as pretrained

    prefix = list(range(20))
    forced = [50, 51] + list(range(9))
    ref = torch.zeros(len(forced), 60)
    ref[torch.arange(len(forced)), torch.tensor(forced)] = 5.0
    cmp = ref.clone()
    cmp[:, 59] = torch.arange(len(forced), dtype=torch.float) * 0.5
    cmp[0, 59] = cmp[10, 59] = 6.0
    stats = SimpleNamespace(ratio_vs_fp16=6.5)

    class Prompts:
        def __init__(self, tokenizer):
            pass

        def text_window(self, seed, length):
            return prefix

    monkeypatch.setattr(quality, "WINDOWS", dict(quality.WINDOWS))
    monkeypatch.setattr(pretrained, "smollm2", lambda dtype: (None, SimpleNamespace(decode=lambda ids: str(ids[0]))))
    monkeypatch.setattr(kvtopo, "compile", lambda model, **kwargs: model)
    monkeypatch.setattr(RQ, "Prompts", Prompts)
    monkeypatch.setattr(RQ, "full_continuation", lambda model, p: (forced, ref))
    monkeypatch.setattr(RQ, "compressed_logits", lambda model, config, p, f: (cmp, stats))
    out = tmp_path / "trace.json"
    summary = FT.main(["--length", "20", "--threads", str(torch.get_num_threads()), "--out", str(out)])["summary"]
    kl = [kl64(r.tolist(), c.tolist()) for r, c in zip(ref, cmp)]
    assert [t["recital_run"] for t in json.loads(out.read_text())["tokens"]] == [0, 0] + list(range(1, 10))
    assert summary["kl"] == pytest.approx(sum(kl) / 11, rel=1e-9) and summary["agree"] == pytest.approx(9 / 11)
    assert summary["recited_tokens"] == 2 and summary["ratio"] == 6.5
    assert summary["kl_share_on_recited"] == pytest.approx((kl[9] + kl[10]) / sum(kl), rel=1e-9)
    assert summary["mean_kl_recited"] == pytest.approx((kl[9] + kl[10]) / 2, rel=1e-9)
    assert summary["mean_kl_others"] == pytest.approx(sum(kl[:9]) / 9, rel=1e-9)
