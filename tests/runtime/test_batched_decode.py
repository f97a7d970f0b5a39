"""A session's decode step over a batch is one batched decode call per layer (``attend`` with one
token per row, and ``attend_sequences`` for a serving caller's list of sequence ids), and it
computes what each sequence computes on its own: the same outputs as a twin session that
decodes the sequences one at a time (``attend_sequence``) and as the torch reference partials
over the stored segments, and the same store afterwards. Sequences of different lengths: one
with Mid pages, two without; policies whose Mid the C kernel reads (topo, projected or not;
KIVI) and one it does not (Palu's float coefficients)."""

from __future__ import annotations

import pytest
import torch

import kvtopo
from kvtopo.kernels.compressed_attention import merge_partials, partial_dense
from kvtopo.runtime import session as session_mod
from kvtopo.runtime.session import _history_partials

HQ, HKV, D = 8, 2, 32
SCALE = D**-0.5
LENGTHS = (300, 20, 5)
STEPS = 3
POLICIES = {
    "topo": dict(target_ratio=4.0),
    "topo-projected": dict(target_ratio=None, key_energy=0.9, value_energy=0.9),
    "kivi": dict(policy="kivi", target_ratio=None),
    "palu": dict(policy="palu", target_ratio=None),
}


def _config(name):
    return kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, **POLICIES[name])


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    longest = max(LENGTHS)
    prompt = [torch.randn(len(LENGTHS), h, longest, D, generator=g) for h in (HQ, HKV, HKV)]
    prompt[1] = prompt[1] @ torch.randn(D, D, generator=g) * 0.3 + 1.0  # keys with structure and offset
    steps = [[torch.randn(len(LENGTHS), h, 1, D, generator=g) for h in (HQ, HKV, HKV)] for _ in range(STEPS)]
    return prompt, steps


def _spy(monkeypatch):
    """Records the number of sequences of every batched decode call the session makes (by a
    layer's DecodeBatch, or by the per-sequence path)."""
    sizes = []
    real, real_step = session_mod.attend_cache_batch, session_mod.decode_step

    def spy(cache, seqs, *args, **kwargs):
        sizes.append(len(seqs))
        return real(cache, seqs, *args, **kwargs)

    def spy_step(cache, seqs, *args):
        out = real_step(cache, seqs, *args)
        if out is not None:
            sizes.append(len(seqs))
        return out

    monkeypatch.setattr(session_mod, "attend_cache_batch", spy)
    monkeypatch.setattr(session_mod, "decode_step", spy_step)
    return sizes


def _reference_step(cache, seq, q, k, v, softcap):
    """The torch reference of a decode step over the stored segments (no decode kernel)."""
    parts = _history_partials(q, cache.segments(seq), SCALE, softcap)
    return merge_partials(parts + [partial_dense(q, k, v, SCALE, softcap=softcap)])


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("name", POLICIES)
def test_batched_attend_equals_sequences_one_by_one(name, softcap, monkeypatch):
    prompt, steps = _data()
    longest = max(LENGTHS)
    valid = torch.stack([torch.arange(longest) >= longest - n for n in LENGTHS])  # left padding
    sizes = _spy(monkeypatch)
    with kvtopo.session(_config(name)) as batched, kvtopo.session(_config(name)) as alone:
        with batched.step(valid):
            batched.attend("l", *prompt, None, SCALE, softcap=softcap)
        for b, n in enumerate(LENGTHS):
            alone.attend_sequence("l", b, *(x[b, :, longest - n:] for x in prompt), SCALE, softcap=softcap)
        cache = batched.layers["l"]
        assert cache.sequences[0].mid is not None and cache.sequences[0].mid.tokens
        assert all(cache.sequences[b].mid is None or not cache.sequences[b].mid.tokens for b in (1, 2))
        sizes.clear()
        for q, k, v in steps:
            refs = [_reference_step(cache, b, q[b], k[b], v[b], softcap) for b in range(len(LENGTHS))]
            out = batched.attend("l", q, k, v, None, SCALE, softcap=softcap)
            ones = [alone.attend_sequence("l", b, q[b], k[b], v[b], SCALE, softcap=softcap)
                    for b in range(len(LENGTHS))]
            for b in range(len(LENGTHS)):
                torch.testing.assert_close(out[b], ones[b], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(out[b], refs[b], rtol=1e-4, atol=1e-5 * refs[b].abs().max().item())
        # per step: one call for the batch, then the twin's one call per sequence
        assert sizes == ([len(LENGTHS)] + [1] * len(LENGTHS)) * STEPS
        assert batched.stats().per_kind == alone.stats().per_kind
        assert batched.stats().tokens == tuple(n + STEPS for n in LENGTHS)


def test_attend_sequences_batches_decode_rows_and_attends_new_ones_alone(monkeypatch):
    prompt, steps = _data(seed=1)
    longest = max(LENGTHS)
    ids = [7, 3, 11]  # a serving engine's own sequence ids
    sizes = _spy(monkeypatch)
    with kvtopo.session(_config("topo")) as batched, kvtopo.session(_config("topo")) as alone:
        for s in (batched, alone):
            for b, n in zip(ids[:2], LENGTHS):  # sequence 11 has no history yet
                s.attend_sequence("l", b, *(x[ids.index(b), :, longest - n:] for x in prompt), SCALE)
        sizes.clear()
        for q, k, v in steps:
            out = batched.attend_sequences("l", ids, q, k, v, SCALE)
            for i, seq in enumerate(ids):
                one = alone.attend_sequence("l", seq, q[i], k[i], v[i], SCALE)
                torch.testing.assert_close(out[i], one, rtol=1e-5, atol=1e-6)
        # first step: 7 and 3 in one call, 11 (no history) through the reference; then all three
        # (the twin: one call per sequence with a history)
        assert sizes == [2, 1, 1] + [3, 1, 1, 1] * (STEPS - 1)
        assert batched.stats().per_kind == alone.stats().per_kind
        with pytest.raises(ValueError, match="distinct sequence"):
            batched.attend_sequences("l", [7, 7, 3], *steps[0], SCALE)


@pytest.mark.parametrize("name", ["topo", "kivi"])
def test_a_row_of_padding_only_is_skipped(name):
    """A decode step whose row b is all padding attends nothing for it and stores nothing: its
    output is zero (as a lossless session's), the other rows are the twin's, and b's history is
    unchanged, compressed or not."""
    prompt, steps = _data(seed=2)
    q, k, v = steps[0]
    with kvtopo.session(_config(name)) as padded, kvtopo.session(_config(name)) as twin:
        for s in (padded, twin):
            s.attend("l", *prompt, None, SCALE)
        assert padded.layers["l"].sequences[1].mid.tokens  # row 1's history is compressed
        before = padded.stats().tokens
        valid = torch.tensor([[True], [False], [True]])
        with padded.step(valid):
            out = padded.attend("l", q, k, v, None, SCALE)
        expected = twin.attend("l", q, k, v, None, SCALE)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        for b in (0, 2):
            torch.testing.assert_close(out[b], expected[b], rtol=1e-5, atol=1e-6)
        assert padded.stats().tokens == (before[0] + 1, before[1], before[2] + 1)
