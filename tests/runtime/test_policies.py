"""Baseline policies (StreamingLLM, SnapKV, H2O, KNorm, KIVI, Palu) in the one store/session.

Each is checked for what makes it that method: which tokens it keeps on a constructed case
whose answer is known, how many bytes a token costs, and that the bytes the session reports are
the tensors it holds. Everything runs through `kvtopo.session(...).attend`, in prefill chunks
and single decode steps, as a compiled model would call it.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtopo
from kvtopo import Config
from kvtopo.kernels.scoring import softmax_mass
from kvtopo.runtime.lifecycle import BudgetExceeded
from kvtopo.runtime.phases import Phase
from kvtopo.runtime.policies import POLICIES, ScoreInputs, make_policy
from kvtopo.runtime.policies.snapkv import max_pool_tokens

from store_walk import held_tensor_bytes

BASELINES = ("streaming", "snapkv", "h2o", "knorm", "kivi", "palu")
EVICTING = ("snapkv", "h2o", "knorm")


def _kv(n, heads=2, dim=16, seed=0, dtype=torch.float32):
    """Keys/values with a decaying spectrum, a per-channel offset on keys, and noise."""
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -1.5, dim)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0]
    offset = torch.zeros(dim)
    offset[:2] = 3.0
    k = (torch.randn(heads, n, dim, generator=g) * spectrum) @ basis.T + offset
    v = (torch.randn(heads, n, dim, generator=g) * spectrum) @ basis
    return k.to(dtype), v.to(dtype)


def _run(config, q, k, v, chunks, scale=0.25, layer="l"):
    """Feed q [Hq, N, d], k/v [Hkv, N, d] through a session: `chunks` tokens per call (a list
    of sizes, the rest as single decode steps). Returns (session, outputs [Hq, N, dv])."""
    outs, start = [], 0
    sizes = list(chunks) + [1] * (q.shape[1] - sum(chunks))
    with kvtopo.session(config) as s:
        for n in sizes:
            sl = slice(start, start + n)
            outs.append(s.attend(layer, q[None, :, sl], k[None, :, sl], v[None, :, sl], None, scale)[0])
            start += n
    return s, torch.cat(outs, 1)


def _exact(q, k, v, scale=0.25):
    """Causal float64 attention of every query row over k/v."""
    hq, n, _ = q.shape
    group = hq // k.shape[0]
    kk, vv = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    logits = q.double() @ kk.transpose(1, 2) * scale
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~mask, -math.inf), -1) @ vv


def _mid_pages(session, layer="l"):
    """[(page index, kept keys [Hkv, kept, d])] of every Mid page, oldest first, from the
    contiguous Mid segment (exact keys: only for policies that store Mid unprojected floats)."""
    entry = session.layers[layer].sequences[0]
    pages = [(i, p) for i, p in enumerate(entry.pages) if p.phase is Phase.MID]
    if entry.mid is None:
        return []
    heads, dim = session.layers[layer].pool.keys.shape[1], session.layers[layer].pool.keys.shape[-1]
    rows = entry.mid.keys.decode().transpose(0, 1) if entry.mid.tokens else torch.empty(heads, 0, dim)
    counts = entry.mid.keys.page_rows.tolist()
    assert counts == [p.kept for _, p in pages]
    starts = [sum(counts[:j]) for j in range(len(counts))]
    return [(i, rows[:, a:a + c]) for (i, _), a, c in zip(pages, starts, counts)]


def _kept_rows(kept_keys, original_keys):
    """Token indices (within the page) each kv-head kept: [Hkv, kept], matched by exact keys."""
    match = (kept_keys[:, :, None, :] == original_keys[:, None, :, :]).all(-1)  # [Hkv, kept, P]
    assert bool((match.sum(-1) == 1).all()), "every stored key is one original key"
    return match.float().argmax(-1)


# -- registration and defaults ------------------------------------------------------------------
def test_every_baseline_is_registered_and_constructs_with_defaults():
    for name in BASELINES:
        assert POLICIES[name].name == name
        make_policy(Config(policy=name))  # defaults make sense without further fields
    assert POLICIES["h2o"].tracks_attention_mass and not POLICIES["snapkv"].tracks_attention_mass


@pytest.mark.parametrize("policy", ["palu", "topo"])
def test_value_energy_alone_is_refused(policy):
    """Values are projected only together with keys: value_energy alone was ignored."""
    with pytest.raises(ValueError, match="value_energy=0.8 without key_energy"):
        Config(policy=policy, value_energy=0.8)


def test_palu_refuses_key_energy_alone():
    with pytest.raises(ValueError, match="palu' projects keys and values alike"):
        Config(policy="palu", key_energy=0.8)


def test_key_energy_alone_is_refused_by_a_layer_with_values_of_its_own():
    """key_energy alone projects an MLA latent's keys (its values); a layer with values of its own
    refuses it before storing anything (it crashed once a page reached Mid)."""
    config = Config(page_size=8, sink_tokens=8, recent_tokens=8, key_energy=0.9, target_ratio=None)
    k, v = _kv(40)
    with kvtopo.session(config) as s, pytest.raises(ValueError, match="without value_energy projects an MLA latent"):
        s.attend("l", torch.randn(1, 4, 40, 16), k[None], v[None], None, 0.25)
    assert not s.layers


@pytest.mark.parametrize("policy", ["palu", "topo"])
def test_a_latent_refuses_a_value_energy_it_would_ignore(policy):
    """An MLA latent is projected once, at key_energy: a different value_energy was ignored
    silently; it is refused before storing anything (equal to key_energy, it runs)."""
    latent, rope = torch.randn(1, 1, 40, 12), torch.randn(1, 1, 40, 4)
    keys, q = torch.cat([latent, rope], -1), torch.randn(1, 4, 40, 16)
    fields = dict(policy=policy, page_size=8, sink_tokens=8, recent_tokens=8, target_ratio=None, key_energy=0.9)
    with kvtopo.session(Config(**fields, value_energy=0.5)) as s, pytest.raises(ValueError, match="projected once at key_energy"):
        s.attend("l", q, keys, latent, None, 0.25, shared_value_dim=12)
    assert not s.layers
    with kvtopo.session(Config(**fields, value_energy=0.9)) as s:
        s.attend("l", q, keys, latent, None, 0.25, shared_value_dim=12)
    assert s.layers["l"].length(0) == 40


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "knorm", "streaming", "kivi"])
def test_energies_are_refused_by_a_policy_that_does_not_project(policy):
    with pytest.raises(ValueError, match=f"policy '{policy}' does not project"):
        Config(policy=policy, key_energy=0.9, value_energy=0.9)


def test_lossless_refuses_another_policy():
    with pytest.raises(ValueError, match="Config.lossless: policy='topo'"):
        Config.lossless(policy="topo")


def test_palu_projects_at_its_own_default_energy_where_topo_does_not_project():
    assert (Config(policy="palu").key_energy, Config(policy="palu").value_energy) == (0.9, 0.9)
    assert make_policy(Config(policy="palu")).mid_encoding().project
    assert not make_policy(Config()).mid_encoding().project
    assert make_policy(Config(key_energy=0.9, value_energy=0.9)).mid_encoding().project


def test_what_each_baseline_encodes():
    enc = {name: make_policy(Config(policy=name)).mid_encoding() for name in BASELINES}
    for name in EVICTING + ("streaming",):
        assert enc[name].evict and not enc[name].project and enc[name].key_bits is None
    assert not enc["kivi"].evict and not enc["kivi"].project and enc["kivi"].key_bits == enc["kivi"].value_bits == 4
    assert not enc["palu"].evict and enc["palu"].project and enc["palu"].key_bits is None
    for name in BASELINES:  # every baseline keeps its recent window exact
        assert make_policy(Config(policy=name)).recent_bits() is None
    for name in EVICTING:  # no budget: nothing to evict, Mid stays exact in place
        assert make_policy(Config(policy=name, target_ratio=None)).mid_encoding().identity


# -- exactness when nothing is dropped or encoded -----------------------------------------------
@pytest.mark.parametrize("name,fields", [
    ("snapkv", dict(target_ratio=None)),
    ("h2o", dict(target_ratio=None)),
    ("knorm", dict(target_ratio=None)),
    ("kivi", dict(mid_bits=None)),
    ("streaming", dict(sink_tokens=0, recent_tokens=4096)),  # the window covers everything
])
def test_output_is_exact_attention_when_nothing_is_dropped_or_encoded(name, fields):
    k, v = _kv(150, seed=1)
    q = torch.randn(4, 150, 16, generator=torch.Generator().manual_seed(2))
    config = Config(**{"policy": name, "page_size": 8, "sink_tokens": 8, "recent_tokens": 16, **fields})
    s, out = _run(config, q, k, v, chunks=[40, 60])
    torch.testing.assert_close(out.double(), _exact(q, k, v), atol=1e-5, rtol=1e-5)
    if name in ("snapkv", "h2o", "knorm", "kivi", "palu"):
        assert s.stats().per_kind["mid"] > 0  # pages really aged into Mid


def test_short_sequences_are_exact_under_every_baseline():
    """Before any page reaches Mid, every baseline holds sinks/recent/terminal exactly."""
    k, v = _kv(90, seed=3)
    q = torch.randn(4, 90, 16, generator=torch.Generator().manual_seed(4))
    for name in BASELINES:
        config = Config(policy=name, page_size=16, sink_tokens=16, recent_tokens=64)
        _, out = _run(config, q, k, v, chunks=[33])
        torch.testing.assert_close(out.double(), _exact(q, k, v), atol=1e-5, rtol=1e-5)


# -- bytes are the held tensors ----------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(BASELINES), page=st.sampled_from([4, 8, 16]), sinks=st.integers(0, 20),
       recent=st.integers(0, 40), chunks=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       decode=st.integers(0, 12), ratio=st.sampled_from([None, 2.0, 6.0]))
def test_reported_bytes_are_the_held_tensors(name, page, sinks, recent, chunks, decode, ratio):
    fields = dict(policy=name, page_size=page, sink_tokens=sinks, recent_tokens=recent, target_ratio=ratio)
    n = sum(chunks) + decode
    k, v = _kv(n, dim=16, dtype=torch.float16)
    q = torch.randn(4, n, 16, generator=torch.Generator().manual_seed(n)).half()
    s, out = _run(Config(**fields), q, k, v, chunks=chunks)
    stats = s.stats()
    assert bool(torch.isfinite(out).all())
    assert stats.total_bytes == sum(stats.per_kind.values()) == held_tensor_bytes(s.layers["l"])
    assert stats.fp16_bytes == n * 2 * 2 * 16 * 2
    if name == "streaming":  # no Mid token; only the segment's int32 row count per Mid page
        entry = s.layers["l"].sequences[0]
        assert entry.mid is None or entry.mid.tokens == 0
        assert stats.per_kind["mid"] == 8 * sum(p.phase is Phase.MID for p in entry.pages)


# -- StreamingLLM -------------------------------------------------------------------------------
def test_streaming_keeps_sinks_and_window_only_and_its_bytes_stop_growing():
    k, v = _kv(400, seed=5)
    q = torch.randn(4, 400, 16, generator=torch.Generator().manual_seed(6))
    config = Config(policy="streaming", page_size=8, sink_tokens=8, recent_tokens=16)
    sizes = []
    with kvtopo.session(config) as s:
        outs = [s.attend("l", q[None, :, :96], k[None, :, :96], v[None, :, :96], None, 0.25)[0]]
        for t in range(96, 400):
            outs.append(s.attend("l", q[None, :, t:t + 1], k[None, :, t:t + 1], v[None, :, t:t + 1], None, 0.25)[0])
            sizes.append(s.stats().total_bytes)
        entry = s.layers["l"].sequences[0]
        mid_pages = [p for p in entry.pages if p.phase is Phase.MID]
        assert entry.mid.tokens == 0 and all(p.kept == 0 for p in mid_pages)
        # Only the per-page row counts of the Mid segment (int32, keys and values) remain.
        assert s.stats().per_kind["mid"] == 2 * 4 * len(mid_pages)
    # Nothing but those counts grows: the cache is constant-size however long the sequence.
    growth = [b - a for a, b in zip(sizes[-200:], sizes[-199:])]
    assert set(growth) <= {0, 8}
    # Decode step t sees exactly: the sink page, the 2 Recent pages and the Terminal page of
    # the history (tokens 0..t-1, pages of 8), and itself.
    out = torch.cat(outs, 1)
    for t in (150, 232, 233, 399):
        terminal = (t - 1) // 8
        visible = torch.zeros(t + 1, dtype=torch.bool)
        visible[:8] = True
        visible[max(terminal - 2, 1) * 8:] = True
        keys = k[:, :t + 1][:, visible].double().repeat_interleave(2, 0)
        values = v[:, :t + 1][:, visible].double().repeat_interleave(2, 0)
        expected = torch.softmax(q[:, t:t + 1].double() @ keys.transpose(1, 2) * 0.25, -1) @ values
        torch.testing.assert_close(out[:, t:t + 1].double(), expected, atol=1e-5, rtol=1e-5)


def test_streaming_default_config_drops_mid_whatever_the_budget():
    k, v = _kv(600, seed=7)
    q = torch.randn(4, 600, 16, generator=torch.Generator().manual_seed(8))
    s, _ = _run(Config(policy="streaming", page_size=8, sink_tokens=8, recent_tokens=16), q, k, v, chunks=[300])
    mid = s.layers["l"].sequences[0].mid
    assert mid.tokens == 0 and mid.keys.rows is None and mid.values.rows is None  # only per-page row counts


# -- SnapKV ---------------------------------------------------------------------------------------
def test_max_pool_is_clipped_to_the_page():
    score = torch.tensor([[0.0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 1]])
    pooled = max_pool_tokens(score, 7)
    assert pooled.tolist() == [[0, 5, 5, 5, 5, 5, 5, 5, 1, 1, 1]]
    # Clipped to the page: 3 tokens for a page of 4, none for 2 (a 7-token kernel would spread the 9 to all).
    assert max_pool_tokens(torch.tensor([[0.0, 0, 9, 0]]), 7).tolist() == [[0, 9, 9, 9]]
    assert max_pool_tokens(torch.tensor([[0.0, 9]]), 7).tolist() == [[0, 9]]
    assert max_pool_tokens(score[:, :1], 7).tolist() == [[0]]


def _hot_case(n=512, heads=2, dim=32, hot_every=32, hot_at=13, seed=0, dtype=torch.float32):
    """Keys: small noise, except one 'hot' token per page aligned with a per-head direction
    that every query shares, so the hot tokens receive most of the softmax mass."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.nn.functional.normalize(torch.randn(heads, 1, dim, generator=g), dim=-1)
    k = 0.3 * torch.randn(heads, n, dim, generator=g)
    hot = torch.arange(hot_at, n, hot_every)
    k[:, hot] += 4.0 * direction
    v = torch.randn(heads, n, dim, generator=g)
    q = (3.0 * direction.repeat_interleave(2, 0) + 0.3 * torch.randn(2 * heads, n, dim, generator=g))
    return q.to(dtype), k.to(dtype), v.to(dtype), hot


