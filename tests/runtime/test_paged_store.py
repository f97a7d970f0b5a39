"""The exact paged store: pages, block tables, reuse, limits and isolation."""

import pytest
import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache as _LayerCache
from kvtopo.runtime.page_pool import PagePool, PoolExhausted
from kvtopo.runtime.policies import make_policy


def LayerCache(page_size, max_pages):
    config = kvtopo.Config.lossless(page_size=page_size, max_pages=max_pages)
    return _LayerCache(config, make_policy(config))


def history(cache, seq):
    return cache.segments(seq).exact


def _kv(n, heads=2, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, n, dim, generator=g), torch.randn(heads, n, dim, generator=g)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_history_returns_exactly_what_was_appended(page_size):
    cache = LayerCache(page_size, None)
    k1, v1 = _kv(5, seed=1)
    k2, v2 = _kv(9, seed=2)
    cache.append(0, k1, v1)
    cache.append(0, k2, v2)
    keys, values = history(cache, 0)
    assert torch.equal(keys, torch.cat([k1, k2], 1)) and torch.equal(values, torch.cat([v1, v2], 1))
    assert len(cache.sequences[0].pages) == -(-14 // page_size)
    assert len(cache.sequences[0].block_table) == len(cache.sequences[0].pages)
    assert cache.sequences[0].block_table.dtype == torch.int32


def test_sequences_never_see_each_others_pages():
    cache = LayerCache(4, None)
    for step in range(3):  # interleaved appends share the pool
        for seq in range(3):
            k, v = _kv(3, seed=10 * seq + step)
            cache.append(seq, k + 100 * seq, v + 100 * seq)
    for seq in range(3):
        keys, _ = history(cache, seq)
        expected = torch.cat([_kv(3, seed=10 * seq + s)[0] + 100 * seq for s in range(3)], 1)
        assert torch.equal(keys, expected)
    pages = [set(cache.sequences[s].block_table.tolist()) for s in range(3)]
    assert not (pages[0] & pages[1] or pages[1] & pages[2] or pages[0] & pages[2])


def test_released_pages_are_reused_before_the_pool_grows():
    cache = LayerCache(2, None)
    cache.append(0, *_kv(10))
    capacity = cache.pool.capacity
    cache.release(0)
    cache.append(1, *_kv(10, seed=3))
    assert cache.pool.capacity == capacity
    assert cache.pool.live_pages == 5


def test_full_pool_raises_and_never_overwrites_live_pages():
    cache = LayerCache(2, max_pages=3)
    k, v = _kv(6)
    cache.append(0, k, v)
    with pytest.raises(PoolExhausted, match="max_pages=3"):
        cache.append(1, *_kv(1, seed=4))
    keys, values = history(cache, 0)
    assert torch.equal(keys, k) and torch.equal(values, v)


def _sequence_chunk(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, n, 16, generator=g), torch.randn(2, n, 16, generator=g), torch.randn(2, n, 16, generator=g)


def test_a_sequence_a_full_pool_stopped_raises_until_released_and_the_others_stay_whole():
    """The failed chunk is stored in part (two of its pages fit): its sequence refuses to go on,
    so no later write can land in a page the pool never gave it, and no retry stores it twice."""
    config = kvtopo.Config.lossless(page_size=8, max_pages=6)
    first, second = _sequence_chunk(30, seed=0), _sequence_chunk(30, seed=1)
    with kvtopo.session(config) as session:
        session.attend_sequence("layer", 0, *first, 0.25)
        cache = session.layers["layer"]
        live = cache.pool.keys[[page.slot for page in cache.sequences[0].pages]].clone()
        with pytest.raises(PoolExhausted, match="max_pages=6"):
            session.attend_sequence("layer", 1, *second, 0.25)
        for _ in range(2):
            with pytest.raises(RuntimeError, match=r"sequence\(s\) \[1\] hold a chunk stored in part.*PoolExhausted"):
                session.attend_sequence("layer", 1, *_sequence_chunk(1, seed=2), 0.25)
        # Bitwise: the last page's unwritten slots hold whatever the pool's memory held (NaN patterns too).
        kept = cache.pool.keys[[page.slot for page in cache.sequences[0].pages]]
        assert torch.equal(kept.view(torch.uint8), live.view(torch.uint8))
        step = _sequence_chunk(1, seed=3)
        after = session.attend_sequence("layer", 0, *step, 0.25)
        session.release(1)
        again = session.attend_sequence("layer", 1, *_sequence_chunk(8, seed=4), 0.25)
    with kvtopo.session(config) as alone:
        alone.attend_sequence("layer", 0, *first, 0.25)
        assert torch.equal(after, alone.attend_sequence("layer", 0, *step, 0.25))
    assert again.shape == (4, 8, 16) and torch.isfinite(again).all()


def test_a_full_pool_in_a_padded_batch_stops_every_row_of_the_call():
    """A batch with padding stores its rows apart: the full row went in before the padded row hit
    the full pool (and the model's next layer never ran), so the full row is unfinished too; before,
    it went on after the padded row's release, its layers holding different histories."""
    config = kvtopo.Config.lossless(page_size=4, sink_tokens=0, recent_tokens=0, max_pages=3)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, :2] = False
    with kvtopo.session(config) as session:
        with pytest.raises(PoolExhausted), session.step(valid):
            for layer in ("a", "b"):
                session.attend(layer, q, k, v, None, 0.35)
        assert session.layers["a"].length(0) == 8 and "b" not in session.layers  # row 0 stored in layer a only
        session.release(1)
        with pytest.raises(RuntimeError, match=r"sequence\(s\) \[0\] hold a chunk stored in part"), \
                session.step(torch.tensor([[True], [False]])):
            session.attend("a", q[:, :, :1], k[:, :, :1], v[:, :, :1], None, 0.35)
        assert session.layers["a"].length(0) == 8  # refused before anything was stored


