"""bench/needle_survival.py's summary and spans from made-up rows: a layer counts as dropping
the needle only when every kv-head lost all of it, as keeping it whole when one kv-head kept all
of it, each averaged over its own group's examples; a span that ends inside a page does not reach
past its end; the answer's span is the fewest tokens that spell it."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import needle_survival as NS  # noqa: E402
import real_quality as RQ  # noqa: E402


def test_summary_counts_layers_per_example_over_its_own_group():
    # 3-token needles, 2 kv-heads per layer, 3 layers per example
    rows = [dict(correct=True, span=[10, 13], kept=[[3, 3], [3, 0], [0, 2]]),  # whole in 2 layers, dropped in 0
            dict(correct=True, span=[20, 23], kept=[[0, 0], [1, 2], [3, 1]]),  # whole in 1, dropped in 1
            dict(correct=False, span=[5, 8], kept=[[0, 0], [0, 0], [0, 1]])]   # whole in 0, dropped in 2
    summary = NS.summarise(rows)
    assert summary["correct"] == dict(examples=2, layers_dropped=0.5, layers_whole=1.5)
    assert summary["wrong"] == dict(examples=1, layers_dropped=2.0, layers_whole=0.0)
    assert NS.summarise(rows[:2])["wrong"] == dict(examples=0, layers_dropped=None, layers_whole=None)


def test_a_span_ending_inside_a_page_counts_only_its_own_tokens():
    # page 1 (tokens 4..7) keeps 4 and 7 in head 0, 5 and 6 in head 1; the span is 4..6
    plan = {1: torch.tensor([[0, 3], [1, 2]])}
    assert NS.kept_in_span(plan, 4, 2, (4, 6)) == [1, 1]


class WordTokenizer:
    words = ["The", " code", " is", " 4821", " today", "."]

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


def test_answer_span_is_the_fewest_tokens_that_spell_the_answer():
    """A one-token answer spans one token, not its neighbour too."""
    prompts = RQ.Prompts.__new__(RQ.Prompts)
    prompts.tokenizer = WordTokenizer()
    assert NS.answer_span(prompts, [0, 1, 2, 3, 4, 5], "4821") == (3, 4)
    assert NS.answer_span(prompts, [0, 1, 2, 3, 4, 5], "is 4821") == (2, 4)
