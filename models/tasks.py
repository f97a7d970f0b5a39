"""Long-context retrieval tasks for kvtopo's quality benchmark.

Everything here is deterministic given ``(task, context_tokens, seed, split)``
and uses only the Python standard library, so examples can be regenerated
anywhere, offline.

Text layout
-----------
The reference tokenizer is character level (one token per character), so
"tokens" and "characters" are the same thing throughout this module.

Key/value *records* are embedded at random word boundaries of natural-language
filler (CPython's bundled documentation, ``pydoc_data.topics``)::

    «κ4821»           key κ (one Greek letter), value 4821
    «β²7730»          key β, ordinal ² (multi-value task)
    «γβ»              variable γ holds variable β (variable tracking)

The prompt ends with the *query*, a newline, the question mark ``¿`` and the
exact opening of the record being asked for (identical marker at record and
query), so retrieval is "find the earlier occurrence of the query's last
token(s) and copy what followed" (an induction-head lookup)::

    ...filler «κ4821» filler ... filler\n¿«κ

The four tasks (``TASKS``):

``passkey``
    One record with a 5-digit value hidden in the filler. Answer ``48213»``.
``multikey``
    ``context_tokens // 64`` records (8 at 512, 16 at 1K, 32 at 2K) with
    distinct keys and 4-digit values; one is queried. Answer ``4821»``.
``multivalue``
    ``context_tokens // 192`` keys, each with 3 records ``«β¹…»``,
    ``«β²…»``, ``«β³…»`` (shared key, ordinal ¹²³, in order of appearance).
    The query opens the first record of one key and the answer lists *all*
    its values, written out record by record: ``4821»«β²7730»«β³1234»``.
``vartrack``
    ``context_tokens // 192`` chains ``«α4821»`` … ``«βα»`` … ``«γβ»``
    (records of one chain appear in this order, interleaved with other
    chains). The query asks for the last variable of one chain; the answer
    follows the chain hop by hop down to the number: ``β»«βα»«α4821»``.

Every prompt is exactly ``context_tokens`` characters long (filler is cut to
fit). Supported lengths are ``CONTEXT_LENGTHS`` = 512, 1024 and 2048 (the
training script also uses shorter ones through ``_build``).

Scoring
-------
Every answer ends with the terminator ``»`` and is therefore self-delimiting.
``score(generated, answer)`` is True iff ``generated`` *starts with* the whole
answer: ``generated[:len(answer)] == answer``. Consequently

* a right answer followed by extra tokens is right (everything after the
  answer's final ``»`` is ignored; generate at least ``len(answer)`` tokens);
* a wrong answer, a partial/truncated answer (e.g. ``482`` or ``4821``
  without ``»``), a longer number (``48210»``) or an empty generation are
  wrong.

Leading whitespace is *not* stripped: the answer must start immediately after
the prompt.

Filler splits
-------------
``pydoc_data.topics`` keys are sorted; every 5th key (index % 5 == 0) is
held out. ``split="train"`` examples draw filler from the other keys,
``split="test"`` (the default, used by benchmarks) from the held-out ones.
``heldout_text()`` returns the held-out documents for perplexity.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = [
    "TASKS",
    "CONTEXT_LENGTHS",
    "TERMINATOR",
    "QUERY_MARK",
    "Example",
    "make_example",
    "make_examples",
    "score",
    "heldout_text",
    "train_text",
    "heldout_keys",
    "train_keys",
]

TASKS = ("passkey", "multikey", "multivalue", "vartrack")
CONTEXT_LENGTHS = (512, 1024, 2048)

OPEN = "\u00ab"  # «
TERMINATOR = "\u00bb"  # »
QUERY_MARK = "\u00bf"  # ¿
QUERY_PREFIX = "\n" + QUERY_MARK

GREEK_LOWER = "".join(chr(c) for c in range(0x03B1, 0x03CA) if c != 0x03C2)  # 24
GREEK_UPPER = "".join(chr(c) for c in range(0x0391, 0x03AA) if c != 0x03A2)  # 24
KEY_ALPHABET = GREEK_LOWER + GREEK_UPPER  # 48 single-character keys

ORDINALS = "\u00b9\u00b2\u00b3"  # ¹ ² ³ (record ordinal in multivalue)
N_VALUES = 3  # records per key in multivalue
CHAIN_LEN = 3  # records per chain in vartrack (1 number + 2 aliases)


@dataclass(frozen=True)
class Example:
    """One benchmark example: feed ``prompt``, compare the continuation with ``answer``."""

    prompt: str
    answer: str
    task: str = ""
    context_tokens: int = 0
    seed: int = 0
    meta: dict = field(default_factory=dict, compare=False, repr=False)


# ----------------------------------------------------------------------------- text


def _all_keys():
    from pydoc_data.topics import topics

    return sorted(topics)


def heldout_keys() -> list[str]:
    """Sorted pydoc_data.topics keys held out from training (index % 5 == 0)."""
    return [k for i, k in enumerate(_all_keys()) if i % 5 == 0]


def train_keys() -> list[str]:
    """Sorted pydoc_data.topics keys used for training filler / LM text."""
    return [k for i, k in enumerate(_all_keys()) if i % 5 != 0]


_TEXT_CACHE: dict[str, str] = {}


def _clean(s: str) -> str:
    # Records use « » ¿ and Greek letters; make sure filler never contains them.
    bad = set(OPEN + TERMINATOR + QUERY_MARK + KEY_ALPHABET + ORDINALS)
    return "".join(" " if c in bad else c for c in s)


def _text(split: str) -> str:
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if split not in _TEXT_CACHE:
        from pydoc_data.topics import topics

        keys = train_keys() if split == "train" else heldout_keys()
        _TEXT_CACHE[split] = _clean("\n\n".join(topics[k].strip() for k in keys))
    return _TEXT_CACHE[split]


def heldout_text() -> str:
    """Held-out natural text (held-out pydoc topics joined by blank lines)."""
    return _text("test")


def train_text() -> str:
    """Training natural text (the remaining pydoc topics)."""
    return _text("train")


def _filler(rng: random.Random, n: int, split: str) -> str:
    text = _text(split)
    if n <= 0:
        return ""
    if n >= len(text):
        reps = n // len(text) + 1
        text = text * reps
    start = rng.randrange(0, len(text) - n + 1)
    return text[start : start + n]


# ----------------------------------------------------------------------------- building


def _digits(rng: random.Random, n: int, used: set) -> str:
    while True:
        v = "".join(rng.choice("0123456789") for _ in range(n))
        if v not in used:
            used.add(v)
            return v


def _layout(rng: random.Random, groups: list[list[str]], filler: str) -> str:
    """Insert record groups into filler at word boundaries.

    Records of one group keep their order; groups are interleaved at random.
    """
    labels = [g for g, recs in enumerate(groups) for _ in recs]
    rng.shuffle(labels)
    cursor = [0] * len(groups)
    ordered = []
    for g in labels:
        ordered.append(groups[g][cursor[g]])
        cursor[g] += 1
    cands = [i for i in range(1, len(filler)) if filler[i - 1] in " \n"] or [0]
    pos = sorted(rng.choice(cands) for _ in ordered)
    out, prev = [], 0
    for p, rec in zip(pos, ordered):
        out.append(filler[prev:p])
        out.append(rec)
        prev = p
    out.append(filler[prev:])
    return "".join(out)


def _n_records(task: str, ctx: int) -> int:
    if task == "multikey":
        return max(2, min(40, ctx // 64))
    if task == "multivalue":  # number of keys, 3 records each
        return max(1, min(12, ctx // 192))
    if task == "vartrack":  # number of chains, 3 records each
        return max(1, min(12, ctx // 192))
    return 1


def _build(task: str, ctx: int, rng: random.Random, split: str, n_queries: int = 1):
    """Return ``(context, [(query, answer), ...])``; ``len(context + queries[0][0]) == ctx``.

    ``n_queries > 1`` (training only) asks several distinct records of the same
    context; evaluation always uses the first query.
    """
    used: set = set()
    keys = rng.sample(KEY_ALPHABET, len(KEY_ALPHABET))
    groups: list[list[str]] = []
    qa: list[tuple[str, str]] = []
    if task == "passkey":
        k, v = keys[0], _digits(rng, 5, used)
        groups.append([f"{OPEN}{k}{v}{TERMINATOR}"])
        qa.append((f"{QUERY_PREFIX}{OPEN}{k}", f"{v}{TERMINATOR}"))
    elif task == "multikey":
        n = _n_records(task, ctx)
        for k in keys[:n]:
            v = _digits(rng, 4, used)
            groups.append([f"{OPEN}{k}{v}{TERMINATOR}"])
            qa.append((f"{QUERY_PREFIX}{OPEN}{k}", f"{v}{TERMINATOR}"))
    elif task == "multivalue":
        n = _n_records(task, ctx)
        for k in keys[:n]:
            vals = [_digits(rng, 4, used) for _ in range(N_VALUES)]
            groups.append([f"{OPEN}{k}{ORDINALS[j]}{v}{TERMINATOR}" for j, v in enumerate(vals)])
            ans = f"{vals[0]}{TERMINATOR}" + "".join(
                f"{OPEN}{k}{ORDINALS[j]}{v}{TERMINATOR}" for j, v in enumerate(vals) if j > 0
            )
            qa.append((f"{QUERY_PREFIX}{OPEN}{k}{ORDINALS[0]}", ans))
    elif task == "vartrack":
        n = _n_records(task, ctx)
        for c in range(n):
            names = keys[c * CHAIN_LEN : (c + 1) * CHAIN_LEN]
            v = _digits(rng, 4, used)
            recs = [f"{OPEN}{names[0]}{v}{TERMINATOR}"]
            recs += [f"{OPEN}{names[i]}{names[i - 1]}{TERMINATOR}" for i in range(1, CHAIN_LEN)]
            groups.append(recs)
            # answer: value of the last name, then follow the chain down
            ans = f"{names[-2]}{TERMINATOR}"
            for i in range(CHAIN_LEN - 2, 0, -1):
                ans += f"{OPEN}{names[i]}{names[i - 1]}{TERMINATOR}"
            ans += f"{OPEN}{names[0]}{v}{TERMINATOR}"
            qa.append((f"{QUERY_PREFIX}{OPEN}{names[-1]}", ans))
    else:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    first = rng.randrange(len(qa))
    order = [first] + rng.sample([i for i in range(len(qa)) if i != first], min(n_queries, len(qa)) - 1)
    qa = [qa[i] for i in order]
    rec_len = sum(len(r) for g in groups for r in g)
    n_fill = ctx - rec_len - len(qa[0][0])
    if n_fill < 0:
        raise ValueError(f"context_tokens={ctx} too small for task {task!r}")
    context = _layout(rng, groups, _filler(rng, n_fill, split))
    return context, qa


def _check(task: str, context_tokens: int) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int):
        raise ValueError(f"context_tokens must be an int, got {context_tokens!r}")
    if context_tokens not in CONTEXT_LENGTHS:
        raise ValueError(
            f"unsupported context_tokens {context_tokens!r}; expected one of {CONTEXT_LENGTHS}"
        )


def make_example(task: str, context_tokens: int, seed: int, split: str = "test") -> Example:
    """Deterministic example for ``(task, context_tokens, seed, split)``.

    ``len(prompt) == context_tokens`` characters (= tokens of the reference
    tokenizer). ``split='test'`` (default) uses held-out filler text.
    """
    _check(task, context_tokens)
    rng = random.Random(f"kvtopo/{task}/{context_tokens}/{seed}/{split}")
    context, qa = _build(task, context_tokens, rng, split)
    q, a = qa[0]
    return Example(prompt=context + q, answer=a, task=task, context_tokens=context_tokens, seed=seed)


def make_examples(task: str, context_tokens: int, n: int, start_seed: int = 0, split: str = "test"):
    """``[make_example(task, context_tokens, s, split) for s in range(start_seed, start_seed + n)]``."""
    return [make_example(task, context_tokens, s, split) for s in range(start_seed, start_seed + n)]


def score(generated: str, answer: str) -> bool:
    """Exact match: True iff ``generated`` starts with the full ``answer``.

    Answers end with the terminator ``»``, so anything generated after it is
    ignored while truncated, longer, wrong or empty answers fail.
    """
    if not isinstance(generated, str) or not isinstance(answer, str):
        raise TypeError("score() expects two strings")
    if not answer:
        raise ValueError("answer must be non-empty")
    return generated[: len(answer)] == answer