def test_snapkv_keeps_the_tokens_with_most_softmax_mass_and_their_neighbours():
    q, k, v, hot = _hot_case(n=1024, dtype=torch.float16)
    config = Config(policy="snapkv", page_size=32, sink_tokens=32, recent_tokens=32, target_ratio=2.0)
    s, _ = _run(config, q, k, v, chunks=[128] * 8)
    assert not s.stats().budget_missed
    mids = _mid_pages(s)
    # Early pages pay for the exact sink/recent pages (they keep little); later ones keep ~16.
    assert sum(7 <= kept_keys.shape[1] < 32 for _, kept_keys in mids) >= 10
    cluster = set(range(10, 17))  # hot token 13 and its +-3 neighbours (pooling kernel 7)
    for index, kept_keys in mids:
        kept = _kept_rows(kept_keys, k[:, index * 32:(index + 1) * 32])
        for h in range(2):
            if kept_keys.shape[1] >= 7:
                assert cluster <= set(kept[h].tolist())
            else:
                assert set(kept[h].tolist()) <= cluster


def test_snapkv_score_is_pooled_softmax_mass_of_the_window():
    q, k, v, _ = _hot_case(n=64)
    inputs = ScoreInputs(k[:, :32], v[:, :32], q[:, -8:], 0.2)
    score = make_policy(Config(policy="snapkv")).score(inputs)
    torch.testing.assert_close(score, max_pool_tokens(softmax_mass(q[:, -8:], k[:, :32], 0.2), 7))
    assert make_policy(Config(policy="snapkv")).score(ScoreInputs(k, v, None, 0.2)).shape == (2, 64)


