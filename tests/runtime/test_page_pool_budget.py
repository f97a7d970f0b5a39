"""PagePool growth held to a byte budget: `reserve` grows once by the slots needed, `spare`
bounds how many free slots a growth step may add beyond them."""

import torch

from kvtopo.runtime.page_pool import PagePool


def _pool(pages: int) -> PagePool:
    pool = PagePool(1, 4, 2, 2, torch.float32, torch.device("cpu"))
    for _ in range(pages):
        pool.allocate()
    return pool


def test_unbounded_growth_steps_by_an_eighth():
    pool = _pool(64)
    pool.allocate()
    assert pool.capacity == 72


def test_reserve_grows_by_the_slots_needed_when_the_budget_leaves_none():
    pool = _pool(64)
    pool.spare = 0
    pool.reserve(3)
    assert pool.capacity == 67
    for _ in range(3):
        pool.allocate()
    assert pool.capacity == 67  # the reserved slots, no growth step on top
    pool.allocate()
    assert pool.capacity == 68


def test_spare_bounds_the_step_and_is_spent():
    pool = _pool(64)
    pool.spare = 2
    pool.reserve(1)
    assert (pool.capacity, pool.spare) == (66, 1)  # the step cut to the slot needed and the 2 spare
    pool.spare = 100
    pool.reserve(4)
    assert (pool.capacity, pool.spare) == (74, 94)  # a whole step of an eighth (2 of its 8 slots needed)
