"""kvtopo.generate stops like HF `model.generate`: eos ids from the argument or the model's
generation config, pad ids after a sequence's eos, and an early end once every sequence is done.

Each case is compared with HF `generate` of the uncompiled model on the same prompt (the session
is lossless, so the tokens are the same): sequences, padding and output shape must be identical,
and the logits returned are those of the steps actually run.
"""

import pytest
import torch

import kvtopo
from kvtopo.models import zoo
from left_padding import left_padded

PROMPT, STEPS = 24, 24
LOSSLESS = kvtopo.Config.lossless(prefill_chunk_size=16)


@pytest.fixture
def models():
    """(uncompiled HF reference, the same weights compiled with the kvtopo backend)."""
    return zoo.build("llama"), kvtopo.compile(zoo.build("llama"), inductor=False)


def _set_generation_config(models, **fields):
    for model in models:
        for name, value in fields.items():
            setattr(model.generation_config, name, value)


def _hf(model, ids, mask=None, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)


def _kvtopo(model, ids, mask=None, **kwargs):
    tokens, logits = kvtopo.generate(model, ids, STEPS, config=LOSSLESS, attention_mask=mask,
                                     return_logits=True, **kwargs)
    assert logits.shape[:2] == (ids.shape[0], tokens.shape[1] - ids.shape[1])  # one per step run
    return tokens, logits


def _assert_same(hf, ours):
    assert ours[0].shape == hf[0].shape
    assert torch.equal(ours[0], hf[0]), f"\nHF     {hf[0].tolist()}\nkvtopo {ours[0].tolist()}"
    torch.testing.assert_close(ours[1], hf[1], atol=1e-4, rtol=0)


def _first_new_token(continuation: list[int], start: int) -> tuple[int, int]:
    """(token, index): the first token at `index >= start` that did not occur before `index`."""
    for i in range(start, len(continuation) - 1):
        if continuation[i] not in continuation[:i]:
            return continuation[i], i
    raise AssertionError(f"no new token after step {start} in {continuation}")


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _free_run(compiled, ids, mask=None) -> list[list[int]]:
    """Greedy continuation of each row without any eos."""
    out = kvtopo.generate(compiled, ids, STEPS, config=LOSSLESS, attention_mask=mask, eos_token_id=None)
    return out[:, ids.shape[1]:].tolist()