# -- KNorm ----------------------------------------------------------------------------------------
def test_knorm_keeps_the_lowest_norm_keys():
    g = torch.Generator().manual_seed(11)
    n, heads, dim = 1024, 2, 16
    norms = torch.rand(heads, n, generator=g) * 10 + 0.1  # distinct norms
    k = (torch.nn.functional.normalize(torch.randn(heads, n, dim, generator=g), dim=-1) * norms[..., None]).half()
    v = torch.randn(heads, n, dim, generator=g).half()
    q = torch.randn(4, n, dim, generator=g).half()
    config = Config(policy="knorm", page_size=32, sink_tokens=32, recent_tokens=32, target_ratio=2.0)
    s, _ = _run(config, q, k, v, chunks=[300, 300, 300])
    mids = _mid_pages(s)
    assert sum(0 < kept_keys.shape[1] < 32 for _, kept_keys in mids) >= 10
    for index, kept_keys in mids:
        original = k[:, index * 32:(index + 1) * 32]
        kept = _kept_rows(kept_keys, original)
        lowest = original.norm(dim=-1).argsort(-1)[:, : kept_keys.shape[1]]
        for h in range(heads):
            assert set(kept[h].tolist()) == set(lowest[h].tolist())


# -- H2O ------------------------------------------------------------------------------------------
def test_h2o_accumulates_mass_while_pages_are_unsettled():
    k, v = _kv(120, seed=12)
    q = torch.randn(4, 120, 16, generator=torch.Generator().manual_seed(13))
    config = Config(policy="h2o", page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None)
    with kvtopo.session(config) as s:
        s.attend("l", q[None, :, :50], k[None, :, :50], v[None, :, :50], None, 0.25)
        for t in range(50, 120):
            s.attend("l", q[None, :, t:t + 1], k[None, :, t:t + 1], v[None, :, t:t + 1], None, 0.25)
        unsettled = s.layers["l"].unsettled_pages(0)
        masses = [p.mass for p in unsettled if p.mass is not None]
        assert masses and all(bool((m > 0).all()) for m in masses)
        # Each decode query row's mass over all tokens is 1; unsettled pages get part of it.
        per_head = sum(m.sum(-1) for m in masses)
        assert bool((per_head <= 2 * 70 + 1e-3).all())
        assert s.stats().per_kind["metadata"] >= sum(m.nbytes for m in masses)


