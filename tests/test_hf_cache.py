"""HF `model.generate` on a kvtopo-compiled model through the tensor-free SessionCache adapter."""

import copy
import threading

import pytest
import torch

import kvtopo
import kvtopo.backend
from kvtopo.hf_cache import SessionCache
from kvtopo.models import zoo

PROMPT, STEPS = 40, 16
GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


def _prompt(batch=1, length=PROMPT, seed=1):
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple, set)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def test_hf_generate_matches_uncompiled_model_with_few_compiles():
    ids = _prompt()
    with torch.no_grad():
        expected = zoo.build("llama").generate(ids, max_new_tokens=STEPS, **GREEDY)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    compiles_before = len(kvtopo.backend.REPORTS)

    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        cache = SessionCache(s)
        out = model.generate(ids, max_new_tokens=STEPS, cache=cache, **GREEDY)
        stats = s.stats()

    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(expected.logits, 1), atol=1e-4, rtol=0)
    assert stats.tokens == (PROMPT + STEPS - 1,)
    assert len(stats.per_layer) == zoo.num_attention_layers(model)
    # One graph for the prefill shape, one for decode (T=1): not one per step.
    first_run = len(kvtopo.backend.REPORTS) - compiles_before
    assert first_run == 2, first_run

    # The adapter holds no tensors: only the session (which owns the store) and bookkeeping.
    assert cache.layers == []
    assert cache.session is s
    assert not any(_holds_tensor(v) for k, v in vars(cache).items() if k != "session"), vars(cache)

    # A second generate in a fresh session, with a fresh adapter, reuses the compiled graphs.
    with kvtopo.session(kvtopo.Config.lossless()) as s2, torch.no_grad():
        again = model.generate(ids, max_new_tokens=STEPS, cache=SessionCache(s2), **GREEDY)
    assert torch.equal(again.sequences, expected.sequences)
    assert len(kvtopo.backend.REPORTS) - compiles_before == first_run


def test_generate_continues_the_session_history():
    ids = _prompt(length=20, seed=3)
    with torch.no_grad():
        expected = zoo.build("llama").generate(ids, max_new_tokens=12, do_sample=False)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        cache = SessionCache(s)
        first = model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache)
        second = model.generate(first, max_new_tokens=6, do_sample=False, cache=cache)
        assert s.stats().tokens == (20 + 12 - 1,)
    assert torch.equal(second, expected)


def test_left_padded_batch_through_the_helper_matches_hf():
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (17, 40, 29)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    kwargs = dict(max_new_tokens=8, pad_token_id=0, **GREEDY)
    with torch.no_grad():
        expected = zoo.build("llama").generate(ids, attention_mask=mask, **kwargs)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        out = kvtopo.hf_cache.generate(model, ids, attention_mask=mask, **kwargs)
        assert s.stats().tokens == tuple(len(p) + 8 - 1 for p in prompts)
    assert "prepare_inputs_for_generation" not in vars(model)  # the helper's hook is removed again
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits, 1), torch.stack(expected.logits, 1), atol=1e-4, rtol=0)


def test_a_left_padded_batch_through_model_generate_names_the_helper():
    """`model.generate(..., cache=SessionCache(s))` cannot tell the session which tokens are padding:
    the session refuses the batch's mask, and the error says which call to use instead."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = _prompt(batch=2, length=20)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        with pytest.raises(ValueError, match=r"padded batch.*kvtopo.hf_cache.generate\(model, ids, attention_mask=mask\)"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, cache=SessionCache(s, model=model))


def test_a_left_padded_batch_continues_its_history_when_every_row_has_padding():
    """A second `generate` call on the first one's output (as for one sequence above), with every
    row left-padded: the session holds no padding, so the cache counts each row's padding columns
    for HF, which would otherwise feed a stored token again."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (19, 14)]
    width = 20  # wider than every prompt
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        expected = zoo.build("llama").generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, **GREEDY)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        first = kvtopo.hf_cache.generate(model, ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0, **GREEDY)
        wider = torch.cat([mask, torch.ones(len(prompts), 6, dtype=mask.dtype)], 1)
        second = kvtopo.hf_cache.generate(model, first.sequences, attention_mask=wider, max_new_tokens=6,
                                          pad_token_id=0, **GREEDY)
        assert s.stats().tokens == tuple(len(p) + 12 - 1 for p in prompts)
    assert torch.equal(second.sequences, expected.sequences)


