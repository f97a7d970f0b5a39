"""The four-phase lifecycle, Mid/Recent codecs in the store, budgets and honest byte accounting."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache, best_tokens
from kvtopo.runtime.lifecycle import BudgetExceeded
from kvtopo.runtime.phases import Phase, PhasePlan
from kvtopo.runtime.policies import make_policy
from kvtopo.runtime.policies.topo import (ANCHOR_REACH, SUCCESSORS, anchor_reach, carry_forward, low_norm_prior,
                                          successor_credit, topo_scores)

from segments_reference import explicit_kv
from store_walk import held_tensor_bytes


def _cache(**fields) -> LayerCache:
    config = kvtopo.Config(**fields)
    return LayerCache(config, make_policy(config))


def _structured_kv(n, heads=2, dim=16, seed=0, dtype=torch.float32):
    """Keys/values with a decaying spectrum (what projection is for) plus noise."""
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -2, dim)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0]
    k = (torch.randn(heads, n, dim, generator=g) * spectrum) @ basis.T
    v = (torch.randn(heads, n, dim, generator=g) * spectrum) @ basis
    return k.to(dtype), v.to(dtype)


def _expected_phase(index: int, pages: int, plan: PhasePlan) -> Phase:
    """The lifecycle rule, written out independently of PhasePlan.phase."""
    if index == pages - 1:
        return Phase.TERMINAL
    first, last = index * plan.page_size, (index + 1) * plan.page_size
    if first < plan.sink_tokens or any(s < last and first < e for s, e in plan.protected_spans):
        return Phase.INITIAL
    recent = math.ceil(plan.recent_tokens / plan.page_size)
    return Phase.RECENT if pages - 1 - index <= recent else Phase.MID


@settings(max_examples=40, deadline=None)
@given(page=st.integers(1, 9), sinks=st.integers(0, 20), recent=st.integers(0, 25),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       span=st.one_of(st.none(), st.tuples(st.integers(0, 60), st.integers(1, 30))))
def test_pages_reach_each_phase_at_exactly_the_right_token(page, sinks, recent, chunks, span):
    spans = () if span is None else ((span[0], span[0] + span[1]),)
    cache = _cache(page_size=page, sink_tokens=sinks, recent_tokens=recent, protected_spans=spans,
                   target_ratio=None, mid_bits=8, key_energy=None, value_energy=None, recent_bits=8)
    k, v = _structured_kv(sum(chunks), heads=1, dim=4)
    written = 0
    for n in chunks:
        cache.observe(0, torch.randn(2, n, 4), 1)
        cache.append(0, k[:, written:written + n], v[:, written:written + n])
        written += n
        pages = cache.sequences[0].pages
        assert len(pages) == math.ceil(written / page)
        assert [p.phase for p in pages] == [_expected_phase(i, len(pages), cache.plan) for i in range(len(pages))]
        for p in pages:  # each phase is stored where it should be
            assert (p.slot is not None) == (p.phase in (Phase.INITIAL, Phase.TERMINAL))
            assert (p.recent is not None) == (p.phase is Phase.RECENT)
            assert (p.kept is not None) == (p.phase is Phase.MID)
    assert cache.length(0) == written


# Mid with identity codes: floats in the cache dtype, no projection, under a budget no sequence
# reaches (so the encoder and the eviction planner run and keep every token).
FLOAT_MID = dict(page_size=8, sink_tokens=8, recent_tokens=16, recent_bits=None, mid_bits=None, key_energy=None,
                 value_energy=None, target_ratio=None, layer_budget_bytes=2**40)


def test_float_mid_holds_the_pages_kv_exactly():
    """Pages reaching Mid leave the exact pool and their rows are the appended K/V, bit for bit,
    in page order."""
    k, v = _structured_kv(100, heads=2, dim=16)
    q = torch.randn(1, 4, 100, 16)
    with kvtopo.session(kvtopo.Config(**FLOAT_MID)) as s:
        for start in range(0, 100, 30):
            s.attend("l", q[:, :, start:start + 30], k[None, :, start:start + 30], v[None, :, start:start + 30],
                     None, 0.25)
        entry = s.layers["l"].sequences[0]
    mid_pages = [i for i, p in enumerate(entry.pages) if p.phase is Phase.MID]
    assert mid_pages == list(range(1, 10))  # 13 pages: Initial, 9 Mid, 2 Recent, Terminal
    assert all(entry.pages[i].slot is None for i in mid_pages)
    positions = torch.cat([torch.arange(8 * i, 8 * i + 8) for i in mid_pages])
    assert torch.equal(entry.mid.keys.rows.transpose(0, 1), k[:, positions])
    assert torch.equal(entry.mid.values.rows.transpose(0, 1), v[:, positions])


def test_float_mid_decodes_like_lossless():
    """A model whose Mid pages are stored as floats attends to them as their own segment (merged
    with the exact pages by log-sum-exp): it generates lossless's tokens, and its logits up to the
    float32 rounding of that merge."""
    from kvtopo.models import zoo

    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    prompt, steps = 150, 20
    ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(3))
    with kvtopo.session(kvtopo.Config(**FLOAT_MID, prefill_chunk_size=40)) as s:
        tokens, logits = kvtopo.generate(model, ids, steps, return_logits=True)
        mid_tokens = [cache.sequences[0].mid.tokens for cache in s.layers.values()]
        plan = next(iter(s.layers.values())).plan
    pages = -(-(prompt + steps - 1) // 8)
    expected = 8 * sum(_expected_phase(i, pages, plan) is Phase.MID for i in range(pages))
    assert expected > 0 and mid_tokens == [expected] * len(mid_tokens)
    lossless_tokens, lossless_logits = kvtopo.generate(
        model, ids, steps, config=kvtopo.Config.lossless(page_size=8, prefill_chunk_size=40), return_logits=True)
    assert torch.equal(tokens, lossless_tokens)
    torch.testing.assert_close(logits, lossless_logits, atol=1e-5, rtol=0)


def test_compressed_segments_attend_like_their_decompressed_kv():
    """Attention in a session with Recent/Mid pages equals exact attention over the K/V the
    store would decompress to (same codes), within float32 rounding."""
    from kvtopo.kernels.compressed_attention import LowRankHeads

    cache_cfg = dict(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None, key_energy=0.95,
                     value_energy=0.95, mid_bits=4, recent_bits=8)
    k, v = _structured_kv(100, heads=2, dim=16)
    q = torch.randn(1, 4, 1, 16)
    with kvtopo.session(kvtopo.Config(**cache_cfg)) as s:
        s.attend("l", q.expand(1, 4, 100, 16).contiguous(), k[None], v[None], None, 0.25)
        cache = s.layers["l"]
        seg = cache.segments(0)
        assert seg.recent is not None and isinstance(seg.mid[0], LowRankHeads)
        stored_k, stored_v = explicit_kv(seg)
        new_k, new_v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
        out = s.attend("l", q, new_k, new_v, None, 0.25)
    keys = torch.cat([stored_k, new_k[0]], 1).double().repeat_interleave(2, 0)
    values = torch.cat([stored_v, new_v[0]], 1).double().repeat_interleave(2, 0)
    expected = torch.softmax(q[0].double() @ keys.transpose(1, 2) * 0.25, -1) @ values
    torch.testing.assert_close(out[0].double(), expected, atol=1e-5, rtol=1e-5)


def test_topo_refits_its_bases_each_time_the_sequence_doubles():
    """Past `refit_after` tokens a new Mid epoch with its own bases starts each time the length
    doubles; every epoch is attended (session and fast decode path) exactly as its
    decompressed K/V, and its bytes are counted."""
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=None, refit_after=128,
                           key_energy=0.9, value_energy=0.9)
    n, chunk = 1024, 64
    k, v = _structured_kv(n, heads=2, dim=16)
    q = torch.randn(1, 4, n, 16, generator=torch.Generator().manual_seed(2))
    fits = []
    with kvtopo.session(config) as s:
        for start in range(0, n, chunk):
            s.attend("l", q[:, :, start:start + chunk], k[None, :, start:start + chunk],
                     v[None, :, start:start + chunk], None, 0.25)
            entry = s.layers["l"].sequences[0]
            if entry.mid is not None and (not fits or fits[-1][1] is not entry.mid):
                fits.append((start + chunk, entry.mid))
        cache = s.layers["l"]
        # First fit when Mid is first reached (128 tokens), then at 2 x max(fit, 128).
        assert [length for length, _ in fits] == [128, 256, 512, 1024]
        assert entry.retired == [mid for _, mid in fits[:-1]] and all(m.tokens for m in entry.retired)
        assert len({id(m.key_bases) for _, m in fits}) == 4
        assert s.stats().total_bytes == held_tensor_bytes(cache)
        keys, values = explicit_kv(cache.segments(0))
        new_q, new_k, new_v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16)
        out_chunk = s.attend("l", new_q[:, :, :1].expand(1, 4, 2, 16).contiguous(), new_k[:, :, :1].expand(1, 2, 2, 16).contiguous(),
                             new_v[:, :, :1].expand(1, 2, 2, 16).contiguous(), None, 0.25)
    with kvtopo.session(config) as s2:  # the same history, then one decode step (fast path)
        for start in range(0, n, chunk):
            s2.attend("l", q[:, :, start:start + chunk], k[None, :, start:start + chunk],
                      v[None, :, start:start + chunk], None, 0.25)
        out_step = s2.attend("l", new_q[:, :, :1], new_k[:, :, :1], new_v[:, :, :1], None, 0.25)
    full_k = torch.cat([keys, new_k[0, :, :1]], 1).double().repeat_interleave(2, 0)
    full_v = torch.cat([values, new_v[0, :, :1]], 1).double().repeat_interleave(2, 0)
    expected = torch.softmax(new_q[0, :, :1].double() @ full_k.transpose(1, 2) * 0.25, -1) @ full_v
    torch.testing.assert_close(out_step[0].double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_chunk[0, :, :1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy_fields", [
    dict(target_ratio=2.0),
    dict(target_ratio=None, key_energy=None, value_energy=None, mid_bits=2),
    dict(target_ratio=None),
])
def test_stats_bytes_are_the_held_tensors(policy_fields):
    k, v = _structured_kv(300, heads=2, dim=32, dtype=torch.float16)
    q = torch.randn(1, 4, 300, 32, dtype=torch.float16)
    with kvtopo.session(kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, **policy_fields)) as s:
        for start in range(0, 300, 64):
            s.attend("l", q[:, :, start:start + 64], k[None, :, start:start + 64], v[None, :, start:start + 64], None, 0.2)
        stats = s.stats()
        assert stats.total_bytes == held_tensor_bytes(s.layers["l"])
        assert stats.total_bytes == sum(stats.per_kind.values())
        assert stats.per_kind["mid"] > 0


def test_compression_really_frees_pool_pages():
    """Pages leaving the exact pool are reused: the pool stays at Initial + Recent + Terminal."""
    k, v = _structured_kv(2000, heads=2, dim=32, dtype=torch.float16)
    q = torch.randn(1, 4, 2000, 32, dtype=torch.float16)
    sizes = {}
    for name, config in {"lossless": kvtopo.Config.lossless(page_size=16),
                         "topo": kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32)}.items():
        with kvtopo.session(config) as s:
            for start in range(0, 2000, 256):
                s.attend("l", q[:, :, start:start + 256], k[None, :, start:start + 256],
                         v[None, :, start:start + 256], None, 0.2)
            sizes[name] = (s.layers["l"].pool.capacity, s.stats())
    assert 125 <= sizes["lossless"][0] <= 125 * 1.25 + 4  # every page exact, plus at most one growth step
    assert sizes["topo"][0] <= 1 + 2 + 1 + 4  # initial + recent + terminal, plus one growth step
    topo = sizes["topo"][1]
    assert topo.total_bytes * 6 < sizes["lossless"][1].total_bytes
    assert topo.ratio_vs_fp16 >= 6.7  # default topo on fp16 K/V, 8x budget
    # At 2000 tokens the exact/Recent pages and metadata hold well under half the budget: met.
    assert not topo.budget_missed


def test_unmeetable_budget_raises_when_asked():
    k, v = _structured_kv(200, heads=2, dim=16)
    config = kvtopo.Config(page_size=8, sink_tokens=64, recent_tokens=64, layer_budget_bytes=2000, over_budget="raise")
    with kvtopo.session(config) as s:
        with pytest.raises(BudgetExceeded, match="cannot be met"):
            s.attend("l", torch.randn(1, 4, 200, 16), k[None], v[None], None, 0.25)


def test_unmeetable_budget_evicts_and_reports_the_miss():
    k, v = _structured_kv(200, heads=2, dim=16)
    config = kvtopo.Config(page_size=8, sink_tokens=64, recent_tokens=64, layer_budget_bytes=2000)
    with kvtopo.session(config) as s:
        s.attend("l", torch.randn(1, 4, 200, 16), k[None], v[None], None, 0.25)
        stats = s.stats()
        mid = s.layers["l"].sequences[0].mid
    assert stats.budget_missed
    assert mid.tokens == 0 and mid.keys.page_rows.tolist() == [0] * 8  # every Mid page evicted whole


@pytest.mark.parametrize("scope, recent_bits", [("append", 8), ("page", None)])
def test_raise_never_leaves_the_store_over_budget(scope, recent_bits):
    """Under over_budget="raise" a Mid page that keeps no token still costs bytes (its row
    count), so a budget the exact/Recent pages and metadata fit, but not with the Mid pages
    kept empty beside them, must raise: the store is within its budget after every append, or
    BudgetExceeded says why. Scanned over the budgets around that point, prompt then decode:
    under "append" the prompt's pages enter Mid by the joint plan; a decode step's page boundary
    moves one page alone (`Lifecycle.keep_count`; with Recent exact the Terminal page leaving
    for Recent keeps its bytes as it moves, so no transient slot hides the overshoot)."""
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, recent_bits=recent_bits, target_ratio=None,
                           observation_window=4, eviction_scope=scope)
    n, chunks = 110, [100] + [1] * 10
    k, v = _structured_kv(n, heads=2, dim=16)
    q = torch.randn(1, 4, n, 16, generator=torch.Generator().manual_seed(1))

    def run(budget, over_budget):
        """Bytes held past the budget after the prompt; under "raise" checks after every append
        that the store is within its budget (raises what the store raises)."""
        with kvtopo.session(config.replace(layer_budget_bytes=budget, over_budget=over_budget)) as s:
            start, over = 0, []
            for size in chunks:
                s.attend("l", q[:, :, start:start + size], k[None, :, start:start + size],
                         v[None, :, start:start + size], None, 0.25)
                start += size
                cache = s.layers["l"]
                over.append(cache.sequence_nbytes(cache.sequences[0]) - budget)
                assert (over[-1] > 0) == s.stats().budget_missed
                assert over_budget == "evict" or over[-1] <= 0, (budget, start, over)
            return over[0]

    # After the prompt, every Mid page evicted whole: the least the store can hold then.
    least = run(1, "evict") + 1
    outcomes = set()
    for budget in [*range(least - 100, least + 40, 3), least + 10000]:
        try:
            run(budget, "raise")
            outcomes.add("within")
        except BudgetExceeded:
            outcomes.add("raised")
    assert outcomes == {"raised", "within"}


def test_budget_exceeded_after_the_prompt_names_the_mid_tokens_kept_before():
    """A prompt that meets a byte cap exactly leaves a later page (here at a decode page boundary)
    no room even keeping nothing (an empty Mid page still costs its row count, and the cap does
    not grow with the sequence): the bytes that stand in its way include the Mid tokens the
    prompt's pages kept, which cannot be given back (chosen once, as each page entered Mid). The
    error says so instead of blaming only the exact/Recent pages and metadata (and advising to
    lower sink_tokens/recent_tokens)."""
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=None,
                           layer_budget_bytes=32_000, over_budget="raise")
    n, dim = 1000, 32
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(heads, n + 40, dim, generator=g).to(torch.float16) for heads in (2, 2, 4))
    with kvtopo.session(config) as s:
        s.attend("l", q[None, :, :n], k[None, :, :n], v[None, :, :n], None, dim ** -0.5)
        assert not s.stats().budget_missed
        with pytest.raises(BudgetExceeded, match="cannot be met") as error:
            for pos in range(n, n + 40):
                s.attend("l", q[None, :, pos:pos + 1], k[None, :, pos:pos + 1], v[None, :, pos:pos + 1], None,
                         dim ** -0.5)
        cache = s.layers["l"]
        mid = cache.mid_nbytes(cache.sequences[0])
    message = str(error.value)
    assert mid > 0 and f"{mid} in Mid tokens that earlier pages kept" in message, message
    assert "chosen once" in message and "exact/Recent pages and metadata already hold" not in message, message


@pytest.mark.parametrize("over_budget", ["raise", "evict"])
def test_pages_entering_mid_after_a_prompt_that_filled_its_budget_keep_their_share(over_budget):
    """After a prompt that met its ratio budget, each page decoding pushes into Mid keeps what
    the budget's growth leaves it, every step within budget. Before, the room of a page entering
    Mid was judged while the Terminal page leaving for Recent still counted its exact slot: the
    first pages after the prompt kept no token (under "evict") or raised (under "raise") although
    the budget could be met."""
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, over_budget=over_budget)
    n, steps, dim = 2000, 96, 32
    g = torch.Generator().manual_seed(0)
    k, v, q = (torch.randn(heads, n + steps, dim, generator=g) for heads in (2, 2, 4))
    with kvtopo.session(config) as s:
        s.attend("l", q[None, :, :n], k[None, :, :n], v[None, :, :n], None, dim ** -0.5)
        cache = s.layers["l"]
        entry = cache.sequences[0]
        before = len([p for p in entry.pages if p.kept is not None])
        for pos in range(n, n + steps):
            s.attend("l", q[None, :, pos:pos + 1], k[None, :, pos:pos + 1], v[None, :, pos:pos + 1], None, dim ** -0.5)
            assert cache.sequence_nbytes(entry) <= cache.budget(cache.length(0)), pos
        after = [p.kept for p in entry.pages if p.kept is not None][before:]
    # The first enters Mid one token after the prompt, when the budget has grown by one token only.
    assert len(after) == steps // 16 and min(after[1:]) > 0, after


def _kept_per_page(config, chunks, n=1024, dim=32, with_segment=False):
    k, v = _structured_kv(n, heads=2, dim=dim, dtype=torch.float16)
    q = torch.randn(1, 4, n, dim, dtype=torch.float16, generator=torch.Generator().manual_seed(1))
    with kvtopo.session(config) as s:
        start = 0
        for size in chunks:
            s.attend("l", q[:, :, start:start + size], k[None, :, start:start + size],
                     v[None, :, start:start + size], None, dim ** -0.5)
            start += size
        entry = s.layers["l"].sequences[0]
        kept = [p.kept for p in entry.pages if p.kept is not None]
        if with_segment:
            return kept, s.stats(), entry.mid
        return kept, s.stats()


def test_pages_one_chunk_pushes_into_mid_share_the_budget_by_tokens():
    """Under eviction_scope="page", one long chunk pushes its pages into Mid one by one; judged
    at the chunk's end length they get equal room, instead of the first ones losing everything
    to the exact pages. (Projected: unprojected 4-bit pages of 16 tokens x 32 dims cost too
    much per page for any to keep a token at 8x.)"""
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0,
                           over_budget="raise", observation_window=4, eviction_scope="page",
                           key_energy=0.9, value_energy=0.9)
    kept, stats = _kept_per_page(config, [1024])
    assert 0 < min(kept) and max(kept) - min(kept) <= 1, kept
    assert not stats.budget_missed


def _feed_in_chunks(config, chunks, prompt_end=None, n=1024, dim=32, watch=None):
    """Feed the same K/V in `chunks`, each step told `prompt_end`, calling `watch(entry)` on the
    layer's sequence after each chunk. Returns (achieved ratio, each page's kept tokens)."""
    k, v = _structured_kv(n, heads=2, dim=dim, dtype=torch.float16)
    q = torch.randn(1, 4, n, dim, dtype=torch.float16, generator=torch.Generator().manual_seed(1))
    with kvtopo.session(config) as s:
        start = 0
        for size in chunks:
            with s.step(torch.ones(1, size, dtype=torch.bool), prompt_end):
                s.attend("l", q[:, :, start:start + size], k[None, :, start:start + size],
                         v[None, :, start:start + size], None, dim ** -0.5)
            start += size
            if watch is not None:
                watch(s.layers["l"].stored_state(0))
        return s.stats().ratio_vs_fp16, [page.kept for page in s.layers["l"].stored_state(0).pages]


CHUNKED = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=64, target_ratio=8.0, observation_window=4)


def test_a_prompt_in_chunks_told_its_end_holds_the_bytes_of_one_chunk():
    """Judged at each chunk's end, the first chunks' exact and Recent pages exceed their budget,
    their Mid pages keep their floor, and the prompt ends holding more than one chunk would; told
    the prompt's end (`Session.step(prompt_end=...)`, what kvtopo.generate says), every chunk is
    budgeted at it and the chunks hold what one chunk holds, whether its pages wait for the
    prompt's end or not (`prompt_hold_tokens`)."""
    whole, _ = _feed_in_chunks(CHUNKED, [1024])
    alone, _ = _feed_in_chunks(CHUNKED.replace(prompt_hold_tokens=0), [128] * 8)
    assert alone < 0.9 * whole
    for hold in (0, 4096):
        told, _ = _feed_in_chunks(CHUNKED.replace(prompt_hold_tokens=hold), [128] * 8, prompt_end=[1024])
        assert told == pytest.approx(whole, rel=0.02)


