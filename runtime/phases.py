"""The four-phase page lifecycle, as one pure function of a page's index.

Pages of a sequence, oldest first:
- Initial: the pages holding the first `sink_tokens` tokens (attention sinks) and any page that
  overlaps a protected span (e.g. a system prompt) — kept exact, never evicted;
- Terminal: the last page, the one being written — exact;
- Recent: the `ceil(recent_tokens / page_size)` pages just before it — lightly compressed;
- Mid: everything else — evicted by score, low-bit (projected onto principal directions where
  the config asks).
A page's phase only ever moves Terminal -> Recent -> Mid (or Terminal -> Initial), so each page
is re-encoded at most twice, at page granularity.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Phase(str, enum.Enum):
    INITIAL = "initial"
    MID = "mid"
    RECENT = "recent"
    TERMINAL = "terminal"


# The moves a page may make (each re-encodes it at most once).
TRANSITIONS = {Phase.TERMINAL: (Phase.INITIAL, Phase.RECENT, Phase.MID), Phase.RECENT: (Phase.MID,)}


@dataclass(frozen=True)
class PhasePlan:
    page_size: int
    sink_tokens: int
    recent_tokens: int
    protected_spans: tuple[tuple[int, int], ...] = ()

    @property
    def initial_pages(self) -> int:
        return math.ceil(self.sink_tokens / self.page_size)

    @property
    def recent_pages(self) -> int:
        return math.ceil(self.recent_tokens / self.page_size)

    def protected(self, index: int) -> bool:
        start, end = index * self.page_size, (index + 1) * self.page_size
        return any(s < end and start < e for s, e in self.protected_spans)

    def pages(self, tokens: int) -> int:
        """Pages that hold `tokens` tokens."""
        return -(-tokens // self.page_size)

    def mid_pages(self, num_pages: int) -> int:
        """How many of `num_pages` pages are Mid (arithmetic: called at every Mid transition)."""
        return self.counts(num_pages)[Phase.MID]

    def counts(self, num_pages: int) -> dict[Phase, int]:
        """How many of `num_pages` pages are in each phase: `phase` of every page, counted by
        arithmetic (O(initial and protected pages), not O(num_pages))."""
        if num_pages == 0:
            return dict.fromkeys(Phase, 0)
        before = num_pages - 1  # the pages before the Terminal one
        bound = max(0, before - self.recent_pages)  # Recent from here on, unless Initial
        initial = set(range(min(self.initial_pages, before)))
        for start, end in self.protected_spans:
            initial.update(range(start // self.page_size, min(before, -(-end // self.page_size))))
        below = sum(i < bound for i in initial)
        return {Phase.INITIAL: len(initial), Phase.MID: bound - below,
                Phase.RECENT: before - bound - (len(initial) - below), Phase.TERMINAL: 1}

    def phase(self, index: int, num_pages: int) -> Phase:
        """Phase of page `index` (0 = oldest) in a sequence of `num_pages` pages."""
        if not 0 <= index < num_pages:
            raise IndexError(f"page {index} out of range for {num_pages} pages")
        if index == num_pages - 1:
            return Phase.TERMINAL
        if index < self.initial_pages or self.protected(index):
            return Phase.INITIAL
        if index >= num_pages - 1 - self.recent_pages:
            return Phase.RECENT
        return Phase.MID
