"""A layer's ``DecodeBatch`` (runtime/decode_batch.py) runs a batch's decode steps without Python
per sequence, and changes nothing: against a twin session whose layer never makes one (the
per-sequence path, ``Session._decode_batch``), every step's output is the same bits and the
store ends the same (counters, pages, observation windows, pool, bytes), also when the pool
grows inside a step, and when the store is read, written or a sequence released in the middle
of a batch. In a step where no sequence moves
a page, no per-sequence function runs; in one where some do, it runs for those only."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kvtopo
from kvtopo.runtime import decode_batch as decode_batch_mod
from kvtopo.runtime import layer_cache as layer_cache_mod
from kvtopo.runtime.lifecycle import Lifecycle

HQ, HKV, D = 8, 2, 32
SCALE = D**-0.5
LENGTHS = (70, 45, 20)  # staggered: their pages fill on different steps; the last enters Mid while decoding
PAGE = 8
CONFIGS = {
    "topo": dict(target_ratio=4.0),
    "kivi": dict(policy="kivi", target_ratio=None),
    "lossless": None,
    "topo-projected": dict(target_ratio=None, key_energy=0.9, value_energy=0.9),  # not taken: coded Mid
}
TAKEN = ("topo", "kivi", "lossless")


def _config(name):
    if CONFIGS[name] is None:
        return kvtopo.Config.lossless(page_size=PAGE, prefill_chunk_size=512)
    return kvtopo.Config(page_size=PAGE, sink_tokens=8, recent_tokens=16, observation_window=8, **CONFIGS[name])


def _prompts(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        q, k, v = (torch.randn(h, n, D, generator=g) for h in (HQ, HKV, HKV))
        out.append((q, (k @ torch.randn(D, D, generator=g) * 0.3 + 1.0), v))
    return [tuple(x.to(dtype) for x in p) for p in out]


def _steps(count, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(len(LENGTHS), h, 1, D, generator=g).to(dtype) for h in (HQ, HKV, HKV)] for _ in range(count)]


@contextlib.contextmanager
def _sessions(name, dtype):
    """Two sessions holding the same prompts; the twin's layer never makes a DecodeBatch."""
    with kvtopo.session(_config(name)) as batched, kvtopo.session(_config(name)) as twin:
        for s in (batched, twin):
            for b, prompt in enumerate(_prompts(dtype)):
                s.attend_sequence("l", b, *prompt, SCALE)
        twin.layers["l"].decode_batch_refused = 10**9
        yield batched, twin


def _state(cache):
    """Everything a decode step changes in a layer, read through `sequences` (written back)."""
    seqs = cache.sequences
    return [(seq, e.length, e.final_length, e.observed_oldest, e.chunk_queries is None,
             [(p.tokens, p.slot, p.phase, p.recent is not None) for p in e.pages],
             None if e.observation is None else e.observation.clone(),
             None if e.mid is None else e.mid.tokens) for seq, e in sorted(seqs.items())]


def _assert_same_store(a, b):
    ca, cb = a.layers["l"], b.layers["l"]
    for x, y in zip(_state(ca), _state(cb), strict=True):
        assert x[:6] == y[:6] and x[7] == y[7]
        assert (x[6] is None and y[6] is None) or torch.equal(x[6], y[6])
    for seq, entry in ca.sequences.items():  # the tokens held exactly (a slot's other rows are not data)
        for page, twin_page in zip(entry.pages, cb.sequences[seq].pages, strict=True):
            if page.slot is not None:
                for pa, pb in ((ca.pool.keys, cb.pool.keys), (ca.pool.values, cb.pool.values)):
                    assert torch.equal(pa[page.slot, :, : page.tokens], pb[twin_page.slot, :, : page.tokens])
    assert a.stats() == b.stats()


def _count_steps(monkeypatch):
    """Records each DecodeBatch step's batch size, negated when the pool grew in it (a due
    sequence's append reallocates the pool: the batch is written back and made again)."""
    taken = []
    real = decode_batch_mod.DecodeBatch.step

    def spy(self, *args):
        pool = self.cache.pool.keys
        out = real(self, *args)
        taken.append(len(self.seqs) if self.cache.pool.keys is pool else -len(self.seqs))
        return out

    monkeypatch.setattr(decode_batch_mod.DecodeBatch, "step", spy)
    return taken


@pytest.mark.parametrize(("name", "dtype", "softcap"), [
    *((name, dtype, None) for name in CONFIGS for dtype in (torch.float32, torch.bfloat16)),
    ("topo", torch.float32, 5.0),  # Gemma-2's logit cap
])
def test_same_bits_and_store_as_the_per_sequence_path(name, dtype, softcap, monkeypatch):
    taken = _count_steps(monkeypatch)
    with _sessions(name, dtype) as (batched, twin):
        assert batched.layers["l"].stored_state(2).mid is None  # its first Mid epoch starts in a step
        for q, k, v in _steps(3 * PAGE + 5, dtype):
            out = batched.attend("l", q, k, v, None, SCALE, softcap=softcap)
            ref = twin.attend("l", q, k, v, None, SCALE, softcap=softcap)
            assert out.dtype == ref.dtype and torch.equal(out, ref)
        assert len(taken) == (3 * PAGE + 4 if name in TAKEN else 0)  # made at the second step
        if name == "lossless":  # every page stays exact: the pool grows inside batch steps
            assert any(n < 0 for n in taken)
        if name in TAKEN:
            assert batched.layers["l"].decode_batch is not None
        assert (batched.layers["l"].stored_state(2).mid is None) == (name == "lossless")
        _assert_same_store(batched, twin)