def test_a_chunked_prompts_pages_wait_in_recent_and_are_ranked_as_one_chunk_ranks_them(monkeypatch):
    """While more of the prompt comes, no page enters Mid: those leaving Recent wait there in
    Recent codes (no exact slot), and when the prompt ends they are ranked together by its last
    chunk, keeping what the whole prompt in one chunk keeps. The successor shares are off here: a
    waiting page's are those its own chunk gave it, among that chunk's tokens, where one chunk
    shares them among the whole prompt's (the next test)."""
    import kvtopo.runtime.policies.topo as topo

    monkeypatch.setattr(topo, "SUCCESSOR_WEIGHT", 0.0)
    waiting = []

    def watch(entry):
        phases = [page.phase for page in entry.pages]
        waiting.append((phases.count(Phase.MID), sum(page.slot is not None for page in entry.pages)))

    whole_ratio, whole_kept = _feed_in_chunks(CHUNKED, [1024])
    ratio, kept = _feed_in_chunks(CHUNKED, [128] * 8, prompt_end=[1024], watch=watch)
    assert kept == whole_kept and ratio == pytest.approx(whole_ratio)
    assert [mid for mid, _ in waiting[:-1]] == [0] * 7 and waiting[-1][0] > 0
    assert all(slots <= 2 for _, slots in waiting)  # the sink page and the Terminal one
    # Told nothing, the chunks move pages as they push them out of Recent, each page ranked by
    # the chunk just after it: other tokens survive.
    assert _feed_in_chunks(CHUNKED.replace(prompt_hold_tokens=0), [128] * 8, prompt_end=[1024])[1] != whole_kept


