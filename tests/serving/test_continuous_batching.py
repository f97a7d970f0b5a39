"""kvtopo as the KV cache of transformers' continuous batching (serving/continuous_batching.py)."""

import random

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

import kvtopo
from kvtopo.config import Config
from kvtopo.models import zoo
from kvtopo.runtime.layer_cache import SequenceKV
from kvtopo.runtime.session import Session
from kvtopo.serving import continuous_batching
from kvtopo.serving.continuous_batching import (ATTN_IMPLEMENTATION, KvtopoBatchingManager, generate_batch,
                                                ledger_blocks, page_ownership_errors)
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

GREEDY = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(**overrides):
    # Small enough that prefills are split over several forwards and requests join mid-run.
    return ContinuousBatchingConfig(**{"num_blocks": 32, "page_size": 32, "max_batch_tokens": 64, **overrides})


def _reference(model, prompt, new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_the_engines_own_cache_tensor_is_never_allocated(monkeypatch):
    """The engine sizes its flat cache tensor to the memory it finds free (on CPU, most of the
    machine's) and zero-fills it; kvtopo holds the keys and values, so that tensor is made on the
    meta device, never in memory."""
    made, zeros = [], torch.zeros

    def recording(*args, **kwargs):
        out = zeros(*args, **kwargs)
        if out.dtype is torch.uint8:
            made.append((out.numel(), out.device.type))
        return out

    monkeypatch.setattr(torch, "zeros", recording)
    result = generate_batch(zoo.build("llama"), _prompts([20, 30]), Config(), max_new_tokens=2,
                            generation_config=GREEDY)
    assert len(result.outputs) == 2
    assert made and all(device == "meta" for _, device in made) and max(n for n, _ in made) > 2 ** 20


def test_each_request_reports_what_its_sequence_held_when_it_finished():
    """`BatchResult.request_stats`: each request's own bytes over every layer, measured before its
    pages are released, against an fp16 cache of the tokens it stored (its prompt and all but the
    last generated token, which is never fed back)."""
    model = zoo.build("llama")
    c = model.config
    fp16_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    prompts = _prompts([300, 420])
    lossless = generate_batch(model, prompts, Config.lossless(), max_new_tokens=6, generation_config=GREEDY)
    compressed = generate_batch(model, prompts, Config(), max_new_tokens=6, generation_config=GREEDY)
    for result in (lossless, compressed):
        assert [b.fp16_bytes for b in result.request_stats.values()] == [(n + 5) * fp16_per_token for n in (300, 420)]
    # Both finish on the same step, so the lossless peak (before the first release) holds both whole.
    assert sum(b.total_bytes for b in lossless.request_stats.values()) == \
        lossless.peak.total_bytes - lossless.peak.per_kind["free"]
    for rid, held in compressed.request_stats.items():
        assert held.total_bytes < lossless.request_stats[rid].total_bytes
    assert compressed.request_stats["req_1"].ratio_vs_fp16 > 1 > lossless.request_stats["req_1"].ratio_vs_fp16
    assert lossless.request_stats["req_1"].held_tokens == (425,) * c.num_hidden_layers
    assert compressed.request_stats["req_1"].tokens == 425 > min(compressed.request_stats["req_1"].held_tokens)


def test_lossless_tokens_equal_the_engines_own_paged_cache(monkeypatch):
    """Same tokens as the engine's own cache; every forward attends its decode steps in one
    `attend_sequences` call per layer, and no single-token span alone."""
    model = zoo.build("llama")
    prompts = _prompts((40, 75, 13, 130))
    own = model.generate_batch(prompts, generation_config=GREEDY, max_new_tokens=12,
                               continuous_batching_config=_engine())
    session = Session(Config.lossless())
    forwards, batched, single = [], [], []
    start_forward = continuous_batching.KvtopoPagedCache._start_forward

    def recording_start(cache):
        start_forward(cache)
        forwards.append([span.seq for span in cache._spans if span.tokens == 1])

    monkeypatch.setattr(continuous_batching.KvtopoPagedCache, "_start_forward", recording_start)
    # kvtopo attends from its store, so the engine's read indices (every held token) are never built.
    read_indices = []
    get_read_indices = FullAttentionCacheAllocator.get_read_indices
    monkeypatch.setattr(FullAttentionCacheAllocator, "get_read_indices",
                        lambda alloc, *a: read_indices.append(a) or get_read_indices(alloc, *a))
    attend_sequences, attend_sequence = session.attend_sequences, session.attend_sequence
    session.attend_sequences = lambda layer, seqs, *a, **kw: batched.append((layer, list(seqs))) or attend_sequences(
        layer, seqs, *a, **kw)
    session.attend_sequence = lambda layer, seq, q, *a, **kw: single.append(q.shape[1]) or attend_sequence(
        layer, seq, q, *a, **kw)
    result = generate_batch(model, prompts, max_new_tokens=12, generation_config=GREEDY,
                            continuous_batching_config=_engine(), session=session)

    assert list(result.outputs) == list(own) == [f"req_{i}" for i in range(len(prompts))]
    for request_id, out in result.outputs.items():
        assert len(out.generated_tokens) == 12
        assert out.generated_tokens == own[request_id].generated_tokens, request_id
    layers = [str(i) for i in range(model.config.num_hidden_layers)]
    assert batched == [(layer, seqs) for seqs in forwards if seqs for layer in layers]
    assert forwards and not read_indices
    assert max(len(seqs) for seqs in forwards) == len(prompts)  # all four decoded in one forward
    assert single and min(single) > 1
    # The kvtopo run went through kvtopo's store: every layer held every request at its peak.
    assert len(result.peak.per_layer) == model.config.num_hidden_layers
    assert result.peak.total_bytes > 0
    # Finished requests gave their pages back; the model has its own attention again.
    assert all(not cache.sequences and cache.pool.live_pages == 0 for cache in session.layers.values())
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model, "_cached_continuous_batching_manager")


