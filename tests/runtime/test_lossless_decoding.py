"""Lossless sessions reproduce the uncompiled model's HF generate exactly, on every zoo model."""

import sys
from pathlib import Path

import pytest
import torch

import kvtopo
from kvtopo.models import zoo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from left_padding import left_padded  # noqa: E402

MODELS = [n for n in zoo.ZOO_MODELS if n != "llama-8layer"]
PROMPT, STEPS = 200, 64


def _hf_generate(model, ids, steps):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("name", MODELS)
def test_lossless_generate_matches_hf_generate(name):
    model = zoo.build(name)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    expected_tokens, expected_logits = _hf_generate(model, ids, STEPS)
    layers = {site.layer for site in kvtopo.inspect(model, ids[:, :4], use_cache=False).sites}
    assert len(layers) == zoo.num_attention_layers(model)
    compiled = kvtopo.compile(model, inductor=False)
    for chunk in (512, 64):  # one-shot prefill, then chunked prefill
        with kvtopo.session(kvtopo.Config.lossless(prefill_chunk_size=chunk)) as s:
            tokens, logits = kvtopo.generate(compiled, ids, STEPS, return_logits=True)
            stats = s.stats()
        assert torch.equal(tokens, expected_tokens), f"chunk={chunk}"
        torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)
        assert stats.tokens == (PROMPT + STEPS - 1,)
        assert {name.split('/', 1)[1] for name in stats.per_layer} == layers  # stored as '<model>/<layer>'


@pytest.mark.parametrize("name", ["llama", "qwen3-moe", "gpt2"])
def test_batch_of_different_lengths_equals_one_at_a_time(name):
    model = zoo.build(name)
    compiled = kvtopo.compile(model, inductor=False)
    ids, mask, prompts = left_padded((37, 90, 64), seed=2)
    config = kvtopo.Config.lossless(prefill_chunk_size=32)
    with kvtopo.session(config) as s:
        batched, batched_logits = kvtopo.generate(compiled, ids, 20, attention_mask=mask, return_logits=True)
        assert s.stats().tokens == tuple(len(p) + 19 for p in prompts)
    for row, p in enumerate(prompts):
        single, single_logits = kvtopo.generate(compiled, p[None], 20, config=config, return_logits=True)
        assert torch.equal(batched[row, ids.shape[1]:], single[0, len(p):])
        torch.testing.assert_close(batched_logits[row], single_logits[0], atol=1e-4, rtol=0)


def test_sampling_is_reproducible_with_a_generator():
    compiled = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = torch.randint(0, 256, (1, 30))
    runs = [kvtopo.generate(compiled, ids, 12, do_sample=True, top_k=20, top_p=0.9,
                            generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_generate_on_an_uncompiled_model_says_so():
    with pytest.raises(RuntimeError, match="backend='kvtopo'"):
        kvtopo.generate(zoo.build("llama"), torch.randint(0, 256, (1, 8)), 2)


def test_right_padding_is_rejected():
    compiled = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = torch.randint(0, 256, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        kvtopo.generate(compiled, ids, 2, attention_mask=mask)


def test_a_forward_that_runs_without_kvtopo_attention_raises():
    """When torch._dynamo gives up on the compiled model (here: its recompile limit, which every
    model compiled in a process shares, reached at the first decode step's new shape), the model
    runs eagerly over the new token alone. kvtopo.generate raises instead of decoding without the
    history."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            compiled = kvtopo.compile(zoo.build("llama"), inductor=False)
            ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
            with kvtopo.session(kvtopo.Config.lossless()) as s:
                with pytest.raises(RuntimeError, match="ran no kvtopo attention.*recompile_limit"):
                    kvtopo.generate(compiled, ids, 10)
                assert s.calls > 0  # the prefill ran through the session
    finally:
        torch._dynamo.reset()


def test_two_models_sharing_their_embeddings_keep_their_own_stores():
    """A draft model that reuses its target's embedding table (as speculative decoding does): a
    session tells the models apart by a parameter of theirs that no embedding op reads, so each
    attends over its own history and equals its uncompiled self."""
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    target, draft = kvtopo.compile(zoo.build("llama", seed=0), inductor=False), kvtopo.compile(
        zoo.build("llama", seed=1), inductor=False)
    draft.model.embed_tokens = target.model.embed_tokens
    references = zoo.build("llama", seed=0), zoo.build("llama", seed=1)
    references[1].model.embed_tokens = references[0].model.embed_tokens
    with torch.no_grad():
        expected = [m(ids).logits for m in references]
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            got = [m(ids, use_cache=False).logits for m in (target, draft)]
            assert sorted({name.split("/")[0] for name in s.stats().per_layer}) == ["model0", "model1"]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