def test_a_waiting_prompts_successor_shares_are_kept_for_its_end(monkeypatch):
    """The successor shares need each token's predecessor's query, gone when the prompt's end ranks
    a waiting page: each chunk's are kept (`Policy.held_credit`), shared as if among the 928
    tokens the ranking at the prompt's end sees (the chunk's other tokens' credit taken as a sample
    of those), and the ranking at the end takes them. A chunk's first token (its predecessor in the
    chunk before) has none; the last chunk's own tokens are scored live. The store counts the kept
    credit at `held_credit_nbytes` per token, what continuous batching's admission charges for it."""
    from kvtopo.kernels.scoring import successor_shares
    from kvtopo.runtime.layer_cache import LayerCache, held_credit_nbytes
    from kvtopo.runtime.policies.topo import Topo

    seen, score, kept = [], Topo.score, []
    monkeypatch.setattr(Topo, "score", lambda self, inputs: seen.append(inputs) or score(self, inputs))
    _feed_in_chunks(CHUNKED, [128] * 8, prompt_end=[1024], watch=lambda entry: kept.append(
        (sum(where.numel() for where, _ in entry.held_credit), LayerCache._held_credit_nbytes(entry))))
    assert [tokens for tokens, _ in kept] == [112 + 128 * c for c in range(7)] + [0]
    assert all(nbytes == tokens * held_credit_nbytes(2) for tokens, nbytes in kept)
    held = seen[-1].held_credit  # the last chunk's joint plan: pages 1..58, tokens 16..943
    assert held is not None and held.shape == (2, 928)
    k, _ = _structured_kv(1024, heads=2, dim=32, dtype=torch.float16)
    q = torch.randn(1, 4, 1024, 32, dtype=torch.float16, generator=torch.Generator().manual_seed(1))[0]
    for chunk in range(7):
        first = max(16, 128 * chunk + 1)  # page 0 is Initial: never ranked
        end = 128 * (chunk + 1)
        own = successor_shares(q[:, first - 1:end - 1], torch.arange(end - first), k[:, first:end], 32 ** -0.5, 4.0,
                               competitors=928)
        torch.testing.assert_close(held[:, first - 16:end - 16], own)
        assert not torch.allclose(own, successor_shares(q[:, first - 1:end - 1], torch.arange(end - first),
                                                        k[:, first:end], 32 ** -0.5, 4.0))
        if chunk:
            assert held[:, 128 * chunk - 16].isnan().all()
    assert held[:, 896 - 16:].isnan().all()