def test_a_compiled_model_batches_as_the_uncompiled_one():
    """A `kvtopo.compile`d model in continuous batching: its graphs break around the attention
    function, host code that runs as it is, and Dynamo recompiles only for new shapes. Before,
    Dynamo traced into the attention and failed on a guard of its own making; then it traced the
    cache's bookkeeping down to the session's pages, and compiled each layer's attention frame for
    its layer index (SmolLM2's 30 layers: past the recompile limit, with a warning)."""
    from torch._dynamo.utils import guard_failures

    model = zoo.build("llama")
    prompts = _prompts((20, 37))
    plain = generate_batch(model, prompts, Config.lossless(), max_new_tokens=5, generation_config=GREEDY)
    torch._dynamo.reset()
    guard_failures.clear()
    kvtopo.compile(model, inductor=False)
    compiled = generate_batch(model, prompts, Config.lossless(), max_new_tokens=5, generation_config=GREEDY)
    assert [out.generated_tokens for out in compiled.outputs.values()] == \
        [out.generated_tokens for out in plain.outputs.values()]
    assert all(len(out.generated_tokens) == 5 for out in compiled.outputs.values())
    cache = continuous_batching.KvtopoPagedCache
    host_code = [cache._start_forward, SequenceKV.block_table.fget]
    traced = [f.__qualname__ for f in host_code if torch._C._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__)]
    assert not traced, f"Dynamo compiled kvtopo's host bookkeeping: {traced}"
    reasons = [str(reason) for failures in guard_failures.values() for reason in failures]
    assert reasons and not [r for r in reasons if "layer_idx" in r or "_recorded" in r], reasons


def test_default_compressed_config_holds_fewer_bytes_and_generates():
    model = zoo.build("llama")
    prompts = _prompts((420, 380, 300), seed=3)
    runs = {}
    for name, config in (("lossless", Config.lossless()), ("topo", Config())):
        # Config() is admitted by its bytes, within half of what lossless held (generate_batch sizes the ledger).
        budget = runs["lossless"].peak.total_bytes // 2 if runs else None
        runs[name] = generate_batch(model, prompts, config, max_new_tokens=6, generation_config=GREEDY,
                                    continuous_batching_config=_engine(num_blocks=None if budget else 64,
                                                                       max_batch_tokens=512),
                                    kv_budget_bytes=budget)
    for out in runs["topo"].outputs.values():
        assert len(out.generated_tokens) == 6
        assert all(0 <= t < model.config.vocab_size for t in out.generated_tokens)
    topo, exact = runs["topo"].peak, runs["lossless"].peak
    assert topo.per_kind["mid"] > 0  # pages were compressed
    assert topo.total_bytes < exact.total_bytes / 2, (topo.total_bytes, exact.total_bytes)