def test_double_release_is_an_error():
    pool = PagePool(1, 2, 2, 2, torch.float32, torch.device("cpu"))
    page = pool.allocate()
    pool.release(page)
    with pytest.raises(ValueError, match="not live"):
        pool.release(page)


def test_mismatched_kv_shapes_are_refused():
    cache = LayerCache(4, None)
    cache.append(0, *_kv(2))
    with pytest.raises(ValueError, match="do not match"):
        cache.append(0, *_kv(2, heads=3))


def test_nbytes_are_the_held_tensors():
    cache = LayerCache(4, None)
    cache.observe(0, torch.randn(4, 3, 4), 2)
    cache.append(0, *_kv(6))
    kinds = cache.nbytes()
    live = kinds["initial"] + kinds["terminal"]
    assert live + kinds["free"] == cache.pool.keys.nbytes + cache.pool.values.nbytes
    assert cache.sequences[0].observation is None  # a policy that never evicts keeps no queries
    assert kinds["metadata"] == cache.sequences[0].block_table.nbytes
    assert live == 2 * 2 * 2 * 4 * 4 * 4  # 2 live pages x (k, v) x heads x page x dim x fp32 bytes


def test_mid_rows_grow_in_amortised_steps():
    """Appending N pages copies O(N) bytes: the Mid buffers grow by capacity, not by re-concatenating
    the history per page (which would copy O(N^2))."""
    from kvtopo.runtime.codecs import CodedRows

    coded = CodedRows(bits=4, per_row_stats=False, float_dtype=torch.float16)
    pages, rows_per_page, width = 400, 32, 64
    reallocations, copied, storage = 0, 0, None
    expected = []
    for i in range(pages):
        page = torch.randn(rows_per_page, width, generator=torch.Generator().manual_seed(i))
        expected.append(page)
        held_before = coded.rows.nbytes if coded.rows is not None else 0
        coded.append(page)
        now = coded.rows.untyped_storage().data_ptr()
        if now != storage:
            reallocations, copied, storage = reallocations + 1, copied + held_before, now
    total = coded.rows.nbytes
    assert coded.count == pages * rows_per_page and coded.page_rows.tolist() == [rows_per_page] * pages
    assert copied <= 10 * total, (copied, total)  # re-concatenation would copy ~pages / 2 = 200x
    assert reallocations <= 60, reallocations
    # The rows read back are the pages appended, in order (4-bit codes: within one step per value).
    decoded, original = coded.decode(), torch.cat(expected)
    step = (original.amax(0) - original.amin(0)) / 15
    assert ((decoded - original).abs() <= step / 2 + 1e-2).all()


@pytest.mark.parametrize("fields, window", [({}, None), ({"target_ratio": 3.0}, None), ({}, 40)])
def test_block_table_is_the_slotted_pages_after_every_change(fields, window):
    """The block table (built when read after a change) lists the pool slots of the pages that
    hold one, in page order, after prefill chunks, decode steps, page moves and a window's drops;
    reading it at every step and reading it only at the end agree."""
    config = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, **fields)
    caches = [_LayerCache(config, make_policy(config), window=window) for _ in range(2)]
    for cache in caches:
        cache.scale = 0.5
    g = torch.Generator().manual_seed(0)
    for n in (50, 1, 1, 30, 7, *[1] * 12, 64):
        k, v = torch.randn(2, n, 4, generator=g), torch.randn(2, n, 4, generator=g)
        for cache in caches:
            cache.observe(0, torch.randn(4, min(n, 4), 4, generator=torch.Generator().manual_seed(n)), 2)
            cache.append(0, k, v)
        entry = caches[0].sequences[0]
        assert entry.block_table.tolist() == [p.slot for p in entry.pages if p.slot is not None]
    assert torch.equal(caches[1].sequences[0].block_table, caches[0].sequences[0].block_table)
    assert any(p.slot is None for p in caches[0].sequences[0].pages)  # pages did leave the pool


def test_sequence_ids_are_ints_of_any_kind_and_nothing_else():
    """A numpy or 0-d tensor id names the same sequence as the int (a tensor key had started a
    sequence no int reached, and releasing by the int freed nothing); other ids are refused."""
    import numpy as np

    config = kvtopo.Config.lossless(page_size=8)
    with kvtopo.session(config) as session:
        session.attend_sequence("layer", torch.tensor(3), *_sequence_chunk(10, seed=0), 0.25)
        session.attend_sequences("layer", [np.int64(3)], *(t[None] for t in _sequence_chunk(1, seed=1)), 0.25)
        assert list(session.layers["layer"].sequences) == [3]
        assert session.sequence_stats(np.int32(3)).tokens == 11
        live = session.layers["layer"].pool.live_pages
        for bad in ("3", 3.0, True, None):
            with pytest.raises(TypeError, match="a sequence id is an int"):
                session.release(bad)
        assert session.layers["layer"].pool.live_pages == live == 2
        session.release(np.int64(3))
        assert session.layers["layer"].pool.live_pages == 0 and not session.layers["layer"].sequences
        session.release(7)  # never held: nothing to free