def test_pages_wait_for_a_prompts_end_at_most_prompt_hold_tokens(monkeypatch):
    """The wait is bounded: past `prompt_hold_tokens` waiting tokens the pages enter Mid, ranked by
    the chunk then appended, so a long prompt never holds more than that in Recent codes; the
    waiting tokens' shares are divided as if among the tokens that ranking sees, not the prompt's."""
    from kvtopo.runtime.policies.topo import Topo

    ranked_with, held_credit = [], Topo.held_credit
    monkeypatch.setattr(Topo, "held_credit", lambda self, inputs: ranked_with.append(inputs.ranked_with) or
                        held_credit(self, inputs))
    config = CHUNKED.replace(prompt_hold_tokens=256)
    plan, held = PhasePlan(config.page_size, config.sink_tokens, config.recent_tokens), []

    def watch(entry):
        count = len(entry.pages)
        held.append(sum(page.tokens for i, page in enumerate(entry.pages)
                        if page.phase is Phase.RECENT and plan.phase(i, count) is Phase.MID))

    _feed_in_chunks(config, [128] * 8, prompt_end=[1024], watch=watch)
    assert 0 < max(held) <= 256 and held[-1] == 0
    assert ranked_with and set(ranked_with) == {256}


def test_the_prompts_last_chunk_moves_the_waiting_pages_even_when_it_opens_no_page():
    """A last chunk that only fills the Terminal page opens no page (the point where pages settle):
    the waiting pages still enter Mid at its end, so none waits past the prompt."""
    plan = PhasePlan(CHUNKED.page_size, CHUNKED.sink_tokens, CHUNKED.recent_tokens)
    phases = []
    _feed_in_chunks(CHUNKED, [1020, 4], prompt_end=[1024], watch=lambda e: phases.append([p.phase for p in e.pages]))
    assert phases[0].count(Phase.MID) == 0
    assert phases[-1] == [plan.phase(i, 64) for i in range(64)]