def _run_stream(manager, prompts, new_tokens, session=None, budget=None):
    """Drive `manager` one engine step at a time over requests all arriving at once:
    (peak active requests, tokens per request). With `session`: its bytes after every step stay
    within `budget`."""
    processor = manager._create_batch_processor()
    manager.batch_processor, manager.current_batch = processor, 0
    for i, prompt in enumerate(prompts):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new_tokens)
    peak = 0
    for step in range(300):
        manager._generation_loop_body(processor, bootstrapping=False)
        peak = max(peak, len(processor.scheduler.active_requests))
        if session is not None:
            assert session.stats().total_bytes <= budget, (step, session.stats().total_bytes, budget)
        if not processor.has_pending_requests():
            break
    outputs = {}
    while not manager.output_router.output_queue.empty():
        out = manager.output_router.output_queue.get()
        outputs[out.request_id] = out.generated_tokens
    assert len(outputs) == len(prompts)
    return peak, outputs


def kept_per_page_at_release(prompt, config, engine, told: list) -> dict:
    """Each layer's kept tokens per page of `prompt`'s sequence, taken as the engine releases it
    after one generated token under `engine`; each attend's `prompt_end` is appended to `told`."""
    session = Session(config)
    kept, release, attend = {}, session.release, session.attend_sequence

    def snapshot_then_release(seq):
        kept.update({name: [page.kept for page in layer.stored_state(seq).pages]
                     for name, layer in session.layers.items()})
        release(seq)

    session.release = snapshot_then_release
    session.attend_sequence = lambda *a, prompt_end=0, **kw: told.append(prompt_end) or attend(
        *a, prompt_end=prompt_end, **kw)
    generate_batch(zoo.build("llama"), prompt, config, max_new_tokens=1, generation_config=GREEDY,
                   continuous_batching_config=engine, session=session)
    return kept


def test_a_prompt_the_engine_splits_waits_for_its_end_as_one_chunk(monkeypatch):
    """The engine splits a 600-token prompt into forwards of 64 tokens; each chunk is told where
    the prompt ends, so its pages wait in Recent and are ranked at the end, keeping per page what
    the prompt in one forward keeps (successor shares off: a waiting page's are its own chunk's,
    tests/runtime/test_lifecycle.py). Told nothing (`prompt_hold_tokens=0` moves pages as chunks
    push them out of Recent), other tokens survive."""
    import kvtopo.runtime.policies.topo as topo

    monkeypatch.setattr(topo, "SUCCESSOR_WEIGHT", 0.0)
    prompt = _prompts((600,), seed=7)
    told = []

    def kept_per_page(config, batch_tokens):
        return kept_per_page_at_release(prompt, config, _engine(num_blocks=64, max_batch_tokens=batch_tokens), told)

    config = Config(recent_tokens=64)
    whole = kept_per_page(config, 1024)
    assert told == [600] * 2  # one forward, each layer
    told.clear()
    assert kept_per_page(config, 64) == whole
    assert told == [600] * 2 * 10  # ten forwards of at most 64 tokens
    assert kept_per_page(config.replace(prompt_hold_tokens=0), 64) != whole


