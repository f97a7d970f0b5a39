"""The pages one append moves are encoded together at its end (LayerCache._flush); the store
must hold exactly what encoding them page by page gives: same kept tokens, codes, statistics
and bytes."""

import pytest
import torch

import kvtopo
from kvtopo.runtime import codecs, layer_cache
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import make_policy


def _run(fields: dict, chunks: list[int], shared: int | None, wide: bool) -> LayerCache:
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, **fields)
    cache = LayerCache(config, make_policy(config), shared_value_dim=shared)
    cache.scale = 0.25
    g = torch.Generator().manual_seed(0)
    for n in chunks:
        k = torch.randn(2, n, 16, generator=g) * 3
        v = torch.randn(2, n, 16, generator=g)
        if wide:  # some pages' statistics need float32: those pages are encoded on their own
            k[:, ::97, 3] *= 40000.0
            v[:, ::89, 5] = 70000.0
        cache.observe(0, torch.randn(4, min(n, 8), 16, generator=g), 2)
        cache.append(0, k, v[..., :0] if shared else v)
    return cache


def _state(cache: LayerCache) -> list:
    entry = cache.sequences[0]
    out = [cache.nbytes(), cache.pool.capacity, entry.block_table, entry.mid_tokens]
    for page in entry.pages:
        out += [page.phase, page.tokens, page.kept, page.slot]
        if page.recent is not None:
            out += [q and (q.codes, q.scale, q.offset) for q in (page.recent.keys, page.recent.values)]
    for mid in cache._epochs(entry):
        out += [(c.rows, c.scale, c.offset, c.page_rows) for c in (mid.keys, mid.values)]
    return out


def _assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y)
        elif isinstance(x, (tuple, list)):
            _assert_same(x, y)
        else:
            assert x == y


FIELDS = [{}, {"mid_bits": 2, "recent_bits": 4}, {"mid_bits": None},
          {"key_energy": 0.9, "value_energy": 0.9, "refit_after": 128},
          {"protected_spans": ((200, 260),), "target_ratio": 3.0},
          {"eviction_scope": "page"}, {"target_ratio": None}]
# Projected Mid with values shared with the keys (MLA latents) is left out: projected pages
# enter Mid one by one in both paths (MidSegment.append_pages), and tests/passes/test_mla.py
# runs projected latents through the session.
CASES = [(fields, shared) for fields in FIELDS for shared in (None, 8) if not (shared and "key_energy" in fields)]


@pytest.mark.parametrize("fields, shared", CASES)
@pytest.mark.parametrize("wide", [False, True])
def test_one_appends_moves_encode_as_page_by_page(fields, wide, shared, monkeypatch):
    chunks = [700, 5, 1, 300, 64]
    batched = _state(_run(fields, chunks, shared, wide))
    # Without the batched encoders every page takes the page-by-page path.
    monkeypatch.setattr(layer_cache, "encode_recent_pages", lambda *a: None)
    monkeypatch.setattr(layer_cache, "decode_recent_pages", lambda pages: [page.decode() for page in pages])
    monkeypatch.setattr(codecs, "quantize_float16", lambda *a, **k: None)
    _assert_same(batched, _state(_run(fields, chunks, shared, wide)))


@pytest.mark.parametrize("shared", [False, True])
def test_recent_pages_decode_together_as_one_by_one(shared):
    """`decode_recent_pages` (the pages a joint plan ranks) gives each page's own decode, bit for
    bit, whether the pages agree on their statistics' dtype (one batch) or not (page by page)."""
    g = torch.Generator().manual_seed(1)
    pages = []
    for i in range(5):
        k, v = torch.randn(2, 16, 16, generator=g) * 3, torch.randn(2, 16, 16, generator=g)
        if i == 3:  # float32 statistics for this page
            k[:, 2, 3] = 90000.0
        pages.append(codecs.encode_recent(k, None if shared else v, 8))
    for group in (pages[:3], pages):
        together = codecs.decode_recent_pages([page for page in group])
        assert len(together) == len(group)
        for (keys, values), page in zip(together, group):
            want_keys, want_values = page.decode()
            assert torch.equal(keys, want_keys)
            assert (values is None) == shared and (shared or torch.equal(values, want_values))