@pytest.mark.parametrize("fields", [dict(layer_budget_bytes=40_000), dict(recent_bits=None), dict(policy="kivi")])
def test_pages_do_not_wait_under_a_byte_cap_with_exact_recent_or_without_eviction(fields):
    """Waiting holds more while the prompt is read than after: not under a per-layer byte cap;
    not where Recent is exact (waiting would hold pool slots); not where nothing is evicted
    (there is no ranking to wait for)."""
    mid = []
    _feed_in_chunks(CHUNKED.replace(**fields), [128] * 8, prompt_end=[1024],
                    watch=lambda e: mid.append(sum(p.phase is Phase.MID for p in e.pages)))
    assert mid[2] > 0


def test_a_serving_engines_chunks_wait_for_the_prompts_end_even_one_token_long(monkeypatch):
    """`Session.attend_sequence(prompt_end=...)`, as a serving engine packs prompt chunks of any
    size: a one-token chunk with more of its prompt to come is a prompt chunk, not a decode step
    (a decode step's append says no prompt end, and would end the wait early), so the chunks keep
    what the whole prompt in one chunk keeps (successor shares off, as above)."""
    import kvtopo.runtime.policies.topo as topo

    monkeypatch.setattr(topo, "SUCCESSOR_WEIGHT", 0.0)
    _, whole = _feed_in_chunks(CHUNKED, [1024])
    k, v = _structured_kv(1024, heads=2, dim=32, dtype=torch.float16)
    q = torch.randn(4, 1024, 32, dtype=torch.float16, generator=torch.Generator().manual_seed(1))
    kept = {}
    for told in (1024, 0):
        with kvtopo.session(CHUNKED) as s:
            start = 0
            for size in (500, 1, 1, 1, 521):
                end = start + size
                s.attend_sequence("l", 0, q[:, start:end], k[:, start:end], v[:, start:end], 32 ** -0.5,
                                  prompt_end=told)
                start = end
            kept[told] = [page.kept for page in s.layers["l"].stored_state(0).pages]
    assert kept[1024] == whole
    assert kept[0] != whole
    with kvtopo.session(CHUNKED) as s, pytest.raises(ValueError, match="prompt_end must be a length >= 0"):
        s.attend_sequence("l", 0, q[:, :4], k[:, :4], v[:, :4], 32 ** -0.5, prompt_end=-1)


def test_prompt_hold_tokens_must_be_a_count():
    with pytest.raises(ValueError, match="prompt_hold_tokens"):
        kvtopo.Config(prompt_hold_tokens=-1)


def test_generate_tells_every_prefill_chunk_its_rows_prompt_end(monkeypatch):
    """kvtopo.generate feeds a prompt in `prefill_chunk_size` chunks and says where each row's
    prompt ends (its real tokens, padding left out); decode steps say nothing."""
    from kvtopo.models import zoo
    from kvtopo.runtime.session import Session

    told, step = [], Session.step

    def spy(self, valid, prompt_end=None):
        told.append(None if prompt_end is None else list(prompt_end))
        return step(self, valid, prompt_end)

    monkeypatch.setattr(Session, "step", spy)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :5] = False
    kvtopo.generate(model, ids, 3, config=kvtopo.Config(prefill_chunk_size=16), attention_mask=mask)
    assert told == [[40, 35]] * 3 + [None] * 2  # chunks of 16, 16, 8; then two decode steps


def test_prompt_end_needs_one_length_per_row():
    with kvtopo.session(kvtopo.Config()) as s:
        for bad in ([10, 20], [-1]):
            with pytest.raises(ValueError, match="prompt_end must give one length >= 0 per row"):
                with s.step(torch.ones(1, 4, dtype=torch.bool), bad):
                    pass


def _planted_hit(n=1024, dim=32, hit=300, window=4):
    """Structured K/V and queries whose last `window` positions all look for token `hit`."""
    k, v = _structured_kv(n, heads=2, dim=dim, dtype=torch.float16)
    q = torch.randn(1, 4, n, dim, generator=torch.Generator().manual_seed(1))
    wanted = q[0, :, -window:].mean(1).reshape(2, 2, dim).mean(1)  # per kv-head: its 2 query heads' mean
    k[:, hit] = (6 * wanted / wanted.norm(dim=-1, keepdim=True) * dim ** 0.5).half()
    return q.half(), k, v


def _record(monkeypatch, method: str) -> list:
    """Every result of LayerCache.<method>, in call order, as the store goes on using them."""
    results, original = [], getattr(LayerCache, method)

    def spy(self, *args):
        results.append(original(self, *args))
        return results[-1]

    monkeypatch.setattr(LayerCache, method, spy)
    return results