def test_byte_budget_admits_more_requests_than_the_engines_own_cache():
    """One K/V byte budget: transformers' own cache gets that many bytes of blocks; kvtopo admits by
    its measured bytes (Config()'s coding: more requests at once; lossless: the engine's own tokens), and
    never holds more than the budget after a step."""
    prompts, new_tokens = _prompts((300, 290, 310, 295, 305, 285), seed=5), 6
    token_bytes = 512  # zoo llama: 2 layers x (k + v) x 2 kv-heads x 16 dims x float32
    budget = 2 * 320 * token_bytes  # the engine's cache: two of these requests (10 blocks of 32 each)
    engine = dict(page_size=32, max_batch_tokens=256, safety_margin=0.0)
    own_peak, own = _run_stream(ContinuousBatchingManager(zoo.build("llama"), GREEDY, ContinuousBatchingConfig(
        num_blocks=budget // (32 * token_bytes), **engine)), prompts, new_tokens)
    ledger = ContinuousBatchingConfig(num_blocks=ledger_blocks([len(p) + new_tokens for p in prompts], 32), **engine)
    runs = {}
    # Config()'s coding with a Recent window that these ~300-token prompts get past into Mid.
    for name, config in (("lossless", Config.lossless()), ("topo", Config(recent_tokens=64))):
        session = Session(config)
        manager = KvtopoBatchingManager(zoo.build("llama"), session, GREEDY, ledger, kv_budget_bytes=budget)
        with session:
            runs[name] = _run_stream(manager, prompts, new_tokens, session, budget)
        assert manager.kv_cache.budget_misses == 0
        assert manager.kv_cache.peak.total_bytes <= budget
        assert manager.kv_cache.request_stats is None  # not asked for: a server keeps nothing per finished request
    assert runs["lossless"][1] == own
    assert own_peak == 2
    assert runs["topo"][0] > own_peak, (runs["topo"][0], own_peak)


def test_interleaved_joins_evictions_and_finishes_keep_pages_owned():
    """Requests join, are cancelled, evicted by the engine (re-prefilled later) and finish, one
    engine step at a time, admitted by kvtopo's bytes under a budget that forces evictions; after
    every step no pool slot is in two sequences' block tables, every live slot belongs to a live
    request, the session holds no more than the budget, and finished requests' tokens equal HF
    generate's."""
    rng = random.Random(16)
    reference_model = zoo.build("llama")
    plans = [(f"r{i}", _prompts((rng.randint(4, 70),), seed=100 + i)[0], rng.randint(2, 24)) for i in range(14)]
    expected = {rid: _reference(reference_model, prompt, new) for rid, prompt, new in plans}

    model = zoo.build("llama")
    session = Session(Config.lossless(page_size=8))
    budget = 96 * 512  # 96 tokens of the zoo llama's float32 K/V
    manager = KvtopoBatchingManager(model, session, GREEDY,
                                    _engine(num_blocks=200, page_size=16, max_batch_tokens=40, safety_margin=0.0),
                                    kv_budget_bytes=budget)
    released_slots = {}  # layer -> slots freed by released sequences, not yet seen again
    reused = 0
    release = session.release

    def recording_release(seq):
        for name, cache in session.layers.items():
            if seq in cache.sequences:
                released_slots.setdefault(name, set()).update(cache.sequences[seq].block_table.tolist())
        release(seq)

    session.release = recording_release
    seqs_seen: dict[str, set[int]] = {}
    cancelled, pending = set(), list(plans)
    with session:
        processor = manager._create_batch_processor()
        manager.batch_processor, manager.current_batch = processor, 0
        cache = processor.cache
        for step in range(400):
            if pending and rng.random() < 0.35:
                rid, prompt, new = pending.pop(0)
                manager.add_request(prompt, request_id=rid, max_new_tokens=new)
            active = list(processor.scheduler.active_requests)
            # Never the last active request: transformers 5.24 then stalls after an eviction (its
            # scheduler blocks new requests until an active one finishes, and none is left to).
            if len(active) > 1 and rng.random() < 0.04:
                victim = rng.choice(active)
                manager.cancel_request(victim)
                cancelled.add(victim)
            manager._generation_loop_body(processor, bootstrapping=False)

            assert page_ownership_errors(session) == [], step
            assert session.stats().total_bytes <= budget, step
            live = set(cache.sequence_of.values())
            for name, layer in session.layers.items():
                assert set(layer.sequences) <= live, (step, name)
                for seq, entry in layer.sequences.items():
                    again = released_slots.get(name, set()) & set(entry.block_table.tolist())
                    reused += len(again)
                    released_slots[name] = released_slots.get(name, set()) - again
            for rid, seq in cache.sequence_of.items():
                seqs_seen.setdefault(rid, set()).add(seq)
            if not pending and not processor.has_pending_requests():
                break
    results = {}
    while not manager.output_router.output_queue.empty():
        out = manager.output_router.output_queue.get()
        results[out.request_id] = out

    finished = {rid for rid, _, _ in plans} - cancelled
    assert finished <= set(results) and len(finished) >= 8
    for rid in finished:
        assert results[rid].error is None, results[rid].error
        assert results[rid].generated_tokens == expected[rid], rid
    evicted = [rid for rid, seqs in seqs_seen.items() if len(seqs) > 1]
    assert evicted, "the engine evicted no request: the test did not exercise re-prefill"
    assert reused > 0
    print(f"{len(finished)} finished, {len(cancelled)} cancelled, evicted {evicted}, {reused} released slots reused")
    assert all(not layer.sequences and layer.pool.live_pages == 0 for layer in session.layers.values())
    assert cache.budget_misses == 0
    assert cache.cache_tensor.device.type == "meta"  # the engine's own KV tensor was never materialised
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_refuses_other_engine_features(monkeypatch):
    model = zoo.build("llama")
    with pytest.raises(RuntimeError, match="kvtopo_paged|runs only inside"):
        # The registered attention outside kvtopo's engine has no store to read the history from.
        KvtopoBatchingManager(model, Session(), GREEDY)  # registers it; the model now asks for it
        model(torch.tensor([[1, 2, 3]]))
    model = zoo.build("llama")
    with pytest.raises(NotImplementedError, match="num_return_sequences"):
        KvtopoBatchingManager(model, Session(), GenerationConfig(num_return_sequences=2, do_sample=True))
    with pytest.raises(NotImplementedError, match="full-attention"):
        KvtopoBatchingManager(zoo.build("mistral-sw", zoo.attn_implementations("mistral-sw")[0]), Session(), GREEDY)
    monkeypatch.setattr(continuous_batching.transformers, "__version__", "5.25.0")
    with pytest.raises(RuntimeError, match="transformers 5.24.0 only"):
        generate_batch(model, [[1, 2, 3]], Config.lossless(), max_new_tokens=2, generation_config=GREEDY)


def session_with_full_pools() -> Session:
    """A lossless session of 4-token pages whose two layers (the zoo llama's 2 kv-heads x 16 dims)
    hold one sequence filling pools of 64 slots or more: the next page makes each pool grow."""
    session = Session(Config.lossless(page_size=4))
    kv = lambda: torch.randn(2, 4, 16)  # noqa: E731  one page
    with session:
        full = lambda c: c.pool.capacity >= 64 and c.pool.capacity == c.pool.live_pages  # noqa: E731
        while len(session.layers) < 2 or not all(full(c) for c in session.layers.values()):
            for layer in ("0", "1"):
                session.attend_sequence(layer, 0, torch.randn(4, 4, 16), kv(), kv(), 0.25)
    return session


def test_a_decode_that_opens_a_page_is_charged_one_page_not_a_growth_step():
    """Byte admission charges a full pool one page per layer for the next page (the cache reserves
    exactly that slot), where the pool's own step would add an eighth of its capacity."""
    model_config = zoo.build("llama").config
    session = session_with_full_pools()
    with session:
        growth = continuous_batching._Growth(session, model_config, torch.float32)
        length = session.layers["0"].length(0)
        page = session.layers["0"].pool.page_nbytes
        assert growth.of(0, length, 1, 0, {}) == (2 * (page + 4), {"0": 1, "1": 1})  # + its block-table entry


@pytest.mark.parametrize("policy,keeps", [("topo", True), ("snapkv", False)])
def test_a_waiting_chunk_is_charged_the_credit_its_policy_keeps(policy, keeps):
    """A chunk with more of its prompt to come is charged, per token and layer, the credit its
    policy keeps for the ranking at the prompt's end (topo's successor shares); a policy that keeps
    none (SnapKV) is charged none (before, every evicting policy was)."""
    from kvtopo.runtime.layer_cache import held_credit_nbytes

    model_config = zoo.build("llama").config  # 2 layers, 2 kv-heads
    session = Session(Config(policy=policy, target_ratio=4))
    assert session.policy.keeps_held_credit is keeps
    growth = continuous_batching._Growth(session, model_config, torch.float32)
    waiting, last = growth.of(None, 0, 64, 256, {}), growth.of(None, 0, 64, 64, {})
    assert waiting[1] == last[1]
    assert waiting[0] - last[0] == (2 * 64 * held_credit_nbytes(2) if keeps else 0)


def test_a_session_already_holding_sequences_is_refused():
    """Requests are numbered from 0 and released in every layer when they end: in a session that
    holds a conversation, the first finished request wiped that conversation's row 0."""
    session = Session(Config.lossless())
    with session, torch.no_grad():
        session.attend("other/layer", torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8),
                       None, 0.35)
        with pytest.raises(ValueError, match="already holds sequences"):
            KvtopoBatchingManager(zoo.build("llama"), session, GREEDY)
        assert session.stats().tokens == (5,)


def test_a_stopped_manager_starts_again_through_kvtopos_store():
    """transformers' stop() puts the model's own attention back; before, a second start() ran sdpa
    over kvtopo's cache, which stores nothing, and every request failed."""
    model, reference = zoo.build("llama"), zoo.build("llama")
    session = Session(Config.lossless(page_size=16))
    manager = KvtopoBatchingManager(model, session, GREEDY, _engine(num_blocks=200, page_size=16))
    with session:
        for round_, lengths in enumerate(([40, 50], [20, 30])):
            manager.start()
            prompts = _prompts(lengths, seed=4 + round_)
            ids = [manager.add_request(p, max_new_tokens=5) for p in prompts]
            results = [manager.get_result(request_id=i, timeout=120) for i in ids]
            manager.stop(block=True, timeout=60)
            assert model.config._attn_implementation != ATTN_IMPLEMENTATION  # stop() put it back
            for result, prompt in zip(results, prompts):
                assert result.error is None and list(result.generated_tokens) == _reference(reference, prompt, 5)


@pytest.mark.parametrize("bad,reason", [([], "is empty"), ([3, -1], "outside the vocabulary"),
                                        ([3, 256], "outside the vocabulary"), ([3, 1.5], "not integer token ids")])
def test_bad_prompts_are_refused_before_the_engine_runs(bad, reason):
    """Before: an empty prompt got another request's first token; an id outside the vocabulary
    failed the whole batch inside the model; a float id was truncated."""
    session = Session(Config.lossless())
    with pytest.raises(ValueError, match=f"prompt 1 {'holds values' if 'integer' in reason else ''}.*{reason}"):
        generate_batch(zoo.build("llama"), [[1, 2, 3], bad], session=session, max_new_tokens=2)
    assert not session.layers


def test_a_prompt_tensor_is_taken_and_add_request_checks_prompts_too():
    """A 1-d integer tensor is a prompt (as the engine's own generate_batch takes it); the manager's
    add_request, which `transformers serve` calls, refuses an empty prompt before the engine sees it
    (alone it killed the engine's worker)."""
    model, reference = zoo.build("llama"), zoo.build("llama")
    prompt = _prompts([20], seed=9)[0]
    result = generate_batch(model, [torch.tensor(prompt)], Config.lossless(), max_new_tokens=3, generation_config=GREEDY)
    assert list(next(iter(result.outputs.values())).generated_tokens) == _reference(reference, prompt, 3)
    manager = KvtopoBatchingManager(model, Session(Config.lossless()), GREEDY)
    with pytest.raises(ValueError, match="KvtopoBatchingManager.add_request: prompt 0 is empty"):
        manager.add_request([], max_new_tokens=2)


def test_kvtopo_generate_refuses_a_session_an_engine_serves_from():
    """kvtopo.generate clears the active session first: in a session holding an engine's requests
    it would have dropped every one of them."""
    session = Session(Config.lossless())
    KvtopoBatchingManager(zoo.build("llama"), session, GREEDY)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with session, pytest.raises(RuntimeError, match="holds the requests of a continuous-batching engine"):
        kvtopo.generate(model, torch.tensor([_prompts([10], seed=1)[0]]), 2)


@pytest.mark.parametrize("name", ["llama", "deepseek-v3"])
def test_a_new_layers_first_page_is_priced_at_its_real_size(name):
    """Before a layer's pool exists, byte admission prices its first page from the model config:
    keys and values at their own widths (DeepSeek's `qk_head_dim` and `v_head_dim`; its `head_dim`
    is the RoPE part only, which priced the page at under half its size)."""
    model = zoo.build(name)
    session = Session(Config.lossless())
    growth = continuous_batching._Growth(session, model.config, torch.float32)
    generate_batch(model, _prompts((20,)), session=session, max_new_tokens=2, generation_config=GREEDY,
                   kv_budget_bytes=10**7)
    assert {cache.pool.page_nbytes for cache in session.layers.values()} == {growth.first_page_nbytes}
