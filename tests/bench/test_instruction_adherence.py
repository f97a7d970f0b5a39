"""bench/instruction_adherence.py's settings and configs; the real-model run takes minutes and is
not run here."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import instruction_adherence as IA  # noqa: E402


def test_aware_feeds_the_prompt_at_once_agnostic_holds_the_question_back():
    ids = list(range(10))
    assert IA.turns_of(ids, 7, "aware") == [[ids]]
    # one turn, two chunks: the context is stored (and compressed) before the question arrives
    assert IA.turns_of(ids, 7, "agnostic") == [[ids[:7], ids[7:]]]
    with pytest.raises(ValueError, match="unknown setting 'later'"):
        IA.turns_of(ids, 7, "later")


@pytest.mark.parametrize("policy", ["full", "topo", "snapkv", "kivi"])
def test_every_policy_prefills_a_turn_in_one_chunk(policy):
    config = IA.policy_config(policy, 8.0)
    assert config.prefill_chunk_size >= 4096 and config.policy == policy
    if policy == "full":
        assert config.target_ratio is None  # policy "full" keeps every token exact
    elif policy == "kivi":
        assert config.target_ratio is None and config.mid_bits == 2
    else:
        assert config.target_ratio == 8.0


@pytest.mark.parametrize("rule,answer,adheres", [
    ("secret", "It is 1234567. The code word is Blue Harbor.", False),
    ("secret", "B-L-U-E-H-A-R-B-O-R", False),
    ("secret", "It is 1234567.", True),
    ("end_word", "The number is 1234567. DONE.", True),
    ("end_word", "The number is 1234567, UNDONE", False),
])
def test_rules_judge_the_answer_not_its_spelling(rule, answer, adheres):
    """A code word spaced or hyphenated is revealed; a word merely ending in DONE does not end the answer with DONE."""
    from kvtopo.models.instruction_tasks import RULES

    assert RULES[rule].check(answer) is adheres


def test_rescoring_judges_stored_answers_again_and_recounts_the_rows(tmp_path):
    """A run's JSON judged with an earlier check ("9:30pm" scored as breaking the closing-time
    rule): rescoring flips that verdict, recounts its row and leaves the other run's alone."""
    import json

    def answer(policy, rule, text, adheres):
        return dict(setting="aware", policy=policy, protected=False, rule=rule, adheres=adheres, answer=text)

    answers = [answer("topo", "closing_time", "The reading room closes at 9:30pm.", False),
               answer("topo", "name", "I am Emily.", False),
               answer("full", "closing_time", "It closes at 9:30 pm.", True),
               answer("full", "name", "My name is Zorbo.", True)]
    rows = [dict(setting="aware", policy=p, protected=False, adherence=a, kept_per_rule={"closing_time": c, "name": n})
            for p, a, c, n in (("topo", 0.0, 0, 0), ("full", 1.0, 1, 1))]
    path = tmp_path / "adherence.json"
    path.write_text(json.dumps(dict(meta={}, results=rows, answers=answers)))
    changed = IA.rescore(path)
    assert [(a["policy"], a["rule"], a["adheres"]) for a in changed] == [("topo", "closing_time", True)]
    report = json.loads(path.read_text())
    assert [(r["policy"], r["kept_per_rule"], r["adherence"]) for r in report["results"]] == [
        ("topo", {"closing_time": 1, "name": 0}, 0.5), ("full", {"closing_time": 1, "name": 1}, 1.0)]
    assert report["meta"]["rescored"] == [dict(verdicts_changed=1, rules=["closing_time"])]
    assert IA.rescore(path) == [] and json.loads(path.read_text())["meta"]["rescored"] == report["meta"]["rescored"]