def _h2o_case(policy, budget):
    """Page 0 (tokens 0-7) ages through Terminal/Recent while queries 8..15 all look at its
    token 2; the last query (the observation window, W=1) looks at its token 5."""
    g = torch.Generator().manual_seed(14)
    heads, dim, n = 1, 16, 17
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0].T  # orthonormal rows
    k = 0.05 * torch.randn(heads, n, dim, generator=g)
    k[0, 2] += 3 * basis[0]
    k[0, 5] += 3 * basis[1]
    k[0, 8:] += 3 * basis[2]  # later tokens are off both directions
    v = torch.randn(heads, n, dim, generator=g)
    q = torch.zeros(2, n, dim)
    q[:, :16] = 2 * basis[0]
    q[:, 16] = 2.5 * basis[1]
    config = Config(policy=policy, page_size=8, sink_tokens=0, recent_tokens=8, observation_window=1,
                    target_ratio=None, layer_budget_bytes=budget)
    s, _ = _run(config, q, k, v, chunks=[8])
    (index, kept_keys), = _mid_pages(s)
    assert index == 0
    return s, kept_keys, k


def test_h2o_accumulated_mass_drives_the_choice():
    # Find the budget at which page 0 keeps exactly one token, then compare policies on it.
    lo, hi = 1, 8192  # kept tokens grow with the budget: bisect for the first budget keeping one
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _h2o_case("h2o", mid)[1].shape[1] == 0 else (lo, mid)
    budget = hi
    s, h2o_kept, k = _h2o_case("h2o", budget)
    assert _kept_rows(h2o_kept, k[:, :8]).tolist() == [[2]]  # the heavy hitter of queries 8..16
    # The observation window alone (the fallback, SnapKV without pooling) would keep token 5.
    window = s.layers["l"].sequences[0].observation
    assert softmax_mass(window, k[:, :8], 0.25).argmax().item() == 5


