"""Tests for kvtopo.models.tasks: determinism, lengths, record structure, scorer."""
import pytest

from kvtopo.models import tasks as T
from kvtopo.models.reference import VOCAB, build_tokenizer, encode


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("ctx", T.CONTEXT_LENGTHS)
def test_deterministic_per_seed(task, ctx):
    a = T.make_example(task, ctx, 7)
    b = T.make_example(task, ctx, 7)
    assert a.prompt == b.prompt and a.answer == b.answer
    c = T.make_example(task, ctx, 8)
    assert (c.prompt, c.answer) != (a.prompt, a.answer)


@pytest.mark.parametrize("task", T.TASKS)
def test_seeds_give_distinct_answers(task):
    answers = {T.make_example(task, 512, s).answer for s in range(20)}
    assert len(answers) >= 18


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("ctx", T.CONTEXT_LENGTHS)
def test_length_and_tokens(task, ctx):
    ex = T.make_example(task, ctx, 3)
    # char-level tokenizer: tokens == characters; prompts are exactly ctx long
    assert len(ex.prompt) == ctx
    assert len(encode(ex.prompt)) == ctx
    assert all(c in VOCAB for c in ex.prompt + ex.answer)
    assert ex.answer.endswith(T.TERMINATOR)
    assert (T.QUERY_PREFIX + T.OPEN) in ex.prompt[-8:]


def test_tokenizer_matches_fast_encode():
    tok = build_tokenizer()
    ex = T.make_example("vartrack", 1024, 1)
    ids = tok.encode(ex.prompt).ids
    assert ids == encode(ex.prompt)
    assert tok.decode(ids) == ex.prompt


def _record_value(prompt, opening):
    """Value of the record starting with `opening` inside the context part."""
    ctx = prompt[: prompt.rindex(T.QUERY_PREFIX)]
    i = ctx.index(opening)
    j = ctx.index(T.TERMINATOR, i)
    return ctx[i + len(opening) : j]


@pytest.mark.parametrize("seed", range(5))
def test_answers_are_consistent_with_context(seed):
    # passkey / multikey: the queried record is in the context with that value
    for task in ("passkey", "multikey"):
        ex = T.make_example(task, 1024, seed)
        opening = ex.prompt[ex.prompt.rindex(T.OPEN) :]
        assert ex.prompt.count(opening) == 2  # once as record, once as query
        assert _record_value(ex.prompt, opening) + T.TERMINATOR == ex.answer
    # multivalue: the three records of the key, in order
    ex = T.make_example("multivalue", 1024, seed)
    key = ex.prompt[-2]
    assert ex.prompt.endswith(f"{T.OPEN}{key}¹")
    vals = [_record_value(ex.prompt, f"{T.OPEN}{key}{o}") for o in "¹²³"]
    assert ex.answer == f"{vals[0]}»«{key}²{vals[1]}»«{key}³{vals[2]}»"
    # vartrack: follow the chain by hand
    ex = T.make_example("vartrack", 1024, seed)
    name, expected = ex.prompt[-1], ""
    for _ in range(T.CHAIN_LEN):
        v = _record_value(ex.prompt, f"{T.OPEN}{name}")
        expected += f"{T.OPEN}{name}{v}{T.TERMINATOR}"
        name = v
    assert v.isdigit()
    assert f"{T.OPEN}{ex.prompt[-1]}" + ex.answer == expected


def test_record_counts_scale_with_length():
    counts = [T.make_example("multikey", n, 0).prompt.count(T.OPEN) - 1 for n in T.CONTEXT_LENGTHS]
    assert counts == [8, 16, 32]


def test_heldout_split_disjoint():
    assert set(T.heldout_keys()).isdisjoint(T.train_keys())
    assert len(T.heldout_text()) > 50_000
    ex = T.make_example("passkey", 512, 0)  # test split filler comes from held-out docs
    assert ex.prompt[:40].strip()[:20] in T.heldout_text()


@pytest.mark.parametrize("bad", ["needle", "", "PASSKEY", None])
def test_bad_task_raises(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        T.make_example(bad, 512, 0)


@pytest.mark.parametrize("bad", [0, 100, 513, 4096, -512, 512.0, "512", True])
def test_bad_length_raises(bad):
    with pytest.raises(ValueError, match=repr(bad).replace(".", r"\.")):
        T.make_example("passkey", bad, 0)


def test_score_hand_made():
    ans = "4821»"
    assert T.score("4821»", ans)  # right
    assert T.score("4821»«κ1234»\n¿ blah", ans)  # right + extra tokens: ignored after terminator
    assert not T.score("4822»", ans)  # wrong
    assert not T.score("482", ans)  # partial
    assert not T.score("4821", ans)  # missing terminator
    assert not T.score("48210»", ans)  # longer number
    assert not T.score(" 4821»", ans)  # leading space is not stripped
    assert not T.score("", ans)  # empty
    chain = "β»«βα»«α4821»"
    assert T.score(chain + "xyz", chain)
    assert not T.score("β»«βα»«α4820»", chain)
    assert not T.score("β»«βα»", chain)


def test_score_rejects_bad_inputs():
    with pytest.raises(ValueError):
        T.score("x", "")
    with pytest.raises(TypeError):
        T.score(None, "1»")
