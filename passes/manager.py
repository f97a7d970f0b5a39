"""Run kvtopo's graph passes in order and report what each found, refused and rewrote."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch.fx as fx

import dataclasses

from .find_eager import find_eager_sites
from .find_mla import find_mla_sites
from .find_other_attention import find_other_attention
from .find_positions import (find_fixed_position_sites, find_given_position_sites, find_offset_table_sites,
                             find_position_sites, find_sliced_table_sites, rewrite_fixed_position_sites,
                             rewrite_given_position_sites, rewrite_position_sites, rewrite_sliced_table_sites)
from .find_sdpa import find_sdpa_sites
from .rewrite import rewrite_mla_sites, rewrite_sites
from .site import Refusal

# (finder, rewriter) pairs, run in this order; each sees the graph as the previous ones left it.
# MLA goes first: its sites are also plain attention, but caching their latent is what matters.
PASSES = (
    (find_mla_sites, rewrite_mla_sites),
    (find_sdpa_sites, rewrite_sites),
    (find_eager_sites, rewrite_sites),
    (find_other_attention, None),  # refusals only: FlexAttention, aten SDPA kernels, nn.MultiheadAttention
)

# (report field, finder, rewriter) run after the attention passes over the rewritten graph; what
# they find are not attention sites (finder(gm) -> found, rewriter(gm, found) -> how many were
# rewritten, added to the report's field).
GRAPH_PASSES = (
    ("positions", find_position_sites, rewrite_position_sites),  # computed from 0: continued from the store
    ("positions", find_sliced_table_sites, rewrite_sliced_table_sites),  # table[:T]: rows continued likewise
    ("given_positions", find_given_position_sites, rewrite_given_position_sites),  # passed in: checked
    # computed from other numbers (a count from 2, by 2; a table's rows from 2): checked
    ("given_positions", find_offset_table_sites, rewrite_sliced_table_sites),
    ("given_positions", find_fixed_position_sites, rewrite_fixed_position_sites),
)


@dataclass
class PassReport:
    sites: list = field(default_factory=list)  # AttentionSite or MLASite
    refusals: list[Refusal] = field(default_factory=list)
    positions: int = 0  # position computations routed through kvtopo.positions (find_positions)
    given_positions: int = 0  # positions passed in, or computed from other numbers than 0, checked (find_positions)
    seconds: float = 0.0

    def format(self) -> str:
        lines = [f"kvtopo: {len(self.sites)} attention site(s) rewritten, {len(self.refusals)} refused "
                 f"({self.seconds * 1e3:.1f} ms)"]
        lines += ["  rewrote " + s.describe() for s in self.sites]
        lines += ["  " + r.describe() for r in self.refusals]
        return "\n".join(lines)


def _unique_layers(sites: list) -> list:
    """A module called twice in one graph gets '#k' suffixes so its calls keep separate caches."""
    seen: dict[str, int] = {}
    out = []
    for site in sites:
        n = seen.get(site.layer, 0)
        seen[site.layer] = n + 1
        if n:
            site = dataclasses.replace(site, layer=f"{site.layer}#{n}")
        out.append(site)
    return out


def run_passes(gm: fx.GraphModule) -> PassReport:
    """Find every attention site of `gm`, rewrite it in place, and report. Refusals stay untouched."""
    start = time.perf_counter()
    report = PassReport()
    for finder, rewriter in PASSES:
        sites, refusals = finder(gm)
        sites = _unique_layers(report.sites + sites)[len(report.sites):]
        if sites:
            rewriter(gm, sites)
        report.sites += sites
        report.refusals += refusals
    for field_name, finder, rewriter in GRAPH_PASSES:
        found = finder(gm)
        setattr(report, field_name, getattr(report, field_name) + (rewriter(gm, found) if found else 0))
    report.seconds = time.perf_counter() - start
    return report
