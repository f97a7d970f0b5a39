"""bench/real_quality.py's figures from made-up inputs: what a kvtopo run records after an answer
(achieved ratio, kept share), the fidelity rows (KL direction, per-position agreement, kept), the
teacher-forcing feed, the chunked forward's prompt end, the per-cell aggregation and where main()
puts kvpress (1 / kept), each against a hand computation. The model, the sessions and kvpress are
replaced (the real runs take minutes)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvtopo
from kvtopo.runtime.session import CacheStats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quality  # noqa: E402
import real_quality  # noqa: E402
from float64_kl import kl64  # noqa: E402


def stats(total, fp16, tokens, held):
    return CacheStats(total_bytes=total, per_layer={}, per_kind={}, tokens=(tokens,), fp16_bytes=fp16,
                      held_tokens={f"layer{i}": (h,) for i, h in enumerate(held)})


def test_memory_row_is_fp16_over_held_bytes_and_the_mean_kept_share_over_layers():
    """1,000 fp16 bytes held in 400: 2.5x; layers holding 100 / 60 / 20 of 100 tokens keep 0.6."""
    row = real_quality.memory_row(stats(400, 1000, 100, [100, 60, 20]), [100, 60, 20], 100, True)
    assert row == dict(ratio=2.5, kept=pytest.approx(0.6), budget_missed=1.0, total_bytes=400, fp16_bytes=1000)


def test_forced_logits_feed_the_prefix_then_every_forced_token_but_the_last():
    """Row i predicts forced[i]: it follows the prefix and forced[:i], one token per step."""
    fed = []

    def forward(ids):
        fed.append(list(ids))
        return torch.full((5,), float(len(fed)))

    rows = real_quality.forced_logits(forward, [7, 8, 9], [1, 2, 3])
    assert fed == [[7, 8, 9], [1], [2]] and rows[:, 0].tolist() == [1.0, 2.0, 3.0]


def test_session_forward_splits_a_call_into_chunks_each_budgeted_at_the_calls_end():
    """10 ids in chunks of 4: positions continue across chunks and calls, and every chunk is told
    the prompt ends after the call's last id (pages wait for it), not after its own chunk."""
    forward = real_quality.SessionForward(None, SimpleNamespace(config=SimpleNamespace(prefill_chunk_size=4)))
    calls = []

    def step(ids, positions, valid, prompt_end):
        calls.append((ids[0].tolist(), positions[0].tolist(), prompt_end))
        return torch.zeros(1, 3)

    forward.step = step
    forward(list(range(10)))
    forward([10])
    assert calls == [([0, 1, 2, 3], [0, 1, 2, 3], [10]), ([4, 5, 6, 7], [4, 5, 6, 7], [10]), ([8, 9], [8, 9], [10]),
                     ([10], [10], [11])]


def test_fidelity_rows_score_kl_full_to_compressed_agreement_per_position_and_kept(monkeypatch):
    """Three forced tokens; the compressed cache's greedy token differs at position 1 only, so
    agreement is 2/3 per position (1/3 if it stopped at the first divergence). KL(full ||
    compressed) is asymmetric here, so the direction shows."""
    forced = [0, 1, 2]
    ref = torch.tensor([[4.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 2.0]])
    cmp = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 1.0], [-1.0, 0.0, 3.0]])
    held = stats(250, 1000, 102, [51, 30])
    monkeypatch.setattr(real_quality, "full_continuation", lambda model, prefix: (forced, ref))
    monkeypatch.setattr(real_quality, "compressed_logits", lambda model, config, prefix, f: (cmp, held))

    class Prompts:
        def text_window(self, seed, length):
            return list(range(length))

    plans = {100: [dict(policy="full", nominal=1.0, overrides=dict(target_ratio=None)),
                   dict(policy="snapkv", nominal=4.0, overrides=dict(target_ratio=4.0))]}
    rows = real_quality.kvtopo_fidelity(None, plans, Prompts(), [100], [0], SimpleNamespace(update=lambda n: None))
    scored, request = rows
    kl = sum(kl64(r.tolist(), c.tolist()) for r, c in zip(ref, cmp)) / 3
    assert kl != pytest.approx(sum(kl64(c.tolist(), r.tolist()) for r, c in zip(ref, cmp)) / 3, rel=0.1)
    assert scored["method"] == "snapkv" and scored["kl"] == pytest.approx(kl, rel=1e-9)
    assert scored["agree"] == pytest.approx(2 / 3)
    assert scored["ratio"] == 4.0 and scored["kept"] == pytest.approx((51 + 30) / (2 * 102))
    assert request["method"] == "(request)" and request["prefix"] == list(range(100)) and request["forced"] == forced