def test_h2o_score_falls_back_to_the_window_without_mass():
    q, k, v, _ = _hot_case(n=64)
    policy = make_policy(Config(policy="h2o"))
    window = q[:, -8:]
    torch.testing.assert_close(policy.score(ScoreInputs(k, v, window, 0.2)), softmax_mass(window, k, 0.2))
    mass = torch.rand(2, 64)
    torch.testing.assert_close(policy.score(ScoreInputs(k, v, window, 0.2, mass)), mass)
    partial = mass[:, :40]  # mass for part of the page only: one scale for the whole page
    torch.testing.assert_close(policy.score(ScoreInputs(k, v, window, 0.2, partial)), softmax_mass(window, k, 0.2))


# -- KIVI -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_mid_bytes_per_token_follow_the_formula(bits):
    heads, dim, page = 2, 128, 32
    k, v = _kv(700, heads=heads, dim=dim, seed=15, dtype=torch.float16)
    q = torch.randn(4, 700, dim, generator=torch.Generator().manual_seed(16)).half()
    config = Config(policy="kivi", mid_bits=bits, page_size=page, sink_tokens=32, recent_tokens=64)
    s, out = _run(config, q, k, v, chunks=[256, 256, 180], scale=dim ** -0.5)  # then 8 decode steps
    entry = s.layers["l"].sequences[0]
    mids = [p for p in entry.pages if p.phase is Phase.MID]
    # Keys: codes + float16 (scale, offset) per channel of the page; values: codes + float16
    # (scale, offset) per token and head; plus one int32 row count per page for each.
    per_page = heads * (page * dim * bits // 8 + 2 * 2 * dim) + heads * (page * dim * bits // 8 + 2 * 2 * page)
    assert s.stats().per_kind["mid"] == len(mids) * (per_page + 2 * 4)
    assert all(p.kept == page for p in mids)  # nothing evicted
    assert tuple(entry.mid.keys.scale.shape) == (len(mids), heads, dim)  # per channel, per page
    assert tuple(entry.mid.values.scale.shape) == (len(mids) * page, heads, 1)  # per token
    fp16_per_token = heads * 2 * dim * 2
    mid_ratio = fp16_per_token * page * len(mids) / s.stats().per_kind["mid"]  # row counts included
    assert mid_ratio == pytest.approx({2: 6.09, 4: 3.46}[bits], abs=0.01)
    assert s.stats().per_kind["recent"] == 2 * heads * page * dim * 2 * 2  # exact residual window
    err = ((out.double() - _exact(q, k, v, dim ** -0.5)).norm() / _exact(q, k, v, dim ** -0.5).norm()).item()
    assert err < {2: 0.3, 4: 0.06}[bits]


# -- Palu ---------------------------------------------------------------------------------------------
def test_palu_projects_onto_few_directions_in_float16():
    g = torch.Generator().manual_seed(17)
    heads, dim, rank, n = 2, 32, 4, 400
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=g))[0][:, :rank]
    k = torch.randn(heads, n, rank, generator=g) @ basis.T + 2.0  # rank 4 around a mean
    v = torch.randn(heads, n, rank, generator=g) @ basis.T
    q = torch.randn(4, n, dim, generator=g)
    config = Config(policy="palu", page_size=16, sink_tokens=16, recent_tokens=32, key_energy=0.999, value_energy=0.999)
    s, out = _run(config, q, k, v, chunks=[200, 150], scale=dim ** -0.5)
    entry = s.layers["l"].sequences[0]
    assert entry.mid.key_bases.ranks == entry.mid.value_bases.ranks == (rank, rank)
    mids = [p for p in entry.pages if p.phase is Phase.MID]
    for rows in (entry.mid.keys.rows, entry.mid.values.rows):  # float16 coefficients, true ranks only
        assert rows.dtype == torch.float16 and tuple(rows.shape) == (16 * len(mids), heads * rank)
    assert s.stats().per_kind["mid"] == len(mids) * (16 * 2 * heads * rank * 2 + 2 * 4)
    exact = _exact(q, k, v, dim ** -0.5)
    assert ((out.double() - exact).norm() / exact.norm()).item() < 3e-3  # float16 coefficients only
    # Palu never evicts: its exact pages (float32 here) alone hold more than the default 8x
    # budget of these 350 tokens, and the store must say so.
    exact_pages = sum(p.slot is not None for p in entry.pages)
    assert exact_pages * 16 * heads * 2 * dim * 4 > 350 * heads * 2 * dim * 2 / 8
    assert s.stats().budget_missed