def test_using_the_adapter_outside_its_session_raises():
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = _prompt(length=8)
    session = kvtopo.session(kvtopo.Config.lossless())
    cache = SessionCache(session)
    with pytest.raises(RuntimeError, match="session is not active"):
        model.generate(ids, max_new_tokens=2, cache=cache)
    with pytest.raises(RuntimeError, match="not active"):
        cache.get_seq_length()
    with session, kvtopo.session() as inner:  # another session is innermost
        with pytest.raises(RuntimeError, match="not the innermost"):
            cache.get_seq_length()
        assert SessionCache(inner).get_seq_length() == 0
    with session:  # active here, not in another thread (context variables are per thread)
        errors = []
        worker = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, cache.get_seq_length)))
        worker.start()
        worker.join()
        assert "not active in this thread" in str(errors[0].value)
    with pytest.raises(RuntimeError, match="active kvtopo session"):
        kvtopo.hf_cache.generate(model, ids, max_new_tokens=2)
    with pytest.raises(TypeError, match="kvtopo Session"):
        SessionCache(kvtopo.Config())


def test_uncompiled_model_and_beam_search_raise():
    ids = _prompt(length=8)
    with kvtopo.session() as s, torch.no_grad():
        with pytest.raises(RuntimeError, match="backend='kvtopo'"):
            zoo.build("llama").generate(ids, max_new_tokens=2, cache=SessionCache(s))
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session() as s, torch.no_grad():
        with pytest.raises(NotImplementedError, match="beam search"):
            model.generate(ids, max_new_tokens=2, num_beams=2, cache=SessionCache(s))


def test_a_models_own_cache_in_a_session_is_refused_naming_the_cache():
    """A DynamicCache from the first chunk fed back with the second: the graph's keys hold the
    cache's tensors, which the session cannot own; refused with the way out, nothing stored."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = _prompt(length=12)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        first = model(ids[:, :6])
        stored = s.stats().tokens
        with pytest.raises(kvtopo.backend.RefusedAttention, match="a cache passed in by the caller .*SessionCache"):
            model(ids[:, 6:], cache=first.past_key_values)
        assert s.stats().tokens == stored


def _greedy_recompute(model, ids, steps):
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@pytest.mark.parametrize("name,prompt,bare", [(name, prompt, False) for name in ("mistral-sw", "gemma3") for prompt in (7, 40)]
                         + [(name, 7, True) for name in ("mistral-sw", "gemma3")])
def test_windowed_models_keep_their_window_when_hf_builds_no_mask(name, prompt, bare):
    """Without padding HF builds no mask for a chunk no longer than the window (every decode step
    here), so the graph shows no window; the session applies the one the config declares, also
    when the model was compiled with the backend alone (`Module.compile(backend="kvtopo")`: the
    backend registers it). Before, a 7-token prompt attended over the whole history once past the
    window (logits off by up to 1.3) and a 40-token one raised a window mismatch."""
    model = zoo.build(name)
    ids = _prompt(length=prompt, seed=7)
    expected = _greedy_recompute(model, ids, 24)
    torch._dynamo.reset()
    compiled = zoo.build(name)
    if bare:
        compiled.compile(backend="kvtopo", options={"inductor": False})
    else:
        kvtopo.compile(compiled, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        got = compiled.generate(ids, max_new_tokens=24, do_sample=False, cache=SessionCache(s))
    assert torch.equal(got, expected)


def test_a_block_layer_called_with_no_mask_raises():
    """Llama-4's chunked layers: for a chunk without padding within one block HF may build no
    mask, leaving nothing to refuse at compile time; the session refuses the config's
    attention_chunk_size instead of attending across blocks later (its full layers run)."""
    import transformers

    from kvtopo.runtime import declared_attention

    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, attention_chunk_size=8,
        num_local_experts=1, no_rope_layers=[1, 0])
    model = transformers.Llama4ForCausalLM(config).eval()
    declared_attention.declare(model)
    key = next(model.parameters())
    q, kv = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match="within blocks of 8 tokens"):
            s.attend("model.layers.0.self_attn", q, kv, kv, None, 0.25, model_key=key)
        s.attend("model.layers.1.self_attn", q, kv, kv, None, 0.25, model_key=key)
        assert s.stats().tokens == (6,)


def test_a_batch_continued_after_re_padding_raises_instead_of_skipping_tokens():
    """New turns of different lengths, re-left-padded: the rows' stored tokens end at different
    columns, and HF feeds every row from one; before, a row silently lost its first new tokens."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (9, 20)]
    ids = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, 20 - len(p):], mask[row, 20 - len(p):] = p, 1
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        first = kvtopo.hf_cache.generate(model, ids, attention_mask=mask, max_new_tokens=5, pad_token_id=0)
        rows = [torch.cat([first[0, 11:], torch.full((3,), 7)]), torch.cat([first[1], torch.full((6,), 7)])]
        width = max(len(r) for r in rows)
        again, again_mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
        for row, r in enumerate(rows):
            again[row, width - len(r):], again_mask[row, width - len(r):] = r, 1
        stored = s.stats().tokens
        with pytest.raises(ValueError, match="HF generate feeds every row from one column"):
            kvtopo.hf_cache.generate(model, again, attention_mask=again_mask, max_new_tokens=2, pad_token_id=0)
        assert s.stats().tokens == stored


