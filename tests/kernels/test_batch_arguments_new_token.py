"""``BatchArguments`` reused from step to step attends what each row holds now, nothing it held
before.

A token handed over for one step only (``attend(q, new_tokens)``: a sequence whose token cannot
land in place yet) is attended in that step and in no later one: its partial goes into the
batch-wide "exact" slot of its sequence, which must read as empty again afterwards, or every
later step would attend the same token once more (its weight doubled in the softmax). Likewise a
row set again without a kind of segment it held before (``set_row`` with its Recent pages gone)
must drop that kind's old partial. The decode-batch tests reach these paths only where one
safeguard covers for the other (``set_row`` empties the new-token slot, ``attend`` empties it
too); here each is exercised on its own, against the float64 reference.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtopo.kernels.cpu_decode import BatchArguments, c_kernel_available
from kvtopo.kernels.decode_inputs import DecodeSegments, PagedExact
from kvtopo.kernels.decode_reference import reference_decode

from segments import synthetic_segments

pytestmark = pytest.mark.skipif(not c_kernel_available(), reason="the CPU decode kernel did not build here")

HEADS, GROUP, D, PAGE, SCALE = 2, 4, 32, 4, 0.25


def _sequence(seed: int, tokens: int) -> DecodeSegments:
    """Exact pages in a pool (read in place) beside Recent codes, as a decode batch holds them."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-tokens // PAGE)
    pool_k, pool_v = (torch.randn(pages + 2, HEADS, PAGE, D, generator=g) for _ in range(2))
    slots = torch.randperm(pages + 2, generator=g)[:pages].to(torch.int32)
    stored = synthetic_segments(kv_heads=HEADS, group=GROUP, dk=D, dv=D, exact=0, recent_pages=2, page_size=PAGE,
                                mid_page_rows=(0,), seed=seed)
    return dataclasses.replace(stored, exact_pages=PagedExact(pool_k, pool_v, slots, tokens))


def _arguments(segs) -> BatchArguments:
    """The batch's arguments with every row set from `segs`, flattened for the kernel."""
    args = BatchArguments(len(segs), HEADS, GROUP, D, D, SCALE, None)
    for b, s in enumerate(segs):
        assert args.set_row(b, s)
    args.flatten()
    return args


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def test_a_token_handed_over_for_one_step_is_not_attended_in_the_next():
    segs = [_sequence(1, 10), _sequence(2, 7)]
    args = _arguments(segs)
    g = torch.Generator().manual_seed(3)
    key, value = 4 * torch.randn(HEADS, 1, D, generator=g), 4 * torch.randn(HEADS, 1, D, generator=g)

    q1 = torch.randn(len(segs), HEADS * GROUP, D, generator=g)
    with_token = args.attend(q1, [(1, key, value)]).clone()
    expected = [reference_decode(q1[0], segs[0], SCALE),
                reference_decode(q1[1], dataclasses.replace(segs[1], exact=(key, value)), SCALE)]
    for b in range(len(segs)):
        assert _rel(with_token[b], expected[b]) < 1e-5

    q2 = torch.randn(len(segs), HEADS * GROUP, D, generator=g)
    later = args.attend(q2)  # the token was not stored: it is no longer part of sequence 1
    for b in range(len(segs)):
        assert _rel(later[b], reference_decode(q2[b], segs[b], SCALE)) < 1e-5, b


def test_a_segment_kind_a_sequence_no_longer_holds_reads_as_empty():
    """A row set again without a kind of segment it held before (its Recent pages gone) must not
    keep attending the old partial of that kind: the batch's other rows and its own exact pages
    stay as they were, the Recent part is dropped."""
    segs = [_sequence(4, 9), _sequence(5, 6)]
    args = _arguments(segs)
    g = torch.Generator().manual_seed(6)
    q = torch.randn(len(segs), HEADS * GROUP, D, generator=g)
    args.attend(q)  # every kind's partial written once
    without_recent = dataclasses.replace(segs[0], recent=None)
    assert args.set_row(0, without_recent)
    args.flatten()
    q = torch.randn(len(segs), HEADS * GROUP, D, generator=g)
    out = args.attend(q)
    assert _rel(out[0], reference_decode(q[0], without_recent, SCALE)) < 1e-5
    assert _rel(out[1], reference_decode(q[1], segs[1], SCALE)) < 1e-5
