"""RULER-style long-context tasks in natural English text, for a real chat model.

Every example is deterministic given ``(task, length, seed)`` and a token counter, and uses only
the Python standard library (the filler is CPython's bundled documentation, ``pydoc_data``), so
it is offline and the same wherever the CPython patch release is (``pydoc_data`` changes between
them: the stored runs used 3.11.7). Each example is a document (prose with facts hidden in
it), an instruction before it and one or more questions after it; every answer is checked by
code (``score``), never by a judge.

Tasks (``TASKS``):

``niah_number`` / ``niah_word`` / ``niah_uuid``
    One needle, "One of the special magic numbers|words|uuids for <city> is: <value>.", in the
    prose; the question asks for it.
``multikey``
    Three needles with three cities (numbers); the question asks for one city's, the second
    question for another's.
``multivalue``
    Three numbers for the same city; the question asks for all of them.
``multiquery``
    Three needles with three cities; the question asks for two cities at once, the second
    question for another two.
``vartrack``
    Two chains "VAR ABCDE = 4821937." ... "VAR FGHIJ = VAR ABCDE." scattered through the prose
    (in order); the question asks for the value of a chain's last variable (one hop), the second
    question for the other chain's.
``cwe`` (common words)
    No prose: a numbered list of words in which one word recurs many times (at least
    ``max(6, entries // 20)`` times) and every other word once or twice; the question asks for
    the most common one.
``qa``
    A short story about one person (job, city, pet, pet's name, door colour drawn from fixed
    lists) inside the prose; two questions about two of its facts, answered in one word.

Why these sizes and phrasings: SmolLM2-135M-Instruct with the full cache at 512 tokens on
validation seeds 1000-1003 (first question): four needles gave multikey / multivalue / multiquery
1/4 each, three needles 2/4, 2/4, 1/4; RULER's variable tracking (name every variable holding a
value) 0/4, the one-hop value question 2/4; the three most common words 0/3, the most common one
2/4; an unquoted word needle 2/4, quoted 4/4; without "Answer with ... only" / "in one word" the
model rambled (qa 0/3 on seeds 1000-1002, 2/4 with it).

``length`` is what the whole prompt may take, in the caller's tokens: ``count_tokens(user)``
must give the prompt length of a user message (e.g. with the chat template around it); the
document is the longest run of sentences that keeps ``instruction + document + first question``
within it. Needles sit between sentences at random depths.

Scoring (``score``): the answer's kind says what to pull out of the generated text -- numbers
(whole runs of 4+ digits, thousands separators read through), uuids, variable names (5 capital letters) or words of the question's closed
list -- and the answer is right iff the set pulled out equals the expected set: a missing value,
a wrong one, or a right one hedged with a wrong one all fail, while wording around the answer
does not matter.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from typing import Callable

__all__ = ["TASKS", "Question", "Example", "prose_paragraphs", "natural_text", "make_example", "score",
           "extract", "CITIES", "WORDS"]

TASKS = ("niah_number", "niah_word", "niah_uuid", "multikey", "multivalue", "multiquery", "vartrack", "cwe", "qa")

# Closed lists: single words, disjoint, none of them in the prose filler (a test checks).
CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Dublin", "Cairo", "Quito", "Helsinki", "Lagos",
          "Seoul", "Vienna", "Havana", "Manila", "Dakar", "Tbilisi", "Bogota", "Riga", "Karachi", "Zagreb",
          "Montevideo", "Kyoto", "Accra", "Reykjavik", "Sofia", "Tunis", "Jakarta", "Valencia", "Porto", "Krakow",
          "Marseille", "Gdansk", "Chennai", "Adelaide", "Calgary", "Tallinn", "Bergen", "Seville", "Bilbao", "Nagoya")
WORDS = ("giraffe", "violin", "mango", "lantern", "canoe", "walrus", "tulip", "saxophone", "pelican", "volcano",
         "cactus", "harp", "kiwi", "igloo", "pumpkin", "zebra", "accordion", "avocado", "balloon", "beaver",
         "blueberry", "butterfly", "camel", "carrot", "cherry", "dolphin", "donkey", "eagle", "flamingo", "gorilla",
         "hammock", "hedgehog", "jaguar", "kangaroo", "koala", "lemon", "lobster", "meadow", "mushroom", "ostrich",
         "otter", "panda", "peach", "penguin", "piano", "pineapple", "raccoon", "rhubarb", "saddle", "scarf",
         "seahorse", "squirrel", "strawberry", "tiger", "trumpet", "turtle", "umbrella", "walnut", "whale", "tractor")
NAMES = ("Amelia", "Tomas", "Priya", "Oskar", "Lucia", "Mateo", "Ingrid", "Kwame", "Yuki", "Farah", "Dmitri",
         "Noemi", "Rafael", "Signe", "Anselm", "Leila")
JOBS = ("baker", "carpenter", "nurse", "pilot", "librarian", "plumber", "dentist", "florist", "fisherman",
        "architect", "tailor", "veterinarian", "firefighter", "jeweler")
PETS = ("dog", "cat", "parrot", "rabbit", "tortoise", "goat", "ferret", "hamster", "pony", "goose")
PET_NAMES = ("Biscuit", "Pepper", "Juniper", "Waffles", "Marble", "Clover", "Nutmeg", "Pickles", "Bramble",
             "Sprocket", "Tofu", "Dumpling")
COLORS = ("red", "blue", "green", "yellow", "purple", "orange", "pink", "turquoise", "crimson", "violet")

NEEDLE_COUNT = 3  # needles in multikey / multiquery, values in multivalue
CHAIN_VARIABLES = 2  # variables per vartrack chain
CWE_COMMON = 1

_INSTRUCTIONS = {
    "niah": "A special magic {kind} is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about it afterwards.",
    "many": "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
            "I will quiz you about them afterwards.",
    "vartrack": "Memorize and track the chains of variable assignment hidden in the following text.",
    "cwe": "Below is a numbered list of words. In these words, some appear more often than others. "
           "Memorize the ones that appear most often.",
    "qa": "The following text contains a short story. Read it carefully; I will ask you about the story afterwards.",
}
_STORY = ("{name} was a {job} who lived in a small flat in {city}. Every morning, before work, {name} walked "
          "a {pet} called {pet_name} along the river, whatever the weather. One spring {name} painted the front "
          "door {color}, because the neighbours kept saying that it looked dull, and after that everyone in the "
          "street knew the house. {pet_name} liked the new colour too, and slept on the doorstep every afternoon.")
_STORY_QUESTIONS = {
    "job": ("In the story, what was {name}'s job? Answer in one word.", JOBS),
    "city": ("In the story, in which city did {name} live? Answer in one word.", CITIES),
    "pet": ("In the story, what kind of animal was {pet_name}? Answer in one word.", PETS),
    "pet_name": ("In the story, what was the name of {name}'s {pet}? Answer in one word.", PET_NAMES),
    "color": ("In the story, what colour did {name} paint the front door? Answer in one word.", COLORS),
}
# Words a cwe answer is likely to be phrased with: never list words.
_CWE_EXCLUDED = {"three", "words", "common", "above", "answer", "appear", "appears", "appeared", "frequent",
                 "frequently", "often", "times", "following", "listed", "numbered", "below", "these", "memorize"}

_KINDS = ("number", "uuid", "varname", "words")
# Whole runs of 4+ digits: the integer part of a decimal ("4821937.5") is another value, and so is
# its fraction; a thousands separator ("4,821,937") is read through (`_THOUSANDS`).
_NUMBER = re.compile(r"(?<!\d)(?<!\d\.)\d{4,}(?!\d|\.\d)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# Bounded: a uuid with extra hex digits, or another hyphenated hex group, on either side is another
# value, not this one.
_UUID = re.compile(r"(?<![0-9a-f])(?<![0-9a-f]-)[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
                   r"(?![0-9a-f]|-[0-9a-f])", re.IGNORECASE)
_VARNAME = re.compile(r"\b[A-Z]{5}\b")
_WORD = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Question:
    """A question and its answer: `answers` is the exact set `extract` must find; `kind` says
    what to extract ("words": members of `vocabulary`)."""

    text: str
    answers: tuple[str, ...]
    kind: str
    max_new_tokens: int
    vocabulary: tuple[str, ...] = ()


@dataclass(frozen=True)
class Example:
    """The user message is ``instruction + "\\n\\n" + document + "\\n\\n" + questions[0].text``;
    later questions are asked in later turns of the same conversation."""

    task: str
    length: int
    seed: int
    instruction: str
    document: str
    questions: tuple[Question, ...]

    @property
    def context(self) -> str:
        """The user message up to the end of the document (what a query-agnostic cache compresses)."""
        return f"{self.instruction}\n\n{self.document}"

    def user(self, question: int = 0) -> str:
        return f"{self.context}\n\n{self.questions[question].text}"


# -- filler -----------------------------------------------------------------------------------------
_PARAGRAPHS: list[str] = []


def prose_paragraphs() -> list[str]:
    """Paragraphs of plain prose from CPython's bundled docs (code, tables and grammar left out),
    each on one line."""
    if not _PARAGRAPHS:
        from kvtopo.models import tasks

        for text in (tasks.heldout_text(), tasks.train_text()):
            for para in text.split("\n\n"):
                if para.startswith(" ") or not para.rstrip().endswith(".") or len(para) < 200:
                    continue  # indented code or grammar, a heading, a fragment
                if any(mark in para for mark in ("::", ">>>", "|", "---")):
                    continue
                _PARAGRAPHS.append(" ".join(para.split()))  # unwrap the 70-column lines
    return list(_PARAGRAPHS)


def prose_run(rng: random.Random, tokens: int, count_tokens: Callable[[str], int]) -> list[str]:
    """Consecutive prose paragraphs from a random start (drawn from `rng`), up to the first that
    brings them to `tokens` tokens: a document whose sentences follow each other as written."""
    paragraphs = prose_paragraphs()
    run, total = [], 0
    for paragraph in paragraphs[rng.randrange(len(paragraphs) - 200):]:
        if total >= tokens:
            break
        run.append(paragraph)
        total += count_tokens(paragraph)
    return run


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def natural_text(seed: int, chars: int) -> str:
    """At least `chars` characters of prose: whole paragraphs, from a seed-chosen one on (cyclic)."""
    paragraphs = prose_paragraphs()
    start = random.Random(f"kvtopo/natural/{seed}").randrange(len(paragraphs))
    out, total, i = [], 0, start
    while total < chars:
        out.append(paragraphs[i % len(paragraphs)])
        total += len(out[-1]) + 2
        i += 1
    return "\n\n".join(out)


def _sentences(rng: random.Random, chars: int) -> list[str]:
    """Sentences of consecutive prose paragraphs from a random one on; a paragraph's last
    sentence carries the paragraph break."""
    paragraphs = prose_paragraphs()
    i, out, total = rng.randrange(len(paragraphs)), [], 0
    while total < chars:
        parts = _SENTENCE_END.split(paragraphs[i % len(paragraphs)])
        parts[-1] += "\n\n"
        out += parts
        total += sum(len(p) + 1 for p in parts)
        i += 1
    return out


def _join(sentences: list[str]) -> str:
    return "".join(s if s.endswith("\n\n") else s + " " for s in sentences).strip()


def _document(sentences: list[str], needles: list[tuple[float, str]], n: int) -> str:
    """The first `n` filler sentences with each needle inserted at its depth (a fraction of n)."""
    slots: dict[int, list[str]] = {}
    for depth, needle in needles:
        slots.setdefault(round(depth * n), []).append(needle)
    out = []
    for i in range(n + 1):
        out += slots.get(i, [])
        if i < n:
            out.append(sentences[i])
    return _join(out)


def _longest(fits: Callable[[int], bool], hi: int, what: str) -> int:
    """The largest n in [0, hi] with fits(n) (fits is monotone)."""
    if not fits(0):
        raise ValueError(f"{what}: even without filler the prompt exceeds the length asked for")
    if fits(hi):
        raise ValueError(f"{what}: {hi} filler units do not fill the length asked for")
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# -- values -----------------------------------------------------------------------------------------
def _number(rng: random.Random, used: set) -> str:
    while True:
        value = str(rng.randrange(1_000_000, 10_000_000))
        if value not in used:
            used.add(value)
            return value


def _varname(rng: random.Random, used: set) -> str:
    while True:
        value = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if value not in used and value not in ("ASCII", "LATIN"):  # the two in the prose
            used.add(value)
            return value


def _needle(kind: str, key: str, value: str) -> str:
    if kind == "word":
        return f'One of the special magic words for {key} is: "{value}".'
    return f"One of the special magic {kind}s for {key} is: {value}."


def _magic_question(kind: str, keys: list[str]) -> str:
    if len(keys) == 1:
        return (f"What is the special magic {kind} for {keys[0]} mentioned in the provided text? "
                f"Answer with the {kind} only.")
    return (f"What are the special magic {kind}s for {' and '.join(keys)} mentioned in the provided text? "
            f"Answer with the {len(keys)} {kind}s only.")


# -- tasks ------------------------------------------------------------------------------------------
def _plan(task: str, rng: random.Random):
    """(instruction, needles [(depth, sentence)], questions) of a prose task."""
    used: set = set()
    cities = rng.sample(CITIES, NEEDLE_COUNT)
    if task.startswith("niah_"):
        kind = task.split("_")[1]
        value = (_number(rng, used) if kind == "number" else rng.choice(WORDS) if kind == "word"
                 else str(uuid.UUID(int=rng.getrandbits(128), version=4)))
        q = Question(_magic_question(kind, cities[:1]), (value,), "words" if kind == "word" else kind,
                     64 if kind == "uuid" else 32, WORDS if kind == "word" else ())
        return _INSTRUCTIONS["niah"].format(kind=kind), [(rng.random(), _needle(kind, cities[0], value))], [q]
    if task in ("multikey", "multiquery"):
        values = [_number(rng, used) for _ in cities]
        needles = [(rng.random(), _needle("number", c, v)) for c, v in zip(cities, values)]
        groups = [[0], [1]] if task == "multikey" else [[0, 1], [1, 2]]
        questions = [Question(_magic_question("number", [cities[i] for i in g]), tuple(values[i] for i in g),
                              "number", 32 * len(g)) for g in groups]
        return _INSTRUCTIONS["many"], needles, questions
    if task == "multivalue":
        values = [_number(rng, used) for _ in range(NEEDLE_COUNT)]
        needles = [(rng.random(), _needle("number", cities[0], v)) for v in values]
        question = (f"What are all the special magic numbers for {cities[0]} mentioned in the provided text? "
                    "Answer with the numbers only.")
        return _INSTRUCTIONS["many"], needles, [Question(question, tuple(values), "number", 96)]
    if task == "vartrack":
        needles, questions = [], []
        for _ in range(2):
            names = [_varname(rng, used) for _ in range(CHAIN_VARIABLES)]
            value = _number(rng, used)
            depths = sorted(rng.random() for _ in names)
            statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
            needles += list(zip(depths, statements))
            questions.append(Question(f"What is the value of VAR {names[-1]}? Answer with the number only.",
                                      (value,), "number", 32))
        return _INSTRUCTIONS["vartrack"], needles, questions
    if task == "qa":
        facts = dict(name=rng.choice(NAMES), job=rng.choice(JOBS), city=rng.choice(CITIES), pet=rng.choice(PETS),
                     pet_name=rng.choice(PET_NAMES), color=rng.choice(COLORS))
        questions = [Question(_STORY_QUESTIONS[slot][0].format(**facts), (facts[slot],), "words", 32,
                              _STORY_QUESTIONS[slot][1])
                     for slot in rng.sample(sorted(_STORY_QUESTIONS), 2)]
        return _INSTRUCTIONS["qa"], [(rng.random(), _STORY.format(**facts))], questions
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def _cwe_vocabulary() -> list[str]:
    words = {w.lower() for p in prose_paragraphs() for w in _WORD.findall(p) if len(w) >= 5}
    excluded = _CWE_EXCLUDED | {w.lower() for text in _INSTRUCTIONS.values() for w in _WORD.findall(text)}
    return sorted(words - excluded)


def _cwe(rng: random.Random, length: int, count_tokens: Callable[[str], int], seed: int) -> Example:
    vocabulary = _cwe_vocabulary()
    rng.shuffle(vocabulary)
    common, rare = vocabulary[:CWE_COMMON], vocabulary[CWE_COMMON:]
    rare_counts = [rng.choice((1, 2)) for _ in rare]
    instruction = _INSTRUCTIONS["cwe"]
    text = (f"What are the {CWE_COMMON} most common words in the above list? Answer with the {CWE_COMMON} words only."
            if CWE_COMMON > 1 else "What is the most common word in the above list? Answer with the word only.")
    question = Question(text, tuple(common), "words", 16 * CWE_COMMON)

    def entries(n: int) -> list[str]:
        """n list entries: each common word max(6, n // 20) times, rare words to fill, shuffled."""
        repeat = max(6, n // 20)
        words = [w for w in common for _ in range(repeat)]
        for w, c in zip(rare, rare_counts):
            if len(words) >= n:
                break
            words += [w] * min(c, n - len(words))
        return random.Random(f"kvtopo/cwe/{seed}/{n}").sample(words, len(words))

    def document(n: int) -> str:
        return "\n".join(f"{i + 1}. {w}" for i, w in enumerate(entries(n)))

    def fits(n: int) -> bool:
        return count_tokens(f"{instruction}\n\n{document(n)}\n\n{question.text}") <= length

    n = _longest(fits, min(len(rare), 4 * length), f"cwe at {length} tokens")
    if n < CWE_COMMON * 6 * 2:
        raise ValueError(f"cwe at {length} tokens: only {n} list entries fit")
    listed = tuple(sorted(set(entries(n))))
    question = Question(question.text, question.answers, "words", question.max_new_tokens, listed)
    return Example("cwe", length, seed, instruction, document(n), (question,))


def make_example(task: str, length: int, seed: int, count_tokens: Callable[[str], int]) -> Example:
    """The example `seed` of `task` whose prompt, `count_tokens(example.user(0))`, is at most
    `length` tokens and as long as whole filler sentences allow."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 128:
        raise ValueError(f"length must be an int >= 128 (prompt tokens), got {length!r}")
    rng = random.Random(f"kvtopo/real/{task}/{length}/{seed}")
    if task == "cwe":
        return _cwe(rng, length, count_tokens, seed)
    instruction, needles, questions = _plan(task, rng)
    sentences = _sentences(rng, 8 * length)

    def fits(n: int) -> bool:
        return count_tokens(f"{instruction}\n\n{_document(sentences, needles, n)}\n\n{questions[0].text}") <= length

    n = _longest(fits, len(sentences), f"{task} at {length} tokens")
    return Example(task, length, seed, instruction, _document(sentences, needles, n), tuple(questions))


# -- scoring ----------------------------------------------------------------------------------------
def numbers(text: str) -> set[str]:
    """The numbers of 4+ digits `text` names, read as `score` reads them (`_NUMBER`)."""
    return set(_NUMBER.findall(_THOUSANDS.sub("", text)))


def has_number(number: str | int, text: str) -> bool:
    """`number` (4+ digits) appears in `text` as itself: not inside a longer digit run (a compressed
    cache can add a digit), not as a decimal's integer part."""
    return str(number) in numbers(text)


def extract(generated: str, question: Question) -> set[str]:
    """What `generated` answers, as a set of normalised values of the question's kind."""
    if question.kind == "number":
        return numbers(generated)
    if question.kind == "uuid":
        return {u.lower() for u in _UUID.findall(generated)}
    if question.kind == "varname":
        return set(_VARNAME.findall(generated))
    if question.kind == "words":
        vocabulary = {w.lower() for w in question.vocabulary}
        return {w.lower() for w in _WORD.findall(generated)} & vocabulary
    raise ValueError(f"unknown answer kind {question.kind!r}; expected one of {_KINDS}")


def score(generated: str, question: Question) -> bool:
    """Right iff exactly the expected values are in the answer (see the module docstring)."""
    if not isinstance(generated, str):
        raise TypeError(f"score() expects the generated text as a str, got {type(generated).__name__}")
    expected = {a.lower() for a in question.answers} if question.kind in ("uuid", "words") else set(question.answers)
    return extract(generated, question) == expected
