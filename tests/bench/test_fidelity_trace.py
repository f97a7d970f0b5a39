"""bench/fidelity_trace.py's recital detection (the real-model trace itself takes minutes and is run by hand)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fidelity_trace as FT  # noqa: E402


def test_a_recital_counts_its_run_and_points_at_the_prompt_token_it_repeats():
    prompt = [5, 1, 2, 3, 4, 9, 1, 2, 7]
    # 1 2 3 4 repeats prompt[1:5] (while only "1 2" is read, both of the prompt's match: the later
    # is named); then 8 is new; then 1 2 7 repeats prompt[6:9].
    runs = FT.recital_runs(prompt, [1, 2, 3, 4, 8, 1, 2, 7])
    assert runs == [(1, 6), (2, 7), (3, 3), (4, 4), (0, None), (1, 6), (2, 7), (3, 8)]


def test_a_run_follows_one_span_and_restarts_where_the_continuation_leaves_it():
    prompt = [1, 2, 3, 1, 2, 4]
    # "1 2 3" is prompt[0:3]: at 3 the run is 3 there, not 1 from a stray 3 elsewhere; "1 2 4" ends at 5.
    assert FT.recital_runs(prompt, [1, 2, 3]) == [(1, 3), (2, 4), (3, 2)]
    assert FT.recital_runs(prompt, [1, 2, 4, 4]) == [(1, 3), (2, 4), (3, 5), (1, 5)]
    assert FT.recital_runs([], [1]) == [(0, None)]