@pytest.mark.parametrize("policy", ["topo", "snapkv"])
def test_one_appends_pages_share_its_room_by_score(policy, monkeypatch):
    """eviction_scope="append" (the default): the pages a chunk moves into Mid are ranked
    together, so the room goes where the latest queries look -- the planted hit survives in
    every head (for topo with the tokens after it, which decoding reads next) -- while other
    pages keep little or nothing; the budget still holds."""
    plans = _record(monkeypatch, "_plan_joint_eviction")
    q, k, v = _planted_hit()
    config = kvtopo.Config(policy=policy, page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0,
                           over_budget="raise", observation_window=4)
    with kvtopo.session(config) as s:
        s.attend("l", q, k[None], v[None], None, 32 ** -0.5)
        stats = s.stats()
    plan = next(p for p in plans if p)
    kept = {page * 16 + int(t) for page, rows in plan.items() for t in rows[0]}
    assert {300}.issubset(kept) and all(300 in {page * 16 + int(t) for page, rows in plan.items() for t in rows[h]}
                                        for h in range(2))
    if policy == "topo":
        assert set(range(300, 300 + SUCCESSORS + 1)) <= kept, sorted(kept)
    counts = [rows.shape[1] for rows in plan.values()]
    assert min(counts) < max(counts) and 0 in counts, counts
    assert not stats.budget_missed


@pytest.mark.parametrize("compared", ["shares", "raw"])
def test_a_run_one_head_reads_keeps_its_pages_when_another_head_spreads(compared, monkeypatch):
    """topo compares kv-heads by each head's share of its own credit (`Topo.across_heads`): a
    head that gives every token a large score must not set every page's count, so a run of
    tokens that one peaked head reads (crossing a page boundary, as a needle does) keeps all
    of it in that head. Compared raw, the spread head wins and the run loses tokens."""
    from kvtopo.runtime.policies.topo import Topo

    run = range(100, 120)  # group offsets; pages of 16 tokens, so the run crosses offset 112

    def designed(self, inputs):
        n = inputs.keys.shape[1]
        spread = 10 + torch.rand(n, generator=torch.Generator().manual_seed(0))
        peaked = torch.zeros(n)
        peaked[list(run)] = 5.0
        return torch.stack([spread, peaked])

    monkeypatch.setattr(Topo, "score", designed)
    if compared == "raw":
        monkeypatch.setattr(Topo, "across_heads", lambda self, scores: scores)
    plans = _record(monkeypatch, "_plan_joint_eviction")
    q, k, v = _planted_hit()
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0, observation_window=4)
    with kvtopo.session(config) as s:
        s.attend("l", q, k[None], v[None], None, 32 ** -0.5)
    plan = next(p for p in plans if p)
    group = sorted(plan)
    kept = {group.index(page) * 16 + int(t) for page, rows in plan.items() for t in rows[1]}
    if compared == "shares":
        assert set(run) <= kept, sorted(kept)
    else:
        assert not set(run) <= kept, sorted(kept)


def test_carry_forward_and_ties_go_to_the_lower_index():
    scores = torch.tensor([[0.0, 5.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    assert carry_forward(scores, 2).tolist() == [[0.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 0.0]]
    assert carry_forward(scores, 0).tolist() == scores.tolist()
    assert best_tokens(carry_forward(scores, 2), 2).tolist() == [[1, 2]]  # of the tied 1, 2, 3


def test_anchor_reach_carries_only_anchors_credit_and_only_as_far_as_reach():
    """An anchor (credit >= strength x the head's mean) passes its credit to the next `reach`
    tokens, the later of two overlapping anchors taking over where it is larger; a token below
    the strength passes on nothing; reach 0 leaves the anchors alone."""
    credit = torch.zeros(2, 40)
    credit[0, [5, 9]] = torch.tensor([6.0, 9.0])  # 9 is inside 5's reach: it takes over
    credit[1, [5, 20]] = torch.tensor([9.0, 0.3])  # 20 is weak: below 4 x mean
    reached = anchor_reach(credit, strength=4.0, reach=8)
    expected = torch.zeros(2, 40)
    expected[0, 5:9] = 6.0
    expected[0, 9:18] = 9.0
    expected[1, 5:14] = 9.0
    assert reached.tolist() == expected.tolist()
    anchors_only = credit.clone()
    anchors_only[1, 20] = 0.0
    assert anchor_reach(credit, strength=4.0, reach=0).tolist() == anchors_only.tolist()


def _orthogonal_keys(dim: int) -> torch.Tensor:
    """[1, dim, dim]: dim mutually orthogonal keys of norm sqrt(dim), so each query below credits
    exactly the key it copies."""
    orthonormal, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(3)))
    return orthonormal.T[None] * dim ** 0.5


def test_topo_keeps_a_long_span_after_a_strongly_attended_token():
    """Queries that read a needle's key (token 5) make topo rank the tokens past the key's
    SUCCESSORS, up to ANCHOR_REACH after it, above every token beyond that reach (which only
    the low-norm prior and faint credit reach): a 35-token uuid after its key is kept to its end."""
    dim, key = 96, 5
    assert ANCHOR_REACH > SUCCESSORS + 1
    keys = _orthogonal_keys(dim)
    queries = keys[:, [key]] * 2.0  # [1, 1, dim]
    scores = topo_scores(queries, keys, dim ** -0.5, 4.0)[0]
    reached = scores[key + SUCCESSORS + 1:key + ANCHOR_REACH + 1]
    beyond = scores[key + ANCHOR_REACH + 1:]
    assert reached.min() > beyond.max(), (reached.min(), beyond.max())


def test_an_anchors_reach_outranks_a_successor_share_carried_elsewhere():
    """The question's anchor (token 5) is carried in the units of the whole score: a document
    token (70) whose predecessor's query singled it out (its successor share, at
    SUCCESSOR_WEIGHT) and the SUCCESSORS after it rank below every token of the anchor's reach.
    Compared in the window credit's units alone, the anchor's reach lost to that share."""
    dim, key, singled = 96, 5, 70
    keys = _orthogonal_keys(dim)
    queries = keys[:, [key]] * 2.0
    predecessor_queries = torch.zeros(1, dim, dim)  # no preference, except the row for token 70
    predecessor_queries[0, singled] = keys[0, singled] * 3.0
    rows = torch.arange(dim)
    scores = topo_scores(queries, keys, dim ** -0.5, 4.0, predecessor_queries=predecessor_queries,
                         predecessor_rows=rows)[0]
    reached = scores[key + 1:key + ANCHOR_REACH + 1]
    carried_share = scores[singled:singled + SUCCESSORS + 1]
    assert reached.min() > carried_share.max(), (reached.min(), carried_share.max())


def test_low_norm_prior_matches_float64_and_spans_zero_to_one():
    keys = torch.randn(3, 50, 16, generator=torch.Generator().manual_seed(1)).half()
    norms = keys.double().square().sum(-1)
    top, bottom = norms.amax(-1, keepdim=True), norms.amin(-1, keepdim=True)
    expected = (top - norms) / (top - bottom)
    prior = low_norm_prior(keys)
    torch.testing.assert_close(prior.double(), expected, rtol=1e-5, atol=1e-6)
    assert prior.amin(-1).tolist() == [0.0] * 3 and prior.amax(-1).tolist() == [1.0] * 3


def test_a_token_no_window_query_reaches_is_ranked_by_its_key_norm():
    """Query-agnostic compression: the window's queries give tokens far from what they attend
    no credit, yet a later question may ask for them. topo then prefers a low-norm key, which
    queries in general attend to more, over a high-norm one; the attended token still ranks
    first."""
    dim, attended, high, low = 64, 40, 20, 60  # `low` is past the attended token's successors
    orthonormal, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(2)))
    keys = orthonormal.T[None] * dim ** 0.5  # one key per direction: a query sees only its own
    keys[0, high] *= 2.0
    keys[0, low] *= 0.5
    queries = (keys[0, attended] * 2.0).expand(1, 4, dim).clone()
    credit = kvtopo.kernels.scoring.expfree_scores(queries, keys, dim ** -0.5)
    assert credit[0].nonzero().flatten().tolist() == [attended]
    scores = topo_scores(queries, keys, dim ** -0.5, 4.0)
    assert scores[0, low] > scores[0, high]
    assert scores[0].argmax() == attended


