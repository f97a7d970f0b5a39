"""``kvtopo::given_positions(fixed=True)`` checks every row of a batch: positions a graph computed
from numbers of its own raise when *any* row starts below the stored length (plus the start they
had over an empty store), not only when all rows do.

A batch whose rows were numbered from different starts (one row continued, another restarted at
0) still attends over the stored history in every row, so the restarted row would read a history
its positions say is not there. The pass tests feed positions broadcast from one ``arange`` (every
row starts at the same number), where the first row and the lowest row are the same.
"""

from __future__ import annotations

import pytest
import torch

import kvtopo.kernels.ops  # noqa: F401  (registers the kvtopo ops)
from kvtopo.kernels.store_hook import reset_active_store, set_active_store


class _Store:
    """The two things given_positions asks of a session: the stored length and the start that
    computed positions had while the store was empty."""

    def __init__(self, stored: int, empty_start: int):
        self.stored, self.empty_start = stored, empty_start

    def model_length(self, model_key):
        return self.stored

    def computed_positions_start(self, model_key, start):
        return self.empty_start


def _given(positions, store):
    token = set_active_store(store)
    try:
        return torch.ops.kvtopo.given_positions(positions, torch.zeros(1), fixed=True)
    finally:
        reset_active_store(token)


@pytest.mark.parametrize("empty_start", [0, 2])
def test_a_row_below_the_stored_length_raises_whichever_row_it_is(empty_start):
    stored = 5
    go_on = torch.arange(3) + stored + empty_start  # where a continuation's positions begin
    restarted = torch.arange(3) + empty_start  # numbered as over an empty store
    for rows in ([go_on, restarted], [restarted, go_on]):
        with pytest.raises(RuntimeError, match="numbers its 3 token"):
            _given(torch.stack(rows), _Store(stored, empty_start))


@pytest.mark.parametrize("empty_start", [0, 2])
def test_rows_that_all_continue_pass_unchanged(empty_start):
    stored = 5
    rows = torch.stack([torch.arange(3) + stored + empty_start, torch.arange(3) + stored + empty_start + 4])
    out = _given(rows, _Store(stored, empty_start))
    assert torch.equal(out, rows)
    assert torch.equal(_given(rows, _Store(0, empty_start)), rows)  # an empty store: nothing to check