def test_palu_bytes_shrink_with_energy():
    k, v = _kv(500, heads=2, dim=32, seed=18, dtype=torch.float16)
    q = torch.randn(4, 500, 32, generator=torch.Generator().manual_seed(19)).half()
    mid = []
    for energy in (0.5, 0.9, 0.99):
        s, _ = _run(Config(policy="palu", key_energy=energy, value_energy=energy, page_size=16), q, k, v, chunks=[250, 250])
        mid.append(s.stats().per_kind["mid"])
    assert mid[0] < mid[1] < mid[2] < 468 * 2 * 2 * 32 * 2  # below what exact Mid pages would hold


# -- budgets ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", EVICTING)
def test_evicting_baselines_meet_their_budget_once_the_context_allows(name):
    # The pages that entered Mid while the exact pages and metadata held most of the budget kept
    # their tokens' share (lifecycle.page_room); the later ones make up for it.
    n = 4000
    k, v = _kv(n, heads=2, dim=32, dtype=torch.float16, seed=20)
    q = torch.randn(4, n, 32, generator=torch.Generator().manual_seed(21)).half()
    config = Config(policy=name, page_size=16, sink_tokens=16, recent_tokens=32, target_ratio=8.0)
    with kvtopo.session(config) as s:
        s.attend("l", q[None, :, :64], k[None, :, :64], v[None, :, :64], None, 0.2)
        assert s.stats().budget_missed  # 64 tokens: the exact pages alone are over 1/8 of fp16
        for start in range(64, n, 256):
            sl = slice(start, start + 256)
            s.attend("l", q[None, :, sl], k[None, :, sl], v[None, :, sl], None, 0.2)
        stats = s.stats()
        entry = s.layers["l"].sequences[0]
        held = s.layers["l"].sequence_nbytes(entry)
    assert not stats.budget_missed
    assert held <= stats.fp16_bytes / 8.0
    assert stats.per_kind["mid"] > 0 and stats.ratio_vs_fp16 >= 6.0  # free pool slots included


@pytest.mark.parametrize("name", EVICTING)
def test_evicting_baselines_raise_when_asked_and_the_budget_cannot_be_met(name):
    k, v = _kv(200, seed=22)
    config = Config(policy=name, page_size=8, sink_tokens=64, recent_tokens=64, layer_budget_bytes=2000, over_budget="raise")
    with kvtopo.session(config) as s, pytest.raises(BudgetExceeded, match="cannot be met"):
        s.attend("l", torch.randn(1, 4, 200, 16), k[None], v[None], None, 0.25)


@pytest.mark.parametrize("name,fields", [("kivi", dict(mid_bits=4)), ("palu", dict(key_energy=0.99, value_energy=0.99))])
def test_non_evicting_baselines_report_a_budget_they_cannot_meet(name, fields):
    """KIVI and Palu never drop tokens: a budget below what their encoding costs is reported
    as missed, and no budget means no miss. Asking them to raise on a miss is refused up front:
    they have nothing to evict, so the request could never be honoured as asked."""
    with pytest.raises(ValueError, match=f"over_budget='raise' with policy '{name}'"):
        Config(policy=name, page_size=16, target_ratio=8.0, over_budget="raise", **fields)
    k, v = _kv(600, heads=2, dim=32, dtype=torch.float16, seed=23)
    q = torch.randn(4, 600, 32, generator=torch.Generator().manual_seed(24)).half()
    s, _ = _run(Config(policy=name, page_size=16, target_ratio=8.0, **fields), q, k, v, chunks=[300, 300])
    assert s.stats().budget_missed and s.stats().per_kind["mid"] > 0
    s, _ = _run(Config(policy=name, page_size=16, target_ratio=None, **fields), q, k, v, chunks=[300, 300])
    assert not s.stats().budget_missed