def test_aggregate_keeps_settings_and_questions_apart_and_counts_every_example():
    def row(setting, question, correct, ratio, kept, seed):
        return dict(system="kvtopo", method="topo", nominal=4.0, setting=setting, question=question, task="niah",
                    length=512, seed=seed, correct=correct, ratio=ratio, kept=kept)

    rows = [row("aware", 0, 1.0, 4.0, 0.5, 0), row("aware", 0, 0.0, 3.0, 0.3, 1), row("aware", 0, 1.0, 3.5, 0.4, 2),
            row("agnostic", 0, 0.0, 2.0, 0.9, 0), row("agnostic", 1, 1.0, 5.0, 0.1, 0)]
    cells = {(r["setting"], r["question"]): r for r in real_quality.aggregate(rows)}
    assert set(cells) == {("aware", 0), ("agnostic", 0), ("agnostic", 1)}
    aware = cells["aware", 0]
    assert aware["examples"] == 3 and aware["accuracy"] == pytest.approx(2 / 3)
    assert aware["ratio"] == pytest.approx(3.5) and aware["ratio_min"] == 3.0 and aware["kept"] == pytest.approx(0.4)
    assert aware["budget_missed"] == 0.0
    assert (cells["agnostic", 0]["accuracy"], cells["agnostic", 1]["accuracy"]) == (0.0, 1.0)


def test_main_puts_kvpress_at_one_over_its_kept_fraction(monkeypatch, tmp_path):
    """The run's JSON with the model, the kvtopo sessions and kvpress replaced: a press that kept
    1/4 and 1/2 of two examples' tokens sits at (4 + 2) / 2 = 3x (kept 0.375), and its fidelity
    row at 1 / kept, not at its prefill's share."""
    import kvtopo.models.pretrained as pretrained

    class Prompts:
        def __init__(self, tokenizer):
            pass

        def count(self, user):
            return len(user.split())

        def segments(self, example):
            return dict(context=[5, 6, 7], questions=[[8]], max_new=[q.max_new_tokens for q in example.questions])

        def text_window(self, seed, tokens):
            return list(range(tokens))

    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=2))
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "")
    held = dict(ratio=0.9, kept=1.0, budget_missed=0.0, total_bytes=10, fp16_bytes=9)
    kvpress = dict(meta=dict(transformers="stand-in"), rows=[
        dict(id=f"niah_number/512/{seed}", setting="aware", press="snapkv", nominal=4.0, answers=[[3]], kept=[kept])
        for seed, kept in ((0, 0.25), (1, 0.5))], fidelity=[
        dict(press="snapkv", nominal=4.0, length=2048, seed=0, kl=0.1, agree=0.9, kept=0.2, prefill_kept=0.125)])
    monkeypatch.setattr(quality, "WINDOWS", dict(quality.WINDOWS))
    monkeypatch.setattr(pretrained, "smollm2", lambda dtype: (model, tokenizer))
    monkeypatch.setattr(kvtopo, "compile", lambda model, **kwargs: model)
    monkeypatch.setattr(real_quality, "Prompts", Prompts)
    monkeypatch.setattr(real_quality, "run_kvtopo", lambda model, config, turns, max_new, eos: ([[3]], [held]))
    monkeypatch.setattr(real_quality, "run_kvpress", lambda request, work: kvpress)
    monkeypatch.setattr(real_quality, "plot", lambda *args: [])
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps(dict(meta=dict(dtype="float32"), cells={"niah_number": [512]}, accuracy={})))
    report = real_quality.main(["--tasks", "niah_number", "--lengths", "512", "--policies", "full", "--ratios", "4",
                                "--presses", "snapkv", "--fidelity-lengths", "--examples", "2", "--settings", "aware",
                                "--dtype", "float32", "--threads", str(torch.get_num_threads()),
                                "--lengths-file", str(lengths), "--out", str(tmp_path)])
    (press,) = [r for r in report["results"] if r["system"] == "kvpress"]
    assert press["examples"] == 2 and press["ratio"] == pytest.approx(3.0) and press["kept"] == pytest.approx(0.375)
    assert press["ratio_min"] == pytest.approx(2.0)
    (fidelity,) = report["fidelity"]
    assert fidelity["ratio"] == pytest.approx(5.0) and fidelity["kept"] == 0.2
