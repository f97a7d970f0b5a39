"""kvtopo.generate of a left-padded batch under a compressing config: each row's store keeps what
the row generated alone keeps (its chunked prompt budgeted and held for its own real length, not
the batch's width), right after the prefill (one new token: no decode forward, which would rank
the pages again)."""

import kvtopo
from kvtopo.models import zoo
from left_padding import left_padded

CONFIG = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, prefill_chunk_size=32)
NEW = 1  # no decode forward: the store as the prefill left it


def _kept(session, seq):
    return {name: [page.kept for page in cache.stored_state(seq).pages] for name, cache in session.layers.items()}


def test_a_padded_compressed_batch_keeps_per_row_what_each_row_keeps_alone():
    compiled = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids, mask, prompts = left_padded((150, 70, 101), seed=2)
    with kvtopo.session(CONFIG) as s:
        kvtopo.generate(compiled, ids, NEW, attention_mask=mask, eos_token_id=None)
        assert s.stats().tokens == tuple(len(p) + NEW - 1 for p in prompts)
        batched = [_kept(s, row) for row in range(len(prompts))]
        assert any(k is not None and k < 16 for pages in batched[1].values() for k in pages)  # row 1 was compressed
    for row, p in enumerate(prompts):
        with kvtopo.session(CONFIG) as s:
            kvtopo.generate(compiled, p[None], NEW, eos_token_id=None)
            assert batched[row] == _kept(s, 0), row