# -- bench/memory.py's prefill shortcut ---------------------------------------------------------
def _bench_memory():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["topo", "full", "streaming", "snapkv", "knorm", "kivi", "palu"])
def test_bench_store_only_prefill_keeps_what_attend_prefill_keeps(name):
    """bench/memory.py skips the (discarded) outputs of prefill chunks and makes only the store
    calls `attend` makes; for policies that do not track attention mass the store must end up
    identical: same bytes per kind, same decode outputs."""
    bench = _bench_memory()
    k, v = _kv(700, heads=2, dim=32, seed=30, dtype=torch.float16)
    q = torch.randn(8, 708, 32, generator=torch.Generator().manual_seed(31)).half()
    k = torch.cat([k, _kv(8, heads=2, dim=32, seed=32, dtype=torch.float16)[0]], 1)
    v = torch.cat([v, _kv(8, heads=2, dim=32, seed=33, dtype=torch.float16)[1]], 1)
    fields = dict(page_size=16, sink_tokens=16, recent_tokens=32)
    config = Config(policy=name, **({"target_ratio": None} if name == "full" else {}), **fields)
    results = []
    for store_only in (False, True):
        with kvtopo.session(config) as s:
            s.attend(bench.LAYER, q[None, :, :1], k[None, :, :1], v[None, :, :1], None, 0.2)
            for a in range(1, 700, 128):
                b = min(a + 128, 700)
                if store_only:
                    bench.store_chunk(s, q[:, a:b], k[:, a:b], v[:, a:b])
                else:
                    s.attend(bench.LAYER, q[None, :, a:b], k[None, :, a:b], v[None, :, a:b], None, 0.2)
            out = s.attend(bench.LAYER, q[None, :, 700:], k[None, :, 700:], v[None, :, 700:], None, 0.2)
            results.append((s.stats().per_kind, out))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])


def test_bench_quick_runs_and_reports_bytes_from_the_session(monkeypatch):
    """bench/memory.py's run stores each prefill chunk with all its queries (as `attend` observes
    them; topo ranks a chunk's pages by them), the same ones in every run, the window last."""
    bench = _bench_memory()
    inputs = bench.Inputs(2048 + 512, 4)
    reference = bench.exact_decode(inputs)
    observed, store_chunk = [], bench.store_chunk
    monkeypatch.setattr(bench, "store_chunk", lambda s, q, k, v: (observed.append(q), store_chunk(s, q, k, v)))
    full = bench.run(inputs, Config.lossless(), reference)
    assert full["error"] < 2e-3  # float16 output rounding only
    chunks = bench.prefill_chunks(inputs.n)
    assert [q.shape[1] for q in observed] == [b - a for a, b in chunks]
    for q, (_, b) in zip(observed, chunks):
        assert torch.equal(q[:, -inputs.windows[b].shape[1]:], inputs.windows[b])
    observed.clear()
    topo = bench.run(inputs, Config(), reference)
    assert len(observed) == len(chunks)
    assert all(torch.equal(q, inputs.chunk_queries(a, b)) for q, (a, b) in zip(observed, chunks))
    assert topo["tokens"] == 2048 + 512 + 4
    assert topo["ratio"] == pytest.approx(topo["tokens"] * bench.FP16_PER_TOKEN / topo["total_bytes"])
    assert sum(topo["per_kind"].values()) == topo["total_bytes"]


@pytest.mark.parametrize("policy,holds", [("knorm", False), ("streaming", False), ("snapkv", True), ("topo", True)])
def test_only_policies_whose_scores_read_queries_hold_them(policy, holds):
    """knorm and streaming rank without queries: their observation windows were bytes under the
    budget that no score read. A decode step after the prompt keeps it so."""
    config = Config(policy=policy, page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=4.0)
    k, v = _kv(81)
    q = torch.randn(1, 4, 81, 16, generator=torch.Generator().manual_seed(1))
    with kvtopo.session(config) as s:
        s.attend("l", q[:, :, :80], k[None, :, :80], v[None, :, :80], None, 0.25)
        s.attend("l", q[:, :, 80:], k[None, :, 80:], v[None, :, 80:], None, 0.25)
        entry = s.layers["l"].stored_state(0)
        assert (entry.observation is not None) == holds
        assert s.layers["l"].length(0) == 81


