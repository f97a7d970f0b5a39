"""kvtopo.generate's prefill chunking, progress bar and session handling, counted and compared
with HF greedy decoding of the same (deterministic zoo) weights."""

import pytest
import torch

import kvtopo
from kvtopo.models import zoo

from forward_counting import Counting


@pytest.fixture(scope="module")
def models():
    return zoo.build("llama"), kvtopo.compile(zoo.build("llama"), inductor=False)


IDS = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(4))


def _greedy(ref, ids, steps):
    with torch.no_grad():
        return ref.generate(ids, max_new_tokens=steps, do_sample=False)


def test_prefill_chunk_size_argument_overrides_the_config(models):
    ref, compiled = models
    model = Counting(compiled)
    out = kvtopo.generate(model, IDS, 3, config=kvtopo.Config.lossless(prefill_chunk_size=8),
                          prefill_chunk_size=4, eos_token_id=None)
    assert model.widths == [4, 4, 2, 1, 1]  # 10 prompt tokens in chunks of 4, then 2 decode steps
    assert torch.equal(out, _greedy(ref, IDS, 3))


def test_without_the_argument_the_sessions_chunk_size_applies(models):
    ref, compiled = models
    model = Counting(compiled)
    with kvtopo.session(kvtopo.Config.lossless(prefill_chunk_size=3)):
        out = kvtopo.generate(model, IDS, 2, eos_token_id=None)
    assert model.widths == [3, 3, 3, 1, 1]
    assert torch.equal(out, _greedy(ref, IDS, 2))


def test_progress_bar_only_when_asked_or_long(models, capsys):
    _, compiled = models
    config = kvtopo.Config.lossless()
    kvtopo.generate(compiled, IDS, 2, config=config, progress=True)
    assert "kvtopo.generate" in capsys.readouterr().err
    kvtopo.generate(compiled, IDS, 2, config=config, progress=False)
    kvtopo.generate(compiled, IDS, 2, config=config)  # 12 tokens: far below the default threshold
    assert "kvtopo.generate" not in capsys.readouterr().err


def test_generating_twice_in_one_session_starts_from_a_clear_history(models):
    ref, compiled = models
    other = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(8))
    with kvtopo.session(kvtopo.Config.lossless()):
        kvtopo.generate(compiled, IDS, 4, eos_token_id=None)
        second = kvtopo.generate(compiled, other, 4, eos_token_id=None)
    assert torch.equal(second, _greedy(ref, other, 4))


def test_a_config_other_than_the_active_sessions_is_refused(models):
    _, compiled = models
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match="differs from the active session's config"):
            kvtopo.generate(compiled, IDS, 2, config=kvtopo.Config.lossless(prefill_chunk_size=7))
        assert s.calls == 0
        # The same config is fine.
        kvtopo.generate(compiled, IDS, 1, config=kvtopo.Config.lossless())


def test_a_row_of_padding_only_is_refused_before_any_forward(models):
    _, compiled = models
    model = Counting(compiled)
    ids = torch.cat([IDS, IDS])
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match="every sequence needs at least one real token"):
        kvtopo.generate(model, ids, 2, config=kvtopo.Config.lossless(), attention_mask=mask)
    assert model.widths == []


def test_an_int32_prompt_gives_int64_tokens_as_hf_does(models):
    """The output is the LongTensor the docstring promises (it took the prompt's dtype before)."""
    ref, compiled = models
    ids = IDS.int()
    out = kvtopo.generate(compiled, ids, 3, config=kvtopo.Config.lossless(), eos_token_id=None)
    expected = _greedy(ref, ids, 3)
    assert out.dtype == expected.dtype == torch.int64 and torch.equal(out, expected)
