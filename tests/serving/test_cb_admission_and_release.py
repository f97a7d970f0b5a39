"""kvtopo's continuous-batching cache (serving/continuous_batching.py): what tests/serving/
test_continuous_batching.py leaves open.

* byte admission of several requests in one scheduling round: each admitted request's bytes are
  reserved before the next is asked about, so a round that could pack them all admits only what
  the budget holds together;
* the estimate of a new sequence's observation window is the bytes the session then holds for it;
* a one-token chunk with more of its prompt to come is a prompt chunk (told where its prompt
  ends), not a decode step;
* the engine's ledger from `ledger_blocks` holds every request at once: a byte budget that never
  binds admits them all together;
* a batch processor reset with requests still in flight (what a restart of the manager does)
  releases their pages in the session.
"""

import pytest
import torch
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from kvtopo.config import Config
from kvtopo.models import zoo
from kvtopo.runtime.session import Session
from kvtopo.serving import continuous_batching
from kvtopo.serving.continuous_batching import KvtopoBatchingManager, generate_batch, ledger_blocks, \
    page_ownership_errors

from test_continuous_batching import GREEDY, _engine, _prompts, _reference, _run_stream, kept_per_page_at_release, \
    session_with_full_pools

TOKEN_BYTES = 512  # zoo llama: 2 layers x (k + v) x 2 kv-heads x 16 dims x float32


def test_one_scheduling_round_admits_only_what_the_budget_holds_together():
    """Six 40-token prompts arrive at once and one forward could pack them all (512 batch tokens);
    each needs 3 pages of 16 tokens per layer, and the budget holds three such requests. The
    round must admit three (their bytes reserved one after another), not six that each fit alone."""
    prompts, new_tokens = _prompts((40,) * 6, seed=11), 4
    page_bytes = 16 * TOKEN_BYTES
    budget = 3 * 3 * page_bytes + 3 * 3 * 2 * 4 + 1000  # three requests' pages, block tables, a little slack
    session = Session(Config.lossless(page_size=16))
    engine = ContinuousBatchingConfig(num_blocks=ledger_blocks([len(p) + new_tokens for p in prompts], 16),
                                      page_size=16, max_batch_tokens=512, safety_margin=0.0)
    manager = KvtopoBatchingManager(zoo.build("llama"), session, GREEDY, engine, kv_budget_bytes=budget)
    with session:
        peak, outputs = _run_stream(manager, prompts, new_tokens, session, budget)  # bytes <= budget every step
    assert manager.kv_cache.budget_misses == 0
    assert manager.kv_cache.peak.total_bytes <= budget
    assert 2 <= peak <= 3, peak  # several at once, never more than the budget holds
    reference = zoo.build("llama")
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == [_reference(reference, p, new_tokens) for p in prompts]


def test_a_new_sequences_observation_window_is_charged_what_the_session_holds():
    """Byte admission charges a new sequence's observation window (float16 queries of every query
    head): the bytes the session holds for it once the window is full."""
    model_config = zoo.build("llama").config  # 4 query heads, 2 kv-heads, head_dim 16
    session = Session(Config(recent_tokens=64))
    growth = continuous_batching._Growth(session, model_config, torch.float32)
    assert growth.lifecycle.observes
    window = session.config.observation_window
    q, kv = torch.randn(4, window + 8, 16), torch.randn(2, window + 8, 16)
    with session:
        for layer in ("0", "1"):
            session.attend_sequence(layer, 0, q, kv, kv.clone(), 0.25)
    held = [session.layers[layer].stored_state(0).observation for layer in ("0", "1")]
    assert all(h is not None and h.shape[1] == window for h in held)
    assert growth.new_sequence_nbytes == held[0].nbytes == held[1].nbytes


def test_one_token_prompt_chunks_are_prompt_chunks(monkeypatch):
    """With one batch token per forward the engine feeds a prompt one token at a time: every chunk
    but the last has more of its prompt to come, so each is attended as a prompt chunk told where
    the prompt ends, and the pages kept equal those of the prompt in one forward (as
    test_a_prompt_the_engine_splits_waits_for_its_end_as_one_chunk checks for 64-token chunks).
    Attended as decode steps, the chunks were told nothing and pages moved before the end."""
    import kvtopo.runtime.policies.topo as topo

    monkeypatch.setattr(topo, "SUCCESSOR_WEIGHT", 0.0)
    prompt = _prompts((160,), seed=7)
    config = Config(page_size=16, sink_tokens=16, recent_tokens=32)

    def kept_per_page(batch_tokens):
        told = []
        engine = _engine(num_blocks=64, page_size=16, max_batch_tokens=batch_tokens)
        return kept_per_page_at_release(prompt, config, engine, told), told

    whole, _ = kept_per_page(256)
    assert any(k is not None and k < 16 for k in whole["0"]), whole  # Mid pages were evicted in part
    one_by_one, told = kept_per_page(1)
    assert told == [160] * 2 * 159  # every chunk but the last (a decode step: the prompt's last token)
    assert one_by_one == whole
    assert continuous_batching._Span("r", 0, 10, 1, 160).decodes is False
    assert continuous_batching._Span("r", 0, 159, 1, 160).decodes is True


