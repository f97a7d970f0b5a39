"""kvtopo.hf_cache: a prompt that is exactly what the session holds (no new token after it) is
refused before anything is fed. HF generate would take all of it as stored and have nothing new
to feed; tests/test_hf_cache.py checks prompts that do not start with the stored ids, and
prompts that continue them, not one that ends where they end."""

import pytest
import torch

import kvtopo
from kvtopo.models import zoo


def test_a_prompt_that_only_repeats_the_stored_ids_is_refused():
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        first = kvtopo.hf_cache.generate(model, ids, max_new_tokens=3, do_sample=False)
        stored = s.stats().tokens
        assert stored == (14,) and first.shape == (1, 15)  # the last generated token is never fed
        for prompt in (first[:, :14], first[:, :10]):  # exactly the stored ids; fewer than them
            with pytest.raises(ValueError, match="nothing beyond them to generate from"):
                kvtopo.hf_cache.generate(model, prompt, max_new_tokens=3, do_sample=False)
            with pytest.raises(ValueError, match="nothing beyond them to generate from"):
                model.generate(prompt, max_new_tokens=3, do_sample=False,
                               cache=kvtopo.hf_cache.SessionCache(s, model=model))
            assert s.stats().tokens == stored
        continued = kvtopo.hf_cache.generate(model, first, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        expected = zoo.build("llama").generate(first, max_new_tokens=3, do_sample=False)
    assert torch.equal(continued, expected)
