"""`PhasePlan.phase` answers only for pages that exist: page indices 0 .. num_pages - 1. An index
at or past the page count (or negative) is refused with IndexError rather than given a phase,
so a caller that walks one page too far learns it instead of reading a made-up phase."""

import pytest

from kvtopo.runtime.phases import Phase, PhasePlan


@pytest.mark.parametrize("num_pages", [0, 1, 2, 5, 12])
@pytest.mark.parametrize("plan", [PhasePlan(4, 0, 0), PhasePlan(4, 8, 8), PhasePlan(1, 2, 3, ((3, 5),))])
def test_pages_outside_the_sequence_are_refused(plan, num_pages):
    for index in (num_pages, num_pages + 1, -1):
        with pytest.raises(IndexError, match=f"page {index} out of range for {num_pages} pages"):
            plan.phase(index, num_pages)


def test_every_existing_page_has_a_phase_and_the_last_is_terminal():
    plan = PhasePlan(page_size=4, sink_tokens=4, recent_tokens=8)
    # 6 pages: page 0 holds the sinks, pages 3-4 the 8 Recent tokens, page 5 is being written.
    assert [plan.phase(i, 6) for i in range(6)] == [Phase.INITIAL, Phase.MID, Phase.MID, Phase.RECENT,
                                                     Phase.RECENT, Phase.TERMINAL]