def test_the_ledger_generate_batch_sizes_admits_every_request_at_once():
    """Under byte admission the engine's block ledger only indexes tokens: sized by
    `ledger_blocks`, with a budget that never binds, all requests run together even when their
    lengths are not multiples of the page size (each needs its last, partial block)."""
    lengths, new_tokens, page = (33, 47, 20, 61, 17), 3, 16
    prompts = _prompts(lengths, seed=2)
    session = Session(Config.lossless(page_size=page))
    engine = ContinuousBatchingConfig(num_blocks=ledger_blocks([len(p) + new_tokens for p in prompts], page),
                                      page_size=page, max_batch_tokens=512, safety_margin=0.0)
    manager = KvtopoBatchingManager(zoo.build("llama"), session, GREEDY, engine, kv_budget_bytes=10 ** 9)
    with session:
        peak, _ = _run_stream(manager, prompts, new_tokens)
    assert peak == len(prompts)
    assert ledger_blocks([n + new_tokens for n in lengths], page) >= sum(-(-(n + new_tokens) // page) for n in lengths)


def test_a_reset_with_requests_in_flight_releases_their_pages():
    """A restart reuses the engine's batch processor and resets it (`free_all_requests`): every
    request still holding pages gives them back to the session's pools, and the next request
    runs alone in a clean store."""
    model = zoo.build("llama")
    session = Session(Config.lossless(page_size=16))
    manager = KvtopoBatchingManager(model, session, GREEDY, _engine(num_blocks=200, page_size=16))
    with session:
        processor = manager._create_batch_processor()
        manager.batch_processor, manager.current_batch = processor, 0
        for i, prompt in enumerate(_prompts((40, 50), seed=8)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=50)
        for _ in range(4):
            manager._generation_loop_body(processor, bootstrapping=False)
        assert len(processor.cache.sequence_of) == 2 and session.stats().tokens  # both in flight
        assert manager._create_batch_processor() is processor  # what a restart does: reset, reused
        assert not processor.cache.sequence_of
        assert all(not layer.sequences and layer.pool.live_pages == 0 for layer in session.layers.values())
        prompt = _prompts((30,), seed=9)[0]
        manager.add_request(prompt, request_id="after", max_new_tokens=4)
        for _ in range(50):
            manager._generation_loop_body(processor, bootstrapping=False)
            assert page_ownership_errors(session) == []
            if not processor.has_pending_requests():
                break
    out = {}
    while not manager.output_router.output_queue.empty():
        result = manager.output_router.output_queue.get()
        out[result.request_id] = result.generated_tokens
    assert out["after"] == _reference(zoo.build("llama"), prompt, 4)


def test_the_peak_includes_a_requests_last_forward():
    """The session is measured after every forward, also the last one of a request before its pages
    are released: here that forward stores the 17th token, which opens a second 16-token page, and
    the peak (and with it the check for budget misses) must see it."""
    prompt = _prompts((16,), seed=12)
    result = generate_batch(zoo.build("llama"), prompt, Config.lossless(page_size=16), max_new_tokens=2,
                            generation_config=GREEDY)
    held = result.request_stats["req_0"]
    assert held.tokens == 17
    assert result.peak.total_bytes - result.peak.per_kind["free"] == held.total_bytes
    assert result.peak.per_layer and held.total_bytes >= 2 * 2 * 16 * TOKEN_BYTES // 2  # two pages in each of 2 layers


def test_growth_steps_at_reservation_share_what_the_budget_leaves_between_layers():
    """Before a forward each layer's pool grows by the slots admitted for it; a growth step (an
    eighth of a 64-slot pool) may add free slots only as far as the budget leaves, split between
    the layers: here 3.5 pages are left after the two admitted ones, so each of the two pools may
    add one spare slot, not three."""
    from types import SimpleNamespace

    session = session_with_full_pools()
    page = session.layers["0"].pool.page_nbytes
    held = session.stats().total_bytes
    reserved = 2 * (page + 4)  # one page and its block-table entry in each layer, admitted for the forward
    budget = held + reserved + int(3.5 * page)
    cache = SimpleNamespace(session=session, budget_bytes=budget, _reserved=reserved, _promised={"0": 1, "1": 1},
                            held_bytes=lambda: held)
    continuous_batching.KvtopoPagedCache._reserve_slots(cache)
    assert all(c.pool.capacity - c.pool.live_pages >= 1 for c in session.layers.values())  # the admitted slot
    assert session.stats().total_bytes <= budget, (session.stats().total_bytes, budget)


def test_the_safety_margin_is_judged_on_the_byte_budget():
    """transformers' scheduler starts no new prompt beside running requests while the free share of
    its cache is under `safety_margin`; under byte admission that share is the byte budget's
    (`compute_free_capacity`, in [0, 1]). With a margin of 0.7 the six requests are never all
    running together, though the budget holds them; with none, they are."""
    prompts, new_tokens = _prompts((40,) * 6, seed=14), 6
    budget = 10 * 6 * 16 * TOKEN_BYTES // 2  # ten such requests (3 pages of 16 tokens in each of 2 layers, and more)
    peaks, free = {}, []
    for margin in (0.0, 0.7):
        session = Session(Config.lossless(page_size=16))
        engine = ContinuousBatchingConfig(num_blocks=ledger_blocks([len(p) + new_tokens for p in prompts], 16),
                                          page_size=16, max_batch_tokens=48, safety_margin=margin)
        manager = KvtopoBatchingManager(zoo.build("llama"), session, GREEDY, engine, kv_budget_bytes=budget)
        with session:
            peaks[margin], _ = _run_stream(manager, prompts, new_tokens, session, budget)
        cache = manager.kv_cache
        free.append((cache.compute_free_capacity(), cache.compute_free_capacity(relative=False)))
    assert peaks[0.0] == len(prompts) and peaks[0.7] < len(prompts), peaks
    for relative, absolute in free:
        assert 0 <= relative <= 1 and absolute > 1 and relative == pytest.approx(absolute / budget)