def test_softmax_mass_caps_the_logits_as_the_layer_attends():
    """On a softcapped layer (Gemma-2) SnapKV's and H2O's mass is the capped softmax's, in float64
    here; uncapped, large logits ranked other tokens."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(4, 6, 16, generator=g) * 6, torch.randn(2, 40, 16, generator=g) * 6
    cap, scale = 5.0, 0.25
    logits = scale * q.double().reshape(2, 2 * 6, 16) @ k.double().transpose(1, 2)
    expected = torch.softmax(cap * torch.tanh(logits / cap), -1).sum(1)
    torch.testing.assert_close(softmax_mass(q, k, scale, cap).double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(softmax_mass(q, k, scale).double(), expected, rtol=1e-2)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_a_capped_layer_scores_with_its_cap(policy, monkeypatch):
    """The scores a policy ranks a capped layer's tokens by are the capped softmax's: each score
    it returned equals the capped mass of the queries and keys it was given, and the uncapped mass
    of these large logits differs (before, only the cap's arrival in `ScoreInputs` was checked)."""
    cap, scale = 5.0, 0.25
    pool = max_pool_tokens if policy == "snapkv" else (lambda mass: mass)
    checked, score = [], POLICIES[policy].score

    def checked_score(self, inputs):  # checked as called: the keys may be pool slots reused later
        got = score(self, inputs)
        if inputs.attention_mass is None:
            torch.testing.assert_close(got, pool(softmax_mass(inputs.queries, inputs.keys, scale, cap)))
            checked.append(not torch.allclose(got, pool(softmax_mass(inputs.queries, inputs.keys, scale)), rtol=1e-2))
        return got

    monkeypatch.setattr(POLICIES[policy], "score", checked_score)
    config = Config(policy=policy, page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=4.0)
    k, v = _kv(80)
    q = 6 * torch.randn(4, 80, 16, generator=torch.Generator().manual_seed(1))
    with kvtopo.session(config) as s:
        for start, n in [(0, 64)] + [(t, 1) for t in range(64, 80)]:
            s.attend("l", q[None, :, start:start + n], k[None, :, start:start + n], v[None, :, start:start + n], None,
                     scale, softcap=cap)
    assert checked and any(checked)  # scores were checked, and the cap changed some


def test_h2o_accumulates_the_capped_mass_of_each_decode_step():
    """H2O's running mass on a capped layer, against float64: each decode step adds the capped
    softmax (over everything held) of its query heads to every token not yet in Mid."""
    cap, scale, steps = 5.0, 0.25, 40
    config = Config(policy="h2o", page_size=8, sink_tokens=8, recent_tokens=64, target_ratio=4.0)
    k, v = _kv(8 + steps)
    q = 6 * torch.randn(4, 8 + steps, 16, generator=torch.Generator().manual_seed(2))
    with kvtopo.session(config) as s:
        for start, n in [(0, 8)] + [(t, 1) for t in range(8, 8 + steps)]:
            s.attend("l", q[None, :, start:start + n], k[None, :, start:start + n], v[None, :, start:start + n], None,
                     scale, softcap=cap)
        entry = s.layers["l"].sequences[0]
        assert all(p.phase is not Phase.MID for p in entry.pages)  # no token left the running count
        held = torch.cat([p.mass[:, :p.tokens] for p in entry.pages[1:]], 1)  # after the sink page: [Hkv, steps - 1]

    def mass(capped: bool) -> torch.Tensor:
        expected = torch.zeros(2, 8 + steps, dtype=torch.float64)
        for t in range(8, 8 + steps):  # step t's query over tokens 0..t; token t itself was not stored yet
            logits = scale * q.double()[:, t].reshape(2, 2, 16) @ k.double()[:, : t + 1].transpose(1, 2)
            if capped:
                logits = cap * torch.tanh(logits / cap)
            expected[:, : t + 1] += torch.softmax(logits, -1).sum(1)
            expected[:, t] -= torch.softmax(logits, -1).sum(1)[:, t]
        return expected[:, 8 : 8 + steps - 1]

    torch.testing.assert_close(held.double(), mass(capped=True), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(held.double(), mass(capped=False), rtol=1e-2)


def test_topo_ranks_with_the_configured_score_margin(monkeypatch):
    """topo's scores are the exp-free score at the config's `score_margin` (each checked as it is
    returned), and the margin changes which tokens a page keeps (before, every behavioural test ran
    at the default margin, so one that was ignored went unseen)."""
    from kvtopo.runtime.policies.topo import topo_scores

    score, margins_seen = POLICIES["topo"].score, []

    def checked_score(self, inputs):
        got = score(self, inputs)
        parts = dict(chunk_queries=inputs.chunk_queries, predecessor_queries=inputs.predecessor_queries,
                     predecessor_rows=inputs.predecessor_rows, held_credit=inputs.held_credit)
        margin = self.config.score_margin
        torch.testing.assert_close(got, topo_scores(inputs.queries, inputs.keys, inputs.scale, margin, **parts))
        margins_seen.append(margin)
        return got

    monkeypatch.setattr(POLICIES["topo"], "score", checked_score)
    k, v = _kv(96)
    q = 3 * torch.randn(4, 96, 16, generator=torch.Generator().manual_seed(4))
    kept = {}
    for margin in (0.5, 50.0):
        config = Config(page_size=8, sink_tokens=8, recent_tokens=16, mid_bits=None, recent_bits=None,
                        target_ratio=4.0, score_margin=margin)
        s, _ = _run(config, q, k, v, chunks=[80])
        kept[margin] = [_kept_rows(keys, k[:, 8 * page:8 * page + 8]).tolist() for page, keys in _mid_pages(s)]
    assert set(margins_seen) == {0.5, 50.0}
    assert kept[0.5] != kept[50.0]
