"""`PhasePlan.counts` (arithmetic, read at every Mid transition and by the joint eviction plan's
byte estimate) agrees with `PhasePlan.phase` page by page, also for protected spans that start
or end inside a page, several spans, and spans that overlap the sinks or reach past the Terminal
page."""

import collections

import pytest

from kvtopo.runtime.phases import Phase, PhasePlan

SPANS = [(), ((3, 5),), ((0, 1),), ((5, 13),), ((2, 3), (9, 15)), ((7, 8), (8, 9)), ((1, 40),), ((11, 12),)]


@pytest.mark.parametrize("spans", SPANS)
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_counts_are_the_phases_of_every_page(spans, page_size):
    for sinks in range(0, 10):
        for recent in range(0, 10, 3):
            plan = PhasePlan(page_size, sinks, recent, spans)
            for pages in range(0, 12):
                walked = collections.Counter(plan.phase(i, pages) for i in range(pages))
                assert plan.counts(pages) == {phase: walked.get(phase, 0) for phase in Phase}, (sinks, recent, pages)
                assert plan.mid_pages(pages) == walked.get(Phase.MID, 0)


def test_a_span_ending_inside_a_page_protects_that_page_in_the_counts():
    """Tokens 5..12 at page size 4 touch pages 1, 2 and 3 (page 3 only by token 12): of six pages,
    those three are Initial, pages 0 and 4 Mid (no Recent window), page 5 Terminal."""
    plan = PhasePlan(page_size=4, sink_tokens=0, recent_tokens=0, protected_spans=((5, 13),))
    assert plan.counts(6) == {Phase.INITIAL: 3, Phase.MID: 2, Phase.RECENT: 0, Phase.TERMINAL: 1}