@pytest.mark.parametrize("chunk_queries", [128, 4])
def test_a_prefill_chunk_ranks_its_pages_by_its_own_queries_too(chunk_queries, monkeypatch):
    """A token that queries of the prefill chunk read, but none in the held window (4 queries),
    survives the chunk's own eviction: the chunk's last `CHUNK_QUERIES` queries rank the pages it
    moves beside the window (with only the window's 4 it is evicted). They are dropped once the
    chunk is stored: the held bytes are what they were. (The successor shares, which could
    keep the hit by themselves, are off: their own test follows.)"""
    import kvtopo.runtime.lifecycle as lifecycle
    import kvtopo.runtime.policies.topo as topo

    monkeypatch.setattr(lifecycle, "CHUNK_QUERIES", chunk_queries)
    monkeypatch.setattr(topo, "SUCCESSOR_WEIGHT", 0.0)
    n, dim, hit = 1024, 32, 300
    k, v = _structured_kv(n, heads=2, dim=dim, dtype=torch.float16)
    q = torch.randn(1, 4, n, dim, generator=torch.Generator().manual_seed(1))
    direction = torch.randn(dim, generator=torch.Generator().manual_seed(3))
    direction = direction / direction.norm()
    q -= (q @ direction)[..., None] * direction  # no other query sees the hit
    readers = slice(n - 30, n - 4)  # after every Mid token, before the window
    q[0, :, readers] = 10 * direction
    k[:, hit] = (2 * direction * dim ** 0.5).half()
    plans = _record(monkeypatch, "_plan_joint_eviction")
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0, observation_window=4)
    with kvtopo.session(config) as s:
        s.attend("l", q.half(), k[None], v[None], None, dim ** -0.5)
        entry = s.layers["l"].sequences[0]
        assert entry.chunk_queries is None and entry.observation.shape[1] == 4
        assert s.stats().total_bytes == held_tensor_bytes(s.layers["l"])
    plan = next(p for p in plans if p)
    kept = {page * 16 + int(t) for page, rows in plan.items() for t in rows[0]}
    assert hit // 16 in plan
    assert (hit in kept) == (chunk_queries == 128), sorted(kept)


@pytest.mark.parametrize("weight", [3.0, 0.0])
def test_a_token_its_predecessor_singles_out_survives_before_any_question(weight, monkeypatch):
    """Query-agnostic: no query of the chunk reads the hit (every query is orthogonal to it)
    but the one just before it, which points at it alone, as a model reading the text back
    would fetch it. The successor shares keep it through the chunk's own eviction; without them
    (weight 0) it is evicted."""
    import kvtopo.runtime.policies.topo as topo

    monkeypatch.setattr(topo, "SUCCESSOR_WEIGHT", weight)
    n, dim, hit = 1024, 32, 300
    k, v = _structured_kv(n, heads=2, dim=dim, dtype=torch.float16)
    q = torch.randn(1, 4, n, dim, generator=torch.Generator().manual_seed(1))
    direction = torch.randn(dim, generator=torch.Generator().manual_seed(3))
    direction = direction / direction.norm()
    q -= (q @ direction)[..., None] * direction
    q[0, :, hit - 1] = 10 * direction
    k[:, hit] = (2 * direction * dim ** 0.5).half()
    plans = _record(monkeypatch, "_plan_joint_eviction")
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0, observation_window=4)
    with kvtopo.session(config) as s:
        s.attend("l", q.half(), k[None], v[None], None, dim ** -0.5)
        assert s.layers["l"].sequences[0].chunk_queries is None
    plan = next(p for p in plans if p)
    kept = {page * 16 + int(t) for page, rows in plan.items() for t in rows[0]}
    assert hit // 16 in plan
    assert (hit in kept) == (weight > 0), sorted(kept)


