"""PagePool growth held to a byte budget: `reserve` grows once by the slots needed, `spare`
bounds how many free slots a growth step may add beyond them."""

import pytest
import torch

from kvtopo.runtime.page_pool import PagePool


@pytest.mark.parametrize("spare, slots, capacity, left", [
    (None, 3, 72, None),  # no budget: the step of an eighth
    (0, 3, 67, 0),  # the budget leaves nothing: the slots needed only
    (2, 1, 66, 1),  # the step cut to the slot needed and 2 spare
    (100, 4, 72, 96),  # the budget allows the whole step
])
def test_reserve_grows_by_the_needed_slots_plus_at_most_the_spare(spare, slots, capacity, left):
    pool = PagePool(1, 4, 2, 2, torch.float32, torch.device("cpu"))
    for _ in range(64):
        pool.allocate()
    pool.spare = spare
    pool.reserve(slots)
    assert (pool.capacity, pool.spare) == (capacity, left)
    for _ in range(slots):
        pool.allocate()
    assert pool.capacity == capacity  # the reserved slots were handed out with no growth on top
