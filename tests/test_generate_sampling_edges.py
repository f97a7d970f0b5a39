"""Sampling edge cases of kvtopo.generate against HF `model.generate` (same weights, same seed):
a top_k larger than the vocabulary, the top-p boundary where the cumulative mass equals 1 - top_p
exactly, and a top_p so small that only HF's "keep at least one token" leaves anything to draw.

Uniform logits (a zeroed lm_head) make the boundary exact: every one of the 256 tokens has
probability 2**-8, so the ascending cumulative mass hits 0.5 exactly at the 128th token and
254/256 exactly at the 254th one."""

import pytest
import torch

import kvtopo
from kvtopo.models import zoo

PROMPT, STEPS = 12, 16
LOSSLESS = kvtopo.Config.lossless(prefill_chunk_size=16)


def _pair(uniform: bool):
    models = [zoo.build("llama"), zoo.build("llama")]
    if uniform:
        for m in models:
            with torch.no_grad():
                m.lm_head.weight.zero_()
    return models[0], kvtopo.compile(models[1], inductor=False)


def _ids(seed=3):
    return torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(seed))


def _both(ref, compiled, ids, seed=11, **sampling):
    torch.manual_seed(seed)
    with torch.no_grad():
        expected = ref.generate(ids, max_new_tokens=STEPS, do_sample=True, **sampling)
    torch.manual_seed(seed)
    got = kvtopo.generate(compiled, ids, STEPS, config=LOSSLESS, do_sample=True, eos_token_id=None, **sampling)
    return expected, got


def test_top_k_larger_than_the_vocabulary_keeps_every_token():
    """HF's TopKLogitsWarper clamps top_k to the vocabulary (256 here); so must kvtopo."""
    ref, compiled = _pair(uniform=False)
    expected, got = _both(ref, compiled, _ids(), top_k=1000, top_p=1.0, temperature=1.0)
    assert torch.equal(got, expected)


def test_top_p_keeps_exactly_the_tokens_hf_keeps_at_the_exact_boundary():
    """top_p=2/256 over 256 equally likely tokens: the ascending cumulative mass reaches
    1 - top_p = 254/256 exactly at the 254th token; HF drops every token whose mass is <= that,
    so it samples between 2 tokens (drawing among 3 gives the third a third of the time)."""
    ref, compiled = _pair(uniform=True)
    ids = _ids()
    for seed in (11, 12, 13):
        expected, got = _both(ref, compiled, ids, seed=seed, top_k=0, top_p=2 / 256, temperature=1.0)
        assert torch.equal(got, expected), seed
        assert len(set(got[0, PROMPT:].tolist())) <= 2


def test_a_tiny_top_p_still_keeps_one_token():
    """With top_p=1e-9 the whole (uniform) mass is <= 1 - top_p in float32; HF still keeps the
    top token, so sampling is deterministic and does not fail on an all -inf row."""
    ref, compiled = _pair(uniform=True)
    expected, got = _both(ref, compiled, _ids(), top_k=0, top_p=1e-9, temperature=1.0)
    assert torch.equal(got, expected)
    assert len(set(got[0, PROMPT:].tolist())) == 1  # one kept token, drawn every step
