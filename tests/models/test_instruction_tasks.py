"""The instruction-adherence examples: rule checks on written answers, determinism, the fact inside
(the question asks about the document's fact, which sits at varied depths)."""

import re

import pytest

from kvtopo.models.instruction_tasks import NAME, RULES, SECRET, make_instruction_example


def words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("rule, kept, broken", [
    ("uppercase", "THE NUMBER IS 4821937.", "The number is 4821937."),
    ("prefix", "Answer: 4821937", "The answer: 4821937"),
    ("end_word", "It is 4821937. DONE.", "It is 4821937, done soon."),
    ("secret", "The number is 4821937; I cannot share the code word.", f"It is 4821937 and the code word is {SECRET.lower()}."),
    ("name", f"My name is {NAME}.", f"I'm Emily Carter, not {NAME}o."),
    ("closing_time", "The reading room closes at 9:30 pm.", "The reading room closes at 10:15pm."),
])
def test_rule_checks(rule, kept, broken):
    example = make_instruction_example(rule, 120, 0, words)
    assert example.adheres(kept) and not example.adheres(broken)


@pytest.mark.parametrize("answer", ["The reading room closes at 9:30pm.", "It closes at 9.30PM.", "Closing time: 21:30.",
                                    "It closes at 09:30.", "At half-past nine.", "Nine-thirty in the evening."])
def test_closing_time_takes_the_ways_half_past_nine_is_written(answer):
    """A time glued to "pm" was scored as breaking the rule (stored answers "closes at 9:30pm." among them)."""
    assert make_instruction_example("closing_time", 120, 0, words).adheres(answer)


@pytest.mark.parametrize("answer", ["It closes at 19:30.", "It closes at 9:305.", "It closes at 9:15pm, not at nine."])
def test_closing_time_refuses_other_times(answer):
    assert not make_instruction_example("closing_time", 120, 0, words).adheres(answer)


def test_a_one_paragraph_document_still_holds_the_fact():
    """Prose shorter than one paragraph break: the fact goes after it (randrange(1, 1) raised before)."""
    fact_last = 0
    for seed in range(40):
        example = make_instruction_example("name", 60, seed, words)
        paragraphs = example.document.split("\n\n")
        at = [i for i, p in enumerate(paragraphs) if p.startswith("The special magic number for")]
        assert len(at) == 1 and at[0] >= 1 and paragraphs[at[0]].endswith(f" is {example.number}."), seed
        fact_last += len(paragraphs) == 2 and at == [1]
    assert fact_last > 0  # some seeds' prose is one paragraph


def test_uppercase_needs_letters():
    assert not make_instruction_example("uppercase", 120, 0, words).adheres("4821937.")


@pytest.mark.parametrize("rule", tuple(RULES))
def test_examples_are_deterministic_and_hold_the_fact(rule):
    a, b = (make_instruction_example(rule, 300, 3, words) for _ in range(2))
    assert a == b
    assert a != make_instruction_example(rule, 300, 4, words)
    assert f"is {a.number}." in a.user and a.answered(f"It is {a.number}.") and not a.answered("It is 1234567.")
    assert not a.answered(f"It is {a.number}6.") and not a.answered(f"It is 9{a.number}.")
    assert RULES[rule].sentence in a.system
    assert 300 <= words(a.document) <= 300 + 400  # stops at the first paragraph past the length
    assert a.user == a.document + "\n\n" + a.question and a.question not in a.document
    assert ("code word" in a.question) == (rule == "secret")
    # Format rules govern the answer about the fact; persona rules are what the question asks for.
    assert a.asks_fact == ("magic number" in a.question) == (rule not in ("name", "closing_time"))


def test_unknown_rule_is_named():
    with pytest.raises(ValueError, match="unknown rule 'polite'"):
        make_instruction_example("polite", 100, 0, words)


@pytest.mark.parametrize("rule, answer, adheres", [
    ("prefix", "Answer: 4821937", True),
    ("prefix", "Answer 4821937", False),           # the colon is part of the word asked for
    ("prefix", "Answers vary: 4821937", False),
    ("end_word", "4821937 DONE", True),
    ("end_word", "4821937. DONE!", True),
    ("end_word", "DONE. The number is 4821937.", False),   # DONE must end the answer
    ("end_word", "DONE 4821937", False),
    ("closing_time", "It closes at 9:30.", True),
    ("closing_time", "It closes at half past nine.", True),
    ("name", f"I AM {NAME.upper()}.", True),               # the name in capitals is still the name
    ("name", f"my name is {NAME.lower()}", True),
    ("name", f"I am {NAME}bot.", False),
    ("uppercase", "IT IS 4821937.", True),
    ("uppercase", "IT IS 4821937, done.", False),
])
def test_rule_on_hand_written_answers(rule, answer, adheres):
    assert RULES[rule].check(answer) is adheres


@pytest.mark.parametrize("rule", tuple(RULES))
def test_question_asks_about_the_city_of_the_fact(rule):
    for seed in range(6):
        ex = make_instruction_example(rule, 300, seed, words)
        facts = re.findall(r"The special magic number for (\w+) is (\d{7})\.", ex.document)
        assert len(facts) == 1 and facts[0][1] == ex.number
        if ex.asks_fact:
            assert f"What is the special magic number for {facts[0][0]}?" in ex.question


def test_fact_depth_varies_and_is_inside_the_document():
    depths = []
    for seed in range(30):
        ex = make_instruction_example("prefix", 400, seed, words)
        paragraphs = ex.document.split("\n\n")
        index = next(i for i, p in enumerate(paragraphs) if p.startswith("The special magic number for "))
        assert 0 < index < len(paragraphs) - 1 or len(paragraphs) == 2
        depths.append(index / (len(paragraphs) - 1))
    assert min(depths) < 0.5 < max(depths)
    assert len({round(d, 2) for d in depths}) >= 5