def test_tokens_whose_predecessor_query_is_gone_get_the_held_tokens_mean():
    """A joint plan across chunks ranks tokens of the chunk before, whose predecessors' queries
    are gone: they get the mean of the others' successor shares, neither favoured nor dropped."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 30, 16, generator=g), torch.randn(2, 40, 16, generator=g)
    rows = torch.cat([torch.full((10,), -1), torch.arange(30)])
    credit = successor_credit(q, rows, k, 0.25, 4.0)
    own = kvtopo.kernels.scoring.successor_shares(q, torch.arange(30), k[:, 10:], 0.25)
    torch.testing.assert_close(credit[:, 10:], own)
    torch.testing.assert_close(credit[:, :10], own.mean(-1, keepdim=True).expand(2, 10))


@pytest.mark.parametrize("policy", ["topo", "snapkv"])
def test_joint_plan_counts_what_the_append_leaves_beside_its_mid_rows(policy, monkeypatch):
    """The joint plan's room is the budget less what the sequence-layer holds at the append's
    end besides the group's Mid rows: exact and Recent pages and metadata, the block table as
    it will be (not as it was before the append opened its pages)."""
    projected = _record(monkeypatch, "_bytes_beside_group")
    q, k, v = _planted_hit()
    config = kvtopo.Config(policy=policy, page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0,
                           observation_window=4)
    with kvtopo.session(config) as s:
        s.attend("l", q, k[None], v[None], None, 32 ** -0.5)
        stats = s.stats()
    assert len(projected) == 1
    assert projected[0] == stats.total_bytes - stats.per_kind["mid"], (projected, stats.per_kind)


def test_ratio_budget_gives_each_mid_page_its_share_while_fixed_costs_exceed_it():
    """Under over_budget="evict", a ratio budget that the exact pages and metadata alone exceed
    (short sequences) does not wipe out the early context: each Mid page keeps at least its own
    tokens' share of the budget (fp16 bytes / target_ratio), i.e. every token, or so many that one
    more would not fit that share (under eviction_scope="append" the pages of one append share
    that floor by score); the miss is reported. With "raise", the same run raises. (Here the
    exact and Recent pages alone hold more than the 192 tokens' budget: the floor is the whole share.)"""
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0, observation_window=32,
                           eviction_scope="page")
    kept, stats, mid = _kept_per_page(config, [128, 64], with_segment=True)
    heads, dim = 2, 32
    share = 16 * heads * (dim + dim) * 2 / 8.0
    assert kept and stats.budget_missed, kept
    for count in kept:
        assert count == 16 or mid.page_nbytes(count + 1, heads, dim, dim) > share, (kept, share)
    joint, joint_stats = _kept_per_page(config.replace(eviction_scope="append"), [128, 64])
    assert sum(joint) >= sum(kept) / 2 and joint_stats.budget_missed, (joint, kept)
    for scope in ("page", "append"):
        with pytest.raises(BudgetExceeded):
            _kept_per_page(config.replace(over_budget="raise", eviction_scope=scope), [128, 64])


def test_protected_span_is_never_evicted():
    k, v = _structured_kv(256, heads=2, dim=16)
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=16, protected_spans=((100, 140),), target_ratio=12)
    with kvtopo.session(config) as s:
        s.attend("l", torch.randn(1, 4, 256, 16), k[None], v[None], None, 0.25)
        pages = s.layers["l"].sequences[0].pages
    protected = [i for i, p in enumerate(pages) if p.phase is Phase.INITIAL]
    assert protected == [0, 6, 7, 8]
    for i in (6, 7, 8):
        assert torch.equal(s.layers["l"].pool.keys[pages[i].slot], k[:, 16 * i:16 * (i + 1)])


def test_batched_sequences_stay_isolated_under_compression():
    k, v = _structured_kv(300, heads=2, dim=16, seed=1)
    q = torch.randn(1, 4, 300, 16)
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=6)
    with kvtopo.session(config) as s:
        s.attend("l", q, k[None], v[None], None, 0.25)
        alone = s.attend("l", q[:, :, :1], k[None, :, :1], v[None, :, :1], None, 0.25)
    other_k, other_v = _structured_kv(300, heads=2, dim=16, seed=9)
    with kvtopo.session(config) as s:
        s.attend("l", torch.cat([q, q * 3]), torch.stack([k, other_k * 5]), torch.stack([v, other_v * 5]), None, 0.25)
        batched = s.attend("l", torch.cat([q[:, :, :1], q[:, :, :1]]), torch.stack([k[:, :1], other_k[:, :1]]),
                           torch.stack([v[:, :1], other_v[:, :1]]), None, 0.25)
    torch.testing.assert_close(batched[0], alone[0], atol=0, rtol=0)


def _window_rows(observation: torch.Tensor) -> list:
    """The observed queries as a sorted list of rows (the window is read as a set)."""
    return sorted(observation.transpose(0, 1).reshape(observation.shape[1], -1).tolist())


def test_a_full_window_holds_the_latest_queries_and_a_chunk_sees_them_in_order():
    """Decode steps over a full observation window overwrite its oldest query in place; the
    window always holds exactly the latest W queries, and a later chunk of several tokens is
    appended after them in the order they came."""
    cache = _cache(page_size=8, sink_tokens=0, recent_tokens=8, observation_window=4)
    entry_queries = [torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(i)) for i in range(11)]
    cache.observe(0, torch.randn(4, 6, 16), kv_heads=2)  # a prefill chunk fills the window
    for i, q in enumerate(entry_queries):
        cache.observe(0, q, kv_heads=2)
        latest = torch.cat(entry_queries[max(0, i - 3): i + 1], dim=1).to(torch.float16)
        if i >= 3:
            assert _window_rows(cache.sequences[0].observation) == _window_rows(latest)
    chunk = torch.randn(4, 2, 16)
    cache.observe(0, chunk, kv_heads=2)
    expected = torch.cat(entry_queries[-2:] + [chunk], dim=1).to(torch.float16)
    assert torch.equal(cache.sequences[0].observation, expected)


def test_a_window_made_under_inference_mode_takes_decode_queries_outside_it():
    cache = _cache(page_size=8, sink_tokens=0, recent_tokens=8, observation_window=4)
    with torch.inference_mode():
        cache.observe(0, torch.randn(4, 6, 16), kv_heads=2)
    q = torch.randn(4, 1, 16)
    cache.observe(0, q, kv_heads=2)  # cannot write an inference tensor in place here: rebuilt instead
    assert torch.equal(cache.sequences[0].observation[:, -1], q[:, 0].to(torch.float16))


@pytest.mark.parametrize("fields", [dict(), dict(mid_bits=2), dict(mid_bits=8, key_energy=0.9, value_energy=0.9),
                                    dict(policy="h2o"), dict(policy="kivi", mid_bits=2)])
def test_rows_a_room_holds_are_what_removing_one_row_at_a_time_gives(fields):
    """`keep_count`'s rows within a page's room (one division) against the plain search: drop a
    row while the page's Mid bytes exceed the room. Rooms at, between and around every count's
    bytes, fractional ones too (a budget is a float)."""
    cache = _cache(page_size=16, sink_tokens=16, recent_tokens=16, **fields)
    cache.scale = 0.25  # what a session sets from the attention site
    k, v = _structured_kv(96, heads=2, dim=16)
    cache.observe(0, torch.randn(4, 8, 16), 2)
    cache.append(0, k, v)
    entry = cache.sequences[0]
    assert entry.mid is not None
    sizes = [cache.mid_page_nbytes(entry, n) for n in range(17)]
    rooms = sorted({r + d for r in sizes for d in (-1, -0.5, -1e-9, 0, 1e-9, 0.5)} | {-5, 10 ** 6})
    for most in (1, 7, 16):
        for room in rooms:
            expected = most
            while expected > 0 and sizes[expected] > room:
                expected -= 1
            got = most if sizes[most] <= room else cache._rows_within(entry, most, room)
            assert got == expected, (most, room)
