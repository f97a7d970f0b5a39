"""PagePool slots: `reserve` grows only by what the free list lacks, and by all of it at once
(however small the pool); the pool fills to exactly `max_pages`; a released slot is handed out
again before the pool grows, and no slot is ever live twice."""

import pytest
import torch

from kvtopo.runtime.page_pool import PagePool, PoolExhausted


def _pool(**kwargs):
    return PagePool(1, 4, 2, 2, torch.float32, torch.device("cpu"), **kwargs)


@pytest.mark.parametrize("free", [1, 3, 8])
def test_reserve_of_slots_already_free_does_not_grow(free):
    pool = _pool()
    slots = [pool.allocate() for _ in range(16)]
    for slot in slots[:free]:
        pool.release(slot)
    capacity, nbytes = pool.capacity, pool.nbytes
    pool.reserve(free)  # no budget (spare None): a growth would add a step of free slots
    assert (pool.capacity, pool.nbytes) == (capacity, nbytes)
    pool.spare = 0  # a budget that leaves no room for free slots beyond those needed
    pool.reserve(free + 1)  # one more than is free: grows by exactly that one
    assert (pool.capacity, pool.spare) == (capacity + 1, 0)


@pytest.mark.parametrize("slots", [1, 5, 40])
def test_reserve_on_a_small_pool_grows_by_every_slot_needed_at_once(slots):
    pool = _pool()
    pool.reserve(slots)  # a fresh pool: its step rule (an eighth of nothing) is below the need
    assert pool.capacity >= slots
    capacity = pool.capacity
    taken = [pool.allocate() for _ in range(slots)]
    assert pool.capacity == capacity and sorted(taken) == list(range(slots))


def test_pool_fills_to_exactly_max_pages_and_reuses_a_released_slot():
    pool = _pool(max_pages=5)
    taken = [pool.allocate() for _ in range(5)]
    assert sorted(taken) == list(range(5)) and pool.capacity == 5 and pool.live_pages == 5
    with pytest.raises(PoolExhausted):
        pool.allocate()
    pool.release(taken[2])
    assert pool.allocate() == taken[2] and pool.capacity == 5
    with pytest.raises(PoolExhausted):
        pool.reserve(1)