def test_two_models_in_one_session_each_read_their_own_length():
    """Each SessionCache reports its model's stored length (`model=`); before, the second model's
    fresh prompt was cut at the first model's length. Without `model=` a session holding two
    models' stores raises."""
    prompts = {"llama": _prompt(length=20, seed=1), "qwen2": _prompt(length=26, seed=2)}
    with torch.no_grad():
        expected = {n: zoo.build(n).generate(ids, max_new_tokens=8, do_sample=False) for n, ids in prompts.items()}
    models = {n: kvtopo.compile(zoo.build(n), inductor=False) for n in prompts}
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        for name, ids in prompts.items():
            got = models[name].generate(ids, max_new_tokens=8, do_sample=False, cache=SessionCache(s, model=models[name]))
            assert torch.equal(got, expected[name])
        with pytest.raises(ValueError, match="stores of 2 models"):
            SessionCache(s).get_seq_length()


def test_a_prompt_that_does_not_continue_the_stored_ids_raises():
    """HF generate takes a prompt's first `get_seq_length()` columns as stored: an unrelated prompt
    would be cut there and attend over the earlier conversation. `hf_cache.generate` records the
    ids it fed and checks the next prompt starts with them; the whole history plus a turn passes."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids, other = _prompt(length=20, seed=3), _prompt(length=30, seed=4)
    with torch.no_grad():
        expected = zoo.build("llama").generate(torch.cat([ids, ids[:, :5]], 1), max_new_tokens=4, do_sample=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        first = kvtopo.hf_cache.generate(model, ids[:, :12], max_new_tokens=3, do_sample=False)
        with pytest.raises(ValueError, match="the prompt does not start with them"):
            kvtopo.hf_cache.generate(model, other, max_new_tokens=3, do_sample=False)
        assert s.stats().tokens == (14,)  # nothing was fed by the refused call
        s.clear()
        kvtopo.hf_cache.generate(model, ids, max_new_tokens=1, do_sample=False)
        continued = kvtopo.hf_cache.generate(model, torch.cat([ids, ids[:, :5]], 1), max_new_tokens=4, do_sample=False)
    assert first.shape == (1, 15)
    assert torch.equal(continued, expected)


def test_hf_generate_on_a_compiled_model_checks_its_prompt_too():
    """`model.generate(..., cache=SessionCache(s))` called directly on a kvtopo.compile'd model is
    checked as `hf_cache.generate` is: the full history plus a turn continues, an unrelated prompt
    raises and stores nothing. A deep copy's check is its own."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids, other = _prompt(length=20, seed=3), _prompt(length=30, seed=4)
    with torch.no_grad():
        expected = zoo.build("llama").generate(ids, max_new_tokens=8, do_sample=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        cache = SessionCache(s, model=model)
        first = model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
        with pytest.raises(ValueError, match="the prompt does not start with them"):
            model.generate(other, max_new_tokens=4, do_sample=False, cache=cache)
        assert s.stats().tokens == (23,)
        second = model.generate(first, max_new_tokens=4, do_sample=False, cache=cache)
    assert torch.equal(second, expected)
    assert copy.deepcopy(model).generate.__self__ is not model


def test_the_prompt_check_follows_what_kvtopo_generate_stored_last():
    """After an HF generate of text A, `kvtopo.generate` of text B (same lengths) replaces what the
    stores hold: continuing A must be refused (it would attend over B), continuing B must pass and
    equal the uncompiled model."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    a, b, turn = _prompt(length=20, seed=1), _prompt(length=20, seed=2), _prompt(length=2, seed=3)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        held_a = model.generate(a, max_new_tokens=5, do_sample=False, cache=SessionCache(s, model=model))
        held_b = kvtopo.generate(model, b, max_new_tokens=5)
        assert held_a.shape == held_b.shape
        with pytest.raises(ValueError, match="the prompt does not start with them"):
            model.generate(torch.cat([held_a, turn], 1), max_new_tokens=3, do_sample=False,
                           cache=SessionCache(s, model=model))
        continued = model.generate(torch.cat([held_b, turn], 1), max_new_tokens=3, do_sample=False,
                                   cache=SessionCache(s, model=model))
    with torch.no_grad():
        expected = zoo.build("llama").generate(torch.cat([held_b, turn], 1), max_new_tokens=3, do_sample=False)
    assert torch.equal(continued, expected)


def test_generate_on_the_wrapper_torch_compile_returns_names_the_in_place_compile():
    """HF generate calls the module itself, not the wrapper `torch.compile(model)` returns: the
    SessionCache sees an eager forward and says how to compile instead."""
    wrapper = torch.compile(zoo.build("llama"), backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as session:
        with pytest.raises(RuntimeError, match=r"compile it in place \(kvtopo.compile\(model\)"):
            kvtopo.hf_cache.generate(wrapper, _prompt(), max_new_tokens=3, do_sample=False)
        assert session.stats().tokens == ()


@pytest.mark.parametrize("ids,mask,message", [
    (torch.ones(1, 6, dtype=torch.long), torch.full((1, 6), 0.5), "attention_mask is a torch.float32 tensor"),
    (torch.ones(1, 6, dtype=torch.long), torch.ones(1, 5, dtype=torch.long), "attention_mask shape"),
    (torch.ones(6, dtype=torch.long), None, "input_ids is a torch.int64 tensor of shape \\(6,\\)"),
    (torch.ones(1, 6), None, "input_ids is a torch.float32 tensor"),
])
def test_the_helper_checks_ids_and_mask_before_anything_is_stored(ids, mask, message):
    """As kvtopo.generate does (before, a float mask stored the prompt and failed with a message about
    positions; a short one failed deep in Dynamo)."""
    from kvtopo.models import zoo

    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match=f"kvtopo.hf_cache.generate: {message}"):
            kvtopo.hf_cache.generate(model, ids, attention_mask=mask, max_new_tokens=2)
        assert s.stats().tokens == ()


def test_a_batch_whose_second_row_does_not_continue_its_stored_ids_raises():
    """Every row is checked: row 0 continues its stored text, row 1's prompt is another text, which
    HF generate would cut at the stored length and continue row 1's earlier conversation."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids, other = _prompt(batch=2, length=20, seed=3), _prompt(batch=2, length=20, seed=4)
    with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
        first = kvtopo.hf_cache.generate(model, ids[:, :12], max_new_tokens=3, do_sample=False)
        history = torch.cat([first, ids[:, 15:]], 1)  # each row's stored ids plus a turn
        with pytest.raises(ValueError, match="the prompt does not start with them"):
            kvtopo.hf_cache.generate(model, torch.cat([history[:1], other[1:]]), max_new_tokens=3, do_sample=False)
        assert s.stats().tokens == (14, 14)  # nothing was fed by the refused call
        continued = kvtopo.hf_cache.generate(model, history, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        expected = zoo.build("llama").generate(history, max_new_tokens=3, do_sample=False)
    assert torch.equal(continued, expected)
