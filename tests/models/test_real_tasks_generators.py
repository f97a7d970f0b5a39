"""Generators of models/real_tasks.py: each needle carries the key its question asks about, the
questions of one example differ, needles are never lost and sit at varied depths, the qa story's
questions vary and are answered by the story itself, and natural_text is whole paragraphs.
(Fast: a word counter stands in for the tokenizer.)"""

import re

import pytest

from kvtopo.models import real_tasks as R


def words(text: str) -> int:
    return len(text.split())


def asked_cities(question: R.Question) -> list[str]:
    """The cities a magic-number question names, in order (hand parsing of the question text)."""
    m = re.search(r"special magic (?:number|word|uuid)s? for (.+?) mentioned", question.text)
    assert m, question.text
    return m.group(1).split(" and ")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("task, kind", [("niah_number", "numbers"), ("niah_word", "words"), ("niah_uuid", "uuids")])
def test_niah_needle_names_the_city_the_question_asks_for(task, kind, seed):
    ex = R.make_example(task, 400, seed, words)
    (q,) = ex.questions
    (city,) = asked_cities(q)
    (value,) = q.answers
    quoted = f'"{value}"' if task == "niah_word" else value
    assert f"One of the special magic {kind} for {city} is: {quoted}." in ex.document


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("task", ["multikey", "multiquery"])
def test_each_asked_city_has_its_own_answer_and_the_two_questions_differ(task, seed):
    ex = R.make_example(task, 400, seed, words)
    assert len(ex.questions) == 2
    per_question = 1 if task == "multikey" else 2
    for q in ex.questions:
        cities = asked_cities(q)
        assert len(cities) == len(q.answers) == len(set(q.answers)) == per_question
        for city, value in zip(cities, q.answers):
            assert f"One of the special magic numbers for {city} is: {value}." in ex.document
    first, second = ex.questions
    assert first.text != second.text and set(first.answers) != set(second.answers)
    # three needles, three cities, three values in the document
    assert len(re.findall(r"special magic numbers for \w+ is: \d{7}\.", ex.document)) == 3


@pytest.mark.parametrize("seed", range(4))
def test_multivalue_values_all_belong_to_the_asked_city(seed):
    ex = R.make_example("multivalue", 400, seed, words)
    (q,) = ex.questions
    city = re.search(r"numbers for (\w+) mentioned", q.text).group(1)
    found = re.findall(rf"special magic numbers for {city} is: (\d+)\.", ex.document)
    assert sorted(found) == sorted(q.answers) and len(set(found)) == 3


def test_number_values_have_seven_digits_and_vary_with_the_seed():
    answers = []
    for seed in range(20):
        for task in ("niah_number", "multikey", "multivalue", "multiquery", "vartrack"):
            for q in R.make_example(task, 300, seed, words).questions:
                assert all(re.fullmatch(r"[1-9]\d{6}", a) for a in q.answers), (task, q.answers)
        answers.append(R.make_example("niah_number", 300, seed, words).questions[0].answers[0])
    assert len(set(answers)) >= 19


def test_word_needle_is_quoted():
    for seed in range(4):
        ex = R.make_example("niah_word", 400, seed, words)
        assert f'is: "{ex.questions[0].answers[0]}".' in ex.document


def test_no_needle_is_lost_at_the_end_of_the_document():
    # Short documents (few sentences) make a depth that rounds to the last slot common.
    for task in ("niah_number", "multikey", "multivalue", "vartrack"):
        for seed in range(150):
            ex = R.make_example(task, 128, seed, words)
            expected = {"niah_number": 1, "multikey": 3, "multivalue": 3, "vartrack": 4}[task]
            needles = re.findall(r"special magic numbers for \w+ is: \d{7}\.|\bVAR [A-Z]{5} = ", ex.document)
            assert len(needles) == expected, (task, seed)
            for q in ex.questions:
                for a in q.answers:
                    assert a in ex.document, (task, seed, a)


def test_needle_depths_spread_over_the_document():
    depths = []
    for seed in range(40):
        ex = R.make_example("niah_number", 400, seed, words)
        depths.append(ex.document.index("One of the special magic") / len(ex.document))
    assert min(depths) < 0.2 and max(depths) > 0.8
    assert sum(d < 0.5 for d in depths) >= 10 and sum(d > 0.5 for d in depths) >= 10


def test_qa_asks_about_every_fact_across_seeds_and_the_story_answers_each_question():
    slots = set()
    patterns = {"job": "what was \\w+'s job", "city": "in which city", "pet": "what kind of animal",
                "pet_name": "what was the name of", "color": "what colour"}
    for seed in range(30):
        ex = R.make_example("qa", 400, seed, words)
        assert len(ex.questions) == 2
        asked = [next(s for s, p in patterns.items() if re.search(p, q.text)) for q in ex.questions]
        assert asked[0] != asked[1]
        slots.update(asked)
        story = next(s for s in re.split(r"(?<=\.) ", ex.document) if " was a " in s and "lived in a small flat" in s)
        start = ex.document.index(story)
        story_text = ex.document[start:ex.document.index("slept on the doorstep every afternoon.") + 38]
        # The story mentions every fact once; each fact is of a different closed list, so
        # repeating the whole story answers every question with exactly its fact.
        for q in ex.questions:
            assert R.score(story_text, q), (seed, q.text)
    assert slots == set(patterns)


def test_natural_text_is_whole_paragraphs_deterministic_and_seeded():
    paragraphs = set(R.prose_paragraphs())
    longest = max(len(p) for p in paragraphs)
    for seed in (0, 1, 99_999):
        text = R.natural_text(seed, 5000)
        assert text == R.natural_text(seed, 5000)
        assert 5000 <= len(text) < 5000 + longest + 2
        assert all(p in paragraphs for p in text.split("\n\n"))
    order = R.prose_paragraphs()
    starts = [order.index(R.natural_text(seed, 100).split("\n\n")[0]) for seed in range(20)]
    assert len(set(starts)) >= 15
    # seed-chosen anywhere in the prose, not only near its beginning
    assert min(starts) < len(order) / 4 and max(starts) > 3 * len(order) / 4


@pytest.mark.parametrize("length", [128, 160, 250, 600])
def test_cwe_winner_recurs_at_least_six_times_at_every_length(length):
    from collections import Counter

    for seed in range(3):
        ex = R.make_example("cwe", length, seed, words)
        counts = Counter(line.split(". ", 1)[1] for line in ex.document.splitlines())
        (winner, top), *rest = counts.most_common()
        assert (winner,) == ex.questions[0].answers
        entries = sum(counts.values())
        assert top >= max(6, entries // 20) and all(c <= 2 for _, c in rest), (length, seed, top)
        assert [int(line.split(".")[0]) for line in ex.document.splitlines()] == list(range(1, entries + 1))


def test_document_keeps_the_prose_paragraph_breaks():
    prose = R.prose_paragraphs()
    needle = re.compile(r"One of the special magic numbers for \w+ is: \d{7}\. ?")
    for seed in range(3):
        ex = R.make_example("niah_number", 600, seed, words)
        paragraphs = ex.document.split("\n\n")
        assert len(paragraphs) >= 2
        for p in paragraphs:
            text = needle.sub("", p).strip()
            # each paragraph of the document is (a run of sentences of) one prose paragraph
            assert not text or any(text in q for q in prose), text[:80]