def test_reads_and_writes_in_the_middle_of_a_batch(monkeypatch):
    """The deferred counters are read right without ending the batch (`length`, `longest`,
    `stats()`), written back by any other read or write; a prefill chunk or a release in the middle, and
    a batch of other sequences, end the batch; the next steps make a new one."""
    taken = _count_steps(monkeypatch)
    steps = _steps(4 * PAGE, torch.float32)
    with _sessions("topo", torch.float32) as (batched, twin):
        ca, cb = batched.layers["l"], twin.layers["l"]
        for i, (q, k, v) in enumerate(steps):
            seqs = [0, 1, 2] if i < 3 * PAGE else [0, 2]  # then sequence 1 leaves the batch
            rows = torch.tensor(seqs)
            out = batched.attend_sequences("l", seqs, q[rows], k[rows], v[rows], SCALE)
            assert torch.equal(out, twin.attend_sequences("l", seqs, q[rows], k[rows], v[rows], SCALE))
            assert [ca.length(s) for s in range(3)] == [cb.length(s) for s in range(3)]
            assert ca.longest() == cb.longest()
            if i == 4:  # accounting reads the deferred counters without ending the batch
                assert ca.decode_batch is not None and batched.stats() == twin.stats()
                assert ca.decode_batch is not None
            if i == 5:
                assert ca.decode_batch is not None
                _assert_same_store(batched, twin)  # reads `sequences`: ends the batch
                assert ca.decode_batch is None
            if i == 11:  # a chunk of two tokens for sequence 2
                chunk = [x[2, :, :, :].expand(-1, 2, -1).contiguous() for x in (q, k, v)]
                assert torch.equal(batched.attend_sequence("l", 2, *chunk, SCALE),
                                   twin.attend_sequence("l", 2, *chunk, SCALE))
                assert ca.decode_batch is None
            if i == 20:
                batched.release(1), twin.release(1)
                assert ca.longest() == cb.longest()
        assert sum(abs(n) == 2 for n in taken) > 0 and sum(abs(n) == 3 for n in taken) > 0
        _assert_same_store(batched, twin)


def test_python_runs_only_for_the_sequences_that_move_pages(monkeypatch):
    """Per step: the per-sequence functions of the decode path (building a sequence's segments,
    the lifecycle's append and observe, the in-place write) run once for each sequence whose
    token opens a page or starts a Mid epoch, and not at all for the others."""
    calls = []
    for owner, name in ((decode_batch_mod, "entry_segments"), (layer_cache_mod.LayerCache, "append_entry"),
                        (Lifecycle, "observe"), (layer_cache_mod.LayerCache, "write_in_place")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name), _real(*a, **kw))[1])
    with _sessions("topo", torch.float32) as (batched, _):
        cache = batched.layers["l"]
        for q, k, v in _steps(2, torch.float32):  # the batch is made at the second step in a row
            batched.attend("l", q, k, v, None, SCALE)
        kinds = []
        for q, k, v in _steps(3 * PAGE, torch.float32, seed=2):
            pages = [cache.page_count(s) for s in range(len(LENGTHS))]
            calls.clear()
            batched.attend("l", q, k, v, None, SCALE)
            moved = sum(cache.page_count(s) != n for s, n in enumerate(pages))
            assert cache.decode_batch is not None
            assert sorted(calls) == sorted(["entry_segments", "append_entry"] * moved)
            kinds.append(moved)
        assert 0 in kinds and max(kinds) >= 1  # steps without moves and steps with


@pytest.mark.parametrize("name", ["topo", "kivi", "lossless"])
def test_steps_switching_between_inference_mode_and_no_grad(name):
    """A session stepped under `torch.inference_mode()` and `torch.no_grad()` in turns (three
    steps each) grows its pool and Mid buffers under both: it keeps writing them (buffers the
    store updates in place are never inference tensors) and computes what a twin stepped under
    no_grad alone computes, bit for bit, on the per-sequence path."""
    with _sessions(name, torch.float32) as (batched, twin):
        grown = set()
        for i, (q, k, v) in enumerate(_steps(6 * PAGE, torch.float32)):
            capacity, mid = batched.layers["l"].pool.capacity, batched.layers["l"].stored_state(2).mid
            with torch.inference_mode() if i // 3 % 2 else torch.no_grad():
                out = batched.attend("l", q, k, v, None, SCALE)
            with torch.no_grad():
                assert torch.equal(out, twin.attend("l", q, k, v, None, SCALE))
            entered = mid is None or mid.keys.count < batched.layers["l"].stored_state(2).mid.keys.count
            if batched.layers["l"].pool.capacity > capacity or (name != "lossless" and entered):
                grown.add(i // 3 % 2)
        assert grown == {0, 1}  # storage grew in both modes
        _assert_same_store(batched, twin)


def test_inputs_with_a_strided_last_dimension(monkeypatch):
    """q/k/v whose last dimension is not contiguous (every other element of a wider tensor): the
    kernel's one-call writes (`begin_step`) do not take them, the step's torch ops do; the same
    bits and store as the twin."""
    calls = []
    real = decode_batch_mod.BatchArguments.step
    monkeypatch.setattr(decode_batch_mod.BatchArguments, "step", lambda self, *a: calls.append(1) or real(self, *a))
    g = torch.Generator().manual_seed(5)
    with _sessions("topo", torch.float32) as (batched, twin):
        for _ in range(2 * PAGE):
            q, k, v = (torch.randn(len(LENGTHS), h, 1, 2 * D, generator=g)[..., ::2] for h in (HQ, HKV, HKV))
            assert q.stride(-1) == 2
            assert torch.equal(batched.attend("l", q, k, v, None, SCALE), twin.attend("l", q, k, v, None, SCALE))
        assert batched.layers["l"].decode_batch is not None and not calls
        _assert_same_store(batched, twin)
