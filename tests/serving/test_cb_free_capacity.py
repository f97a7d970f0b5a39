"""Byte admission sees a request's bytes come back as soon as the engine frees it (finished,
cancelled or evicted): the free share the scheduler and the offloading manager read right after
a release is the budget less what the session then holds (measured by hand from `stats()`),
not the bytes held before the release -- with those, the offloading manager, which frees victims
one by one and asks again after each, would never see room appear and would evict every request
but one."""

from contextlib import contextmanager

from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvtopo.config import Config
from kvtopo.models import zoo
from kvtopo.runtime.session import Session
from kvtopo.serving.continuous_batching import KvtopoBatchingManager, ledger_blocks

from test_continuous_batching import GREEDY, _prompts


@contextmanager
def _two_requests_three_steps_in(budget: int):
    """An engine over a compressing session holding two requests (40 and 50 tokens) three loop
    steps in: (the active session, the batch processor)."""
    prompts = _prompts((40, 50), seed=8)
    session = Session(Config(page_size=16, sink_tokens=16, recent_tokens=16))
    engine = ContinuousBatchingConfig(num_blocks=ledger_blocks([len(p) + 50 for p in prompts], 16), page_size=16,
                                      max_batch_tokens=512, safety_margin=0.0)
    manager = KvtopoBatchingManager(zoo.build("llama"), session, GREEDY, engine, kv_budget_bytes=budget)
    with session:
        processor = manager._create_batch_processor()
        manager.batch_processor, manager.current_batch = processor, 0
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=50)
        for _ in range(3):
            manager._generation_loop_body(processor, bootstrapping=False)
        yield session, processor


def test_free_capacity_right_after_a_release_counts_the_released_bytes():
    budget = 10 ** 7
    with _two_requests_three_steps_in(budget) as (session, processor):
        cache = processor.cache
        assert len(cache.sequence_of) == 2
        before = cache.compute_free_capacity(relative=False)
        assert before == max(0, budget - session.stats().total_bytes - cache._reserved)
        held_before = session.stats().total_bytes
        cache.free_blocks("r0")
        held = session.stats().total_bytes
        assert held < held_before  # r0's codes and metadata are gone (its pool slots stay, free)
        assert cache.compute_free_capacity(relative=False) == max(0, budget - held - cache._reserved) > before


def test_starved_requests_are_counted_against_what_the_budget_leaves_in_turn():
    """`count_storable_requests` (the offloading manager evicts until every starved request fits):
    with room for the first starved request's next 16 tokens and half the second's, one fits,
    not both (each admitted one's bytes are taken from what is left before the next is asked)."""
    with _two_requests_three_steps_in(10 ** 7) as (session, processor):
        cache = processor.cache
        states = [processor.scheduler.active_requests[f"r{i}"] for i in range(2)]
        costs = [cache._cost(state, 16, {})[0] for state in states]
        assert all(c > 0 for c in costs)
        processor.scheduler.starved_requests = [(state, 16) for state in states]
        needed = [{name: 0 for name in cache.cache_allocators}] * 2
        used = session.stats().total_bytes + cache._reserved
        for room, fits in ((costs[0] - 1, 0), (costs[0] + costs[1] // 2, 1), (10 ** 6 + sum(costs), 2)):
            cache.budget_bytes = used + room
            assert cache.count_storable_requests(needed) == fits, (room, costs)
