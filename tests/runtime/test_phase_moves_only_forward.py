"""A page's phase only ever moves Terminal -> Recent -> Mid, or Terminal -> Initial (runtime/
phases.py): as a sequence grows page by page, every change of a page's phase is one of the moves
`TRANSITIONS` allows, and `TRANSITIONS` allows nothing out of Initial or Mid and nothing back
into Terminal -- so each page is re-encoded at most twice and the lifecycle refuses any other move."""

import pytest

from kvtopo.runtime.phases import TRANSITIONS, Phase, PhasePlan


def test_initial_and_mid_are_final_and_nothing_returns_to_terminal():
    assert set(TRANSITIONS) == {Phase.TERMINAL, Phase.RECENT}
    assert set(TRANSITIONS[Phase.TERMINAL]) == {Phase.INITIAL, Phase.RECENT, Phase.MID}
    assert tuple(TRANSITIONS[Phase.RECENT]) == (Phase.MID,)
    assert all(Phase.TERMINAL not in targets for targets in TRANSITIONS.values())


@pytest.mark.parametrize("plan", [PhasePlan(4, 8, 8), PhasePlan(4, 0, 0), PhasePlan(2, 3, 5, ((6, 11), (20, 21))),
                                  PhasePlan(1, 0, 3)])
def test_growing_sequences_move_pages_only_as_allowed(plan):
    phases: list[Phase] = []
    for count in range(1, 30):
        now = [plan.phase(i, count) for i in range(count)]
        for i, (before, after) in enumerate(zip(phases, now)):
            if before != after:
                assert after in TRANSITIONS.get(before, ()), (i, count, before, after)
        phases = now
