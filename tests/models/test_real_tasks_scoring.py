"""score() of models/real_tasks.py on hand-written questions and answers: wording, case and
punctuation around a right value do not matter; a wrong, longer, partial, missing or extra value fails."""

import pytest

from kvtopo.models import real_tasks as R

NUMBER = R.Question("What is the special magic number for Oslo?", ("4821937",), "number", 32)
TWO = R.Question("What are the special magic numbers for Oslo and Lima?", ("4821937", "7730125"), "number", 64)
UUID = R.Question("uuid?", ("a9debaef-9860-4c2e-979e-dee12e139280",), "uuid", 64)
WORD = R.Question("word?", ("mango",), "words", 32, R.WORDS)
CITY = R.Question("city?", ("Havana",), "words", 32, R.CITIES)


@pytest.mark.parametrize("generated, right", [
    ("4821937", True),
    ("The special magic number for Oslo is 4821937.", True),
    ("**4821937**\n", True),
    ("4821937 (that is 4821937)", True),   # repeated: still one value
    ("48219370", False),                   # a digit added
    ("14821937", False),
    ("482193", False),                     # a digit lost
    ("4821938", False),
    ("4821937 or 4821938", False),         # hedged
    ("4,821,937", True),                   # thousands separators read through
    ("It is 4,821,937.", True),
    ("4821937.5", False),                  # a decimal is another value
    ("0.4821937", False),
    ("4821937.", True),                    # a full stop is not a decimal point
    ("", False),
    ("I don't know.", False),
])
def test_number(generated, right):
    assert R.score(generated, NUMBER) is right


@pytest.mark.parametrize("generated, right", [
    ("4821937, 7730125", True),
    ("7730125 and 4821937.", True),        # order does not matter
    ("Oslo: 4821937\nLima: 7730125", True),
    ("4821937", False),                    # one missing
    ("4821937, 7730125, 1234567", False),  # one extra
    ("4821937, 77301250", False),
    ("4821937,7730125", True),             # a list without spaces: not a thousands separator
])
def test_two_numbers(generated, right):
    assert R.score(generated, TWO) is right


@pytest.mark.parametrize("generated, right", [
    ("a9debaef-9860-4c2e-979e-dee12e139280", True),
    ("A9DEBAEF-9860-4C2E-979E-DEE12E139280.", True),   # case does not matter
    ("The uuid is: A9debaef-9860-4c2e-979e-DEE12E139280", True),
    ("a9debaef-9860-4c2e-979e-dee12e13928", False),    # a hex digit lost
    ("a9debaef-9860-4c2e-979e-dee12e1392800", False),  # a hex digit added
    ("fa9debaef-9860-4c2e-979e-dee12e139280", False),
    ("Fa9debaef-9860-4c2e-979e-dee12e139280", False),  # an added hex digit in upper case too
    ("a9debaef98604c2e979edee12e139280", False),
    ("a9debaef-9860-4c2e-979e-dee12e139281", False),
    ("a9debaef-9860-4c2e-979e-dee12e139280-abcd", False),  # another hyphenated group: another value
    ("ab12-a9debaef-9860-4c2e-979e-dee12e139280", False),
    ("(a9debaef-9860-4c2e-979e-dee12e139280)", True),
])
def test_uuid(generated, right):
    assert R.score(generated, UUID) is right


@pytest.mark.parametrize("question, generated, right", [
    (WORD, "mango", True),
    (WORD, 'The special magic word is "Mango".', True),
    (WORD, "MANGO!", True),
    (WORD, "mangos", False),
    (WORD, "mango or lemon", False),
    (WORD, "lemon", False),
    (CITY, "havana", True),
    (CITY, "She lived in Havana.", True),
    (CITY, "Havana, not Lima.", False),
    (CITY, "Havanna", False),
])
def test_words(question, generated, right):
    assert R.score(generated, question) is right


def test_extract_normalises():
    assert R.extract("Mango and MANGO, lemon; Oslo", WORD) == {"mango", "lemon"}
    assert R.extract("A9DEBAEF-9860-4C2E-979E-DEE12E139280", UUID) == {"a9debaef-9860-4c2e-979e-dee12e139280"}
    assert R.extract("12 123 1234 12345", NUMBER) == {"1234", "12345"}