def test_single_prompt_stops_at_the_generation_config_eos(models):
    ref, compiled = models
    ids = _prompt(PROMPT, 1)
    free = _free_run(compiled, ids)[0]
    eos, stop = _first_new_token(free, STEPS // 3)
    _set_generation_config(models, eos_token_id=eos)

    expected = _hf(ref, ids)
    got = _kvtopo(compiled, ids)
    _assert_same(expected, got)
    assert got[0].shape == (1, PROMPT + stop + 1)  # shorter than max_new_tokens: stopped at the eos
    assert got[0][0, PROMPT:].tolist() == free[: stop + 1]

    # Passing eos_token_id=None overrides the generation config, in HF and here: no stop.
    _assert_same(_hf(ref, ids, eos_token_id=None), _kvtopo(compiled, ids, eos_token_id=None))
    assert kvtopo.generate(compiled, ids, STEPS, config=LOSSLESS, eos_token_id=None).shape == (1, PROMPT + STEPS)


def test_a_list_of_eos_stops_at_the_first_one_emitted(models):
    ref, compiled = models
    ids = _prompt(PROMPT, 1)
    free = _free_run(compiled, ids)[0]
    early, early_stop = _first_new_token(free, 2)
    late, late_stop = _first_new_token(free, early_stop + 1)
    eos = [late, early]  # the one listed first is emitted later

    # As an argument (the generation config has none) ...
    expected = _hf(ref, ids, eos_token_id=eos)
    _assert_same(expected, _kvtopo(compiled, ids, eos_token_id=eos))
    assert expected[0].shape == (1, PROMPT + early_stop + 1)
    # ... and from the generation config.
    _set_generation_config(models, eos_token_id=eos)
    _assert_same(expected, _kvtopo(compiled, ids))
    # A tuple works too, and the argument takes precedence over the generation config.
    _assert_same(_hf(ref, ids, eos_token_id=[late]), _kvtopo(compiled, ids, eos_token_id=(late,)))
    assert _kvtopo(compiled, ids, eos_token_id=(late,))[0].shape == (1, PROMPT + late_stop + 1)


def _eos_that_stops_row0_first(free: list[list[int]], start: int = 2) -> tuple[int, int]:
    """A token row 0 emits (first) after `start` that row 1 never emits: row 0 stops, row 1 runs on."""
    for i in range(start, STEPS - 2):
        token = free[0][i]
        if token not in free[0][:i] and token not in free[1]:
            return token, i
    raise AssertionError(f"no token stops row 0 only: {free}")


def test_batch_pads_the_row_that_stopped_and_runs_the_other_on(models):
    ref, compiled = models
    ids, mask, _ = left_padded((17, PROMPT), seed=5)
    free = _free_run(compiled, ids, mask)
    eos, stop = _eos_that_stops_row0_first(free)
    pad = next(t for t in range(256) if t != eos)
    _set_generation_config(models, eos_token_id=eos)

    # pad: the first eos (no pad id anywhere)
    expected = _hf(ref, ids, mask)
    got = _kvtopo(compiled, ids, mask)
    _assert_same(expected, got)
    assert got[0].shape == (2, PROMPT + STEPS)  # row 1 never stopped
    assert got[0][0, PROMPT + stop:].tolist() == [eos] * (STEPS - stop)
    assert got[0][1, PROMPT:].tolist() == free[1]

    # pad: the argument
    expected = _hf(ref, ids, mask, pad_token_id=pad)
    got = _kvtopo(compiled, ids, mask, pad_token_id=pad)
    _assert_same(expected, got)
    assert got[0][0, PROMPT:].tolist() == free[0][: stop + 1] + [pad] * (STEPS - stop - 1)

    # pad: the generation config's
    _set_generation_config(models, pad_token_id=pad)
    _assert_same(expected, _kvtopo(compiled, ids, mask))


def test_a_stopped_row_is_padded_with_the_first_listed_eos(models):
    """With a list of eos ids and no pad id HF pads with the list's first, here one neither row
    emits (not the one row 0 stopped on)."""
    ref, compiled = models
    ids, mask, _ = left_padded((17, PROMPT), seed=5)
    free = _free_run(compiled, ids, mask)
    eos, stop = _eos_that_stops_row0_first(free)
    first = next(t for t in range(256) if t not in free[0] and t not in free[1])

    expected = _hf(ref, ids, mask, eos_token_id=[first, eos])
    got = _kvtopo(compiled, ids, mask, eos_token_id=[first, eos])
    _assert_same(expected, got)
    assert got[0][0, PROMPT:].tolist() == free[0][: stop + 1] + [first] * (STEPS - stop - 1)


def test_batch_ends_early_when_every_row_has_stopped(models):
    ref, compiled = models
    ids, mask, _ = left_padded((17, PROMPT), seed=9)
    free = _free_run(compiled, ids, mask)
    eos0, stop0 = _eos_that_stops_row0_first(free, start=4)
    # Row 1 stops a few steps later, on a token row 0 did not emit before its own stop.
    eos1, stop1 = next((t, i) for i, t in enumerate(free[1][:-1])
                       if i >= stop0 + 3 and t not in free[1][:i] and t not in free[0][: stop0 + 1])
    eos = [eos0, eos1]
    _set_generation_config(models, eos_token_id=eos, pad_token_id=3)

    expected = _hf(ref, ids, mask)
    got = _kvtopo(compiled, ids, mask)
    _assert_same(expected, got)
    assert got[0].shape == (2, PROMPT + stop1 + 1)  # the loop ended with the last row's eos
    assert got[0][0, PROMPT:].tolist() == free[0][: stop0 + 1] + [3] * (stop1 - stop0)
    assert got[0][1, -1].item() == eos1


def test_sampling_follows_the_generation_config_as_hf_does(models):
    """A checkpoint whose generation config asks to sample (temperature, top-k, top-p) samples
    under kvtopo.generate too, drawing what HF draws from the same seed; HF's top-k of 50 applies
    when the config sets none; an explicit do_sample=False still decodes greedily."""
    reference, model = models
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    for fields in (dict(do_sample=True, temperature=0.7, top_k=5), dict(do_sample=True, temperature=1.5, top_p=0.3),
                   dict(do_sample=True, temperature=2.0, top_k=0, top_p=0.9), dict(do_sample=True, temperature=2.0)):
        _set_generation_config(models, **fields)
        torch.manual_seed(11)
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=STEPS)
        torch.manual_seed(11)
        got = kvtopo.generate(model, ids, STEPS, config=LOSSLESS)
        assert torch.equal(got, expected), fields
    greedy, _ = _hf(reference, ids)
    assert not torch.equal(greedy, expected)  # the sampled text is not the greedy one
    assert torch.equal(kvtopo.generate(model, ids, STEPS, config=LOSSLESS, do_sample=False), greedy)
    _set_generation_config(models, do_sample=False, top_k=0)  # HF's "no top-k" (refused before, even greedy)
    assert torch.equal(kvtopo.generate(model, ids, STEPS, config=LOSSLESS), greedy)


def test_generation_config_processing_it_does_not_apply_is_named(models):
    _set_generation_config(models, repetition_penalty=1.3, no_repeat_ngram_size=3)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    with pytest.warns(UserWarning, match="repetition_penalty=1.3, no_repeat_ngram_size=3, which HF generate applies"):
        kvtopo.generate(models[1], ids, 2, config=LOSSLESS)
