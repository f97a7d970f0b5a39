"""``DecodeSegments.only_exact``: true exactly when every stored token is exact.

A session's prefill chunk (``Session._attend_one``) attends a history that is ``only_exact`` as one
dense softmax over ``exact_kv()`` and skips every coded phase; so any phase holding tokens --
Recent codes, the current Mid, Mid stored another way, or an earlier Mid epoch kept after a refit
(``retired``) -- must make it false, or those tokens silently drop out of the chunk's attention.
Checked phase by phase, and against the attention itself: where it is true, attending
``exact_kv()`` alone equals the float64 reference over all segments.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtopo.kernels.decode_inputs import DecodeSegments
from kvtopo.kernels.decode_reference import explicit_kv, reference_history

from segments import synthetic_segments

CASE = dict(kv_heads=2, group=2, dk=16, dv=16, exact=3, recent_pages=1, page_size=4, mid_page_rows=(4, 2), seed=0)


def _phases():
    full = synthetic_segments(**CASE)
    epoch = synthetic_segments(**{**CASE, "exact": 0, "recent_pages": 0, "seed": 1}).mid
    exact = DecodeSegments(exact=full.exact)
    recent = full.recent
    empty_recent = dataclasses.replace(recent, **{f: getattr(recent, f)[:, :0] for f in (
        "k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset")})  # no pages
    return {
        "exact": (exact, True),
        "exact + empty Recent": (dataclasses.replace(exact, recent=empty_recent), True),
        "Recent": (dataclasses.replace(exact, recent=full.recent), False),
        "Mid": (dataclasses.replace(exact, mid=full.mid), False),
        "Mid stored as floats": (dataclasses.replace(exact, mid_other=explicit_kv(DecodeSegments(mid=full.mid), torch.float32)), False),
        "an earlier Mid epoch": (dataclasses.replace(exact, retired=(epoch,)), False),
        "an earlier epoch only": (DecodeSegments(retired=(epoch,)), False),
    }


@pytest.mark.parametrize("name", list(_phases()))
def test_only_exact_phase_by_phase(name):
    segs, expected = _phases()[name]
    assert segs.only_exact is expected


@pytest.mark.parametrize("name", list(_phases()))
def test_only_exact_histories_are_their_exact_tokens(name):
    """Where ``only_exact`` holds, the exact tokens are the whole history: the dense attention a
    session would take over them equals the reference over every segment."""
    segs, _ = _phases()[name]
    q = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(2))
    want, _ = reference_history(q, segs, 0.3)
    if not segs.only_exact:
        return
    exact = DecodeSegments(exact=segs.exact_kv())
    got, _ = reference_history(q, exact, 0.3)
    torch.testing.assert_close(got, want)
