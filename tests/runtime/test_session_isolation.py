"""Sequence isolation and recovery in a lossless session, checked against float64 attention by
hand:

* `attend_sequences` whose rows that read stored codes are not a prefix of the call (a new
  sequence first): each row attends over its own history;
* a layer's DecodeBatch made for sequences [0, 1] is not reused for another batch of the same
  size [2, 3];
* `clear()` after an error that left a chunk stored in part lets every sequence attend again;
* a serving caller's sequence id other than 0 gets its own `prompt_end` (its pages wait for it as
  in one forward of the whole prompt).
"""

import pytest
import torch

import kvtopo
from kvtopo.runtime.page_pool import PoolExhausted

HQ, HKV, D = 4, 2, 8
SCALE = D**-0.5


def _reference(q, keys, values):
    """float64 causal GQA attention of q [Hq, T, d] over keys/values [Hkv, N, d] whose last T are
    the queries' own tokens."""
    q, keys, values = (x.double() for x in (q, keys, values))
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    t, n = q.shape[1], keys.shape[1]
    logits = SCALE * q @ keys.transpose(1, 2)
    visible = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    return logits.softmax(-1) @ values


def _chunk(n, seed, batch=None):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda h: (h, n, D)) if batch is None else (lambda h: (batch, h, n, D))
    return [torch.randn(*shape(h), generator=g) for h in (HQ, HKV, HKV)]


def _close(out, ref):
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_attend_sequences_rows_that_read_codes_after_a_new_sequence():
    """Sequence 11 has no history and comes first; 7 and 3 read their stored histories (one
    batched decode call): every row must attend over its own history only."""
    histories = {7: _chunk(30, seed=1), 3: _chunk(13, seed=2)}
    ids = [11, 7, 3]
    held = {seq: (k, v) for seq, (_, k, v) in histories.items()}
    with kvtopo.session(kvtopo.Config.lossless(page_size=8)) as s:
        for seq, (q, k, v) in histories.items():
            s.attend_sequence("l", seq, q, k, v, SCALE)
        for step in range(3):
            q, k, v = _chunk(1, seed=10 + step, batch=len(ids))
            out = s.attend_sequences("l", ids, q, k, v, SCALE)
            for i, seq in enumerate(ids):
                pk, pv = held.get(seq, (k[i, :, :0], v[i, :, :0]))
                held[seq] = torch.cat([pk, k[i]], 1), torch.cat([pv, v[i]], 1)
                _close(out[i], _reference(q[i], *held[seq]))
        assert [s.layers["l"].length(seq) for seq in ids] == [3, 33, 16]


def test_a_decode_batch_is_not_reused_for_other_sequences_of_the_same_count():
    """Steps of [0, 1] twice (the layer makes its DecodeBatch), then [2, 3], then [0, 1] again:
    each step's rows attend over their own sequences' histories."""
    lengths = (20, 11, 27, 6)
    held = {}
    with kvtopo.session(kvtopo.Config.lossless(page_size=8)) as s:
        for seq, n in enumerate(lengths):
            q, k, v = _chunk(n, seed=seq)
            s.attend_sequence("l", seq, q, k, v, SCALE)
            held[seq] = (k, v)
        for step, ids in enumerate([[0, 1], [0, 1], [0, 1], [2, 3], [2, 3], [0, 1], [2, 3]]):
            q, k, v = _chunk(1, seed=100 + step, batch=2)
            out = s.attend_sequences("l", ids, q, k, v, SCALE)
            for i, seq in enumerate(ids):
                held[seq] = torch.cat([held[seq][0], k[i]], 1), torch.cat([held[seq][1], v[i]], 1)
                _close(out[i], _reference(q[i], *held[seq]))
        assert [s.layers["l"].length(seq) for seq in range(4)] == [24, 15, 30, 9]


def test_clear_after_a_chunk_stored_in_part_lets_every_sequence_attend_again():
    config = kvtopo.Config.lossless(page_size=8, max_pages=6)
    with kvtopo.session(config) as s:
        s.attend_sequence("l", 0, *_chunk(30, seed=0), SCALE)
        with pytest.raises(PoolExhausted):
            s.attend_sequence("l", 1, *_chunk(30, seed=1), SCALE)
        s.clear()
        q, k, v = _chunk(20, seed=2)
        out = s.attend_sequence("l", 1, q, k, v, SCALE)
        _close(out, _reference(q, k, v))
        assert (s.layers["l"].length(0), s.layers["l"].length(1)) == (0, 20)


def test_a_chunked_prompt_keeps_the_same_pages_whatever_its_sequence_id(monkeypatch):
    """A 160-token prompt fed in chunks of 40, each told the prompt ends at 160, keeps the same
    tokens per page as sequence 0 or as sequence 5 (a serving engine's id); told nothing, its
    pages move as chunks push them out of Recent and other tokens survive (so the test sees
    whether `prompt_end` reached the sequence)."""
    import kvtopo.runtime.policies.topo as topo

    monkeypatch.setattr(topo, "SUCCESSOR_WEIGHT", 0.0)
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32)
    q, k, v = _chunk(160, seed=3)

    def kept(seq, prompt_end):
        with kvtopo.session(config) as s:
            for start in range(0, 160, 40):
                part = slice(start, start + 40)
                s.attend_sequence("l", seq, q[:, part], k[:, part], v[:, part], SCALE, prompt_end=prompt_end)
            s.attend_sequence("l", seq, *_chunk(1, seed=4), SCALE)
            return [page.kept for page in s.layers["l"].stored_state(seq).pages]

    told = kept(0, 160)
    assert kept(0, 0) != told  # holding the pages for the prompt's end changes what is kept
    assert kept(5, 160) == told
    assert kept(1234, 160) == told
