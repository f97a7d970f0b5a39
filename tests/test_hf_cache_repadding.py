"""kvtopo.hf_cache.generate continuing a batch whose rows hold the SAME number of stored tokens
but whose new turns are re-left-padded differently: HF feeds every row from one column, so a
padded row would be fed stored tokens again (silently attending over them twice); it must raise
as when the stored lengths differ (tests/test_hf_cache.py covers only rows of different stored
lengths)."""

import pytest
import torch

import kvtopo
import kvtopo.hf_cache
from kvtopo.models import zoo


def test_equal_stored_lengths_with_different_padding_raise():
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 256, (2, 12), generator=gen)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        # The first turn by calling the model itself (no record of the ids: the prompt check cannot help)
        model(input_ids=ids, cache=kvtopo.hf_cache.SessionCache(s, model=model))
        assert s.stats().tokens == (12, 12)
        rows = [torch.cat([ids[0], torch.full((3,), 7)]), torch.cat([ids[1], torch.full((6,), 7)])]
        width = max(len(r) for r in rows)
        again, again_mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
        for row, r in enumerate(rows):
            again[row, width - len(r):], again_mask[row, width - len(r):] = r, 1
        with pytest.raises(ValueError, match="HF generate feeds every row from one column"):
            kvtopo.hf_cache.generate(model, again, attention_mask=again_mask, max_new_tokens=2, pad_token_id=0)
        assert s.stats().tokens == (12, 12)
