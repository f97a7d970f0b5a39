"""bench/quality.py's per-example figures from made-up inputs, against hand computations: KL
direction and precision, per-position agreement beside the common prefix, which logits the KL is
taken on, live-bytes ratio, the score of the compressed answer, perplexity's mean NLL, and the
aggregation over examples. The model is replaced, except in the teacher-forcing check (a tiny zoo
Llama); `--quick` end to end is test_quality_quick.py."""

import math
import sys
from pathlib import Path

import pytest
import torch

import kvtopo
from kvtopo.models import zoo
from kvtopo.runtime.session import CacheStats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quality  # noqa: E402
from kvtopo.models.reference import encode  # noqa: E402
from float64_kl import kl64  # noqa: E402


def test_kl_rows_is_kl_of_the_reference_to_the_compressed_per_row():
    ref = torch.tensor([[4.0, 0.0, 0.0], [0.0, 1.0, 2.0]])
    cmp = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    kl = quality.kl_rows(ref, cmp)
    assert kl.dtype == torch.float64 and kl[1] == 0.0
    assert kl[0].item() == pytest.approx(kl64(ref[0].tolist(), cmp[0].tolist()), rel=1e-12)
    assert kl[0].item() != pytest.approx(kl64(cmp[0].tolist(), ref[0].tolist()), rel=0.1)  # the other direction


def test_kl_rows_resolves_near_identical_float32_rows():
    """Logits 1e-4 apart over a 1,000-token vocabulary: a KL of ~1e-9 nats, which float32
    log-softmax rounds away (the reported KLs of near-lossless codes are this small)."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 1000, generator=g) * 3
    cmp = ref + 1e-4 * torch.randn(1, 1000, generator=g)
    expected = kl64(ref[0].double().tolist(), cmp[0].double().tolist())
    assert 1e-10 < expected < 1e-7
    assert quality.kl_rows(ref, cmp)[0].item() == pytest.approx(expected, rel=1e-6)


def test_evaluate_agreement_kl_ratios_and_score_of_a_diverging_answer(monkeypatch):
    """The compressed answer "4921" against the full cache's "4821": position 1 differs only, so
    agree is 3/4 and the common prefix 1/4; the answer is wrong; KL is taken on the logits forced
    along the full cache's tokens, not on the free-running ones; ratio_live leaves free slots out."""
    answer = "4821"
    ref_tokens, tokens = torch.tensor(encode(answer)), torch.tensor(encode("4921"))
    V = max(encode("0123456789")) + 1
    ref_logits = torch.zeros(4, V)
    free_logits, forced_logits = torch.zeros(4, V), torch.zeros(4, V)
    forced_logits[:, 0] = 2.0
    held = CacheStats(total_bytes=500, per_layer={}, per_kind={"free": 100, "mid": 400}, tokens=(10,),
                      fp16_bytes=1000, budget_missed=True)
    monkeypatch.setattr(quality, "greedy", lambda model, config, ids, steps: (tokens, free_logits, held))
    monkeypatch.setattr(quality, "teacher_forced", lambda model, config, ids, forced: forced_logits)
    row = quality.evaluate(None, None, None, answer, (ref_tokens, ref_logits))
    assert row["correct"] == 0.0 and row["generated"] == "4921"
    assert row["agree"] == 0.75 and row["agree_prefix"] == 0.25
    assert row["kl"] == pytest.approx(kl64([0.0] * V, forced_logits[0].tolist()), rel=1e-9)
    assert row["ratio"] == 2.0 and row["ratio_live"] == 2.5 and row["budget_missed"] == 1.0


def test_window_nll_is_the_mean_nll_of_the_scored_tokens_after_the_rest(monkeypatch):
    window = torch.tensor([[5, 6, 7, 1, 2]])
    seen = {}

    def forced(model, config, prompt, scored):
        seen["prompt"], seen["scored"] = prompt.tolist(), scored.tolist()
        return torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]], dtype=torch.float64).log()

    monkeypatch.setattr(quality, "teacher_forced", forced)
    nll = quality.window_nll(None, None, window, scored_tokens=2)
    assert seen == dict(prompt=[[5, 6, 7]], scored=[1, 2])
    assert nll == pytest.approx((-math.log(0.25) - math.log(0.8)) / 2, rel=1e-9)


def test_aggregate_means_every_example_and_keeps_the_lowest_ratio():
    examples = ((1.0, 0.1, 1.0, 4.0, 0.0, 10), (0.0, 0.3, 0.5, 3.0, 1.0, 30), (0.0, 0.2, 0.0, 5.0, 0.0, 20))
    rows = [dict(correct=c, kl=k, agree=a, agree_prefix=a / 2, ratio=r, ratio_live=r + 1, budget_missed=m,
                 per_kind={"mid": b}) for c, k, a, r, m, b in examples]
    out = quality.aggregate(rows)
    assert out["examples"] == 3 and out["accuracy"] == pytest.approx(1 / 3) and out["kl"] == pytest.approx(0.2)
    assert out["agree"] == pytest.approx(0.5) and out["ratio"] == pytest.approx(4.0) and out["ratio_min"] == 3.0
    assert out["budget_missed"] == pytest.approx(1 / 3) and out["per_kind_bytes"] == {"mid": pytest.approx(20.0)}


def test_teacher_forcing_along_the_greedy_tokens_gives_the_greedy_run_s_logits():
    """A lossless session forced along its own greedy continuation computes what generation did:
    the same positions and history, so the same logits row by row."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    config = quality.base_config(policy="full", target_ratio=None)
    out, logits = kvtopo.generate(model, prompt, 6, config=config, eos_token_id=None, return_logits=True,
                                  progress=False)
    forced = quality.teacher_forced(model, config, prompt, out[0, 40:])
    torch.testing.assert_close(forced, logits[0], rtol=1e-5, atol=1e-5)
