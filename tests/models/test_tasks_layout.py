"""models/tasks.py layout promises: records sit at word boundaries of the filler (never inside a
word), the passkey has 5 digits, multikey values 4, and vartrack chains interleave."""

import re

import pytest

from kvtopo.models import tasks as T


@pytest.mark.parametrize("task", T.TASKS)
def test_records_start_at_word_boundaries(task):
    for seed in range(5):
        ex = T.make_example(task, 1024, seed)
        context = ex.prompt[: ex.prompt.rindex(T.QUERY_PREFIX)]
        for m in re.finditer(T.OPEN, context):
            i = m.start()
            # start of text, after a space / newline, or right after another record
            assert i == 0 or context[i - 1] in " \n" + T.TERMINATOR, (task, seed, context[i - 10:i + 3])


def test_value_widths():
    for seed in range(10):
        assert re.fullmatch(r"\d{5}" + T.TERMINATOR, T.make_example("passkey", 512, seed).answer)
        assert re.fullmatch(r"\d{4}" + T.TERMINATOR, T.make_example("multikey", 512, seed).answer)


def test_vartrack_chains_interleave():
    interleaved = 0
    for seed in range(5):
        ex = T.make_example("vartrack", 2048, seed)
        keys = [m.group(1) for m in re.finditer(T.OPEN + r"(.)", ex.prompt[: ex.prompt.rindex(T.QUERY_PREFIX)])]
        chain_of = {}
        for m in re.finditer(T.OPEN + r"(.)(\d{4}|.)" + T.TERMINATOR, ex.prompt):
            chain_of[m.group(1)] = chain_of.get(m.group(2), m.group(1)) if not m.group(2).isdigit() else m.group(1)
        order = [chain_of[k] for k in keys]
        # a chain's three records are consecutive in every chain only if nothing interleaves
        runs = sum(1 for a, b in zip(order, order[1:]) if a != b) + 1
        interleaved += runs > len(set(order))
    assert interleaved >= 4


@pytest.mark.parametrize("task", T.TASKS)
def test_train_and_test_splits_draw_different_records_for_the_same_seed(task):
    # A reference model trained on split="train" must not meet the test split's key/value pairs.
    same = sum(T.make_example(task, 512, s, "train").answer == T.make_example(task, 512, s, "test").answer
               for s in range(10))
    assert same <= 1
