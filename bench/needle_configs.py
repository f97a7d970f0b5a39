"""One needle, several Configs, on SmolLM2-135M-Instruct: a quick check of what a coding choice does.

    python bench/needle_configs.py                          # ~740-token prompts, every config, 4 examples
    python bench/needle_configs.py --tokens 1900 --configs default no-projection-8x full
    python bench/needle_configs.py --ranks                  # per-head ranks at 0.9/0.95/0.99 energy

Validation examples (not bench/real_quality.py's generator or seeds): "The special magic number
for <city> is <7 digits>." at depth (i + 0.5) / n of ~``--tokens`` of CPython doc prose (a random
start per example), the question after it, the whole prompt in one prefill chunk, and the
answer's opening "The special magic number for <city> is" appended, so 9 greedy tokens show the
digits. Float32 model compiled without Inductor. Each row: needles found and the mean achieved
``ratio_vs_fp16`` (float32 exact pages cost twice their fp16 bytes).

Measured here (4 examples, prompts 717-774 tokens): full 4/4 at 0.48x; default (projection at 0.9
energy, 4-bit, 8x) 0/4 at 2.34x; default without eviction 2/4 at 2.31x; projection at 0.99 energy
without eviction 4/4 at 1.84x; 4-bit codes without projection, without eviction 4/4 at 2.13x, at 8x
4/4 at 2.64x; a full-rank basis (1.0 energy: a rotation, per-direction 4-bit statistics for keys and
values, the bases' float16 columns held) without eviction 4/4 at 1.75x, at 8x 3/4 at 2.17x (one digit
lost). Prompts of 2,039-2,058 tokens: default 2/4 at 4.68x, no projection at 8x 3/4 at 5.11x.
``--ranks`` on example 0's prose with the needle in the middle (748 tokens), mean rank of 64 dims over 30 layers x 3 kv-heads at
0.9 / 0.95 / 0.99 energy: keys 35.4 / 44.5 / 57.1, values 41.3 / 50.1 / 60.4.
"""

import argparse
import random
import time

import torch

import kvtopo
from kvtopo.kernels.directions import principal_basis
from kvtopo.models.pretrained import chat_prompt, smollm2
from kvtopo.models.real_tasks import prose_run

CITIES = ["Oslo", "Lima", "Cairo", "Quito", "Hanoi", "Dakar", "Perth", "Tunis"]
NO_PROJECTION = dict(key_energy=None, value_energy=None)
CONFIGS = {
    "full": kvtopo.Config.lossless(),
    "default": kvtopo.Config(),
    "default-no-eviction": kvtopo.Config(target_ratio=None),
    "energy-0.99-no-eviction": kvtopo.Config(target_ratio=None, key_energy=0.99, value_energy=0.99),
    "no-projection-no-eviction": kvtopo.Config(target_ratio=None, **NO_PROJECTION),
    "no-projection-8x": kvtopo.Config(**NO_PROJECTION),
    "energy-1.0-no-eviction": kvtopo.Config(target_ratio=None, key_energy=1.0, value_energy=1.0),
    "energy-1.0-8x": kvtopo.Config(key_energy=1.0, value_energy=1.0),
}


def needle_example(tokenizer, tokens: int, depth: float, seed: int) -> tuple[torch.Tensor, str]:
    rng = random.Random(1000 + seed)
    doc = prose_run(rng, tokens, lambda text: len(tokenizer(text, add_special_tokens=False).input_ids))
    city, number = CITIES[seed % len(CITIES)], str(rng.randrange(10**6, 10**7))
    doc.insert(round(depth * len(doc)), f"The special magic number for {city} is {number}.")
    question = f"What is the special magic number for {city}? Answer with the number only."
    ids = chat_prompt(tokenizer, "Read the document and answer the question.\n\n" + "\n\n".join(doc) + "\n\n" + question)
    opening = tokenizer(f"The special magic number for {city} is", add_special_tokens=False, return_tensors="pt")
    return torch.cat([ids, opening.input_ids], 1), number


def print_ranks(model, ids) -> None:
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    for side in ("keys", "values"):
        means = []
        for energy in (0.9, 0.95, 0.99):
            ranks = [principal_basis(head.float(), energy).rank
                     for layer in cache.layers for head in getattr(layer, side)[0]]
            means.append(f"{sum(ranks) / len(ranks):.1f}")
        print(f"{side}: mean rank at 0.9 / 0.95 / 0.99 energy: {' / '.join(means)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=600, help="prose tokens around the needle")
    parser.add_argument("--examples", type=int, default=4)
    parser.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--ranks", action="store_true", help="only print the heads' ranks on the first prompt")
    args = parser.parse_args()
    model, tokenizer = smollm2(torch.float32)
    if args.ranks:
        print_ranks(model, needle_example(tokenizer, args.tokens, 0.5, 0)[0])
        return
    kvtopo.compile(model, inductor=False)
    for name in args.configs:
        config = CONFIGS[name].replace(prefill_chunk_size=8192)
        found, ratios, start = 0, [], time.perf_counter()
        for i in range(args.examples):
            ids, number = needle_example(tokenizer, args.tokens, (i + 0.5) / args.examples, i)
            with kvtopo.session(config) as s:
                out = kvtopo.generate(model, ids, max_new_tokens=9)
                ratios.append(s.stats().ratio_vs_fp16)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            found += number in answer
            print(f"  {name} example {i}: {ids.shape[1]} tokens, {answer!r} ({'found' if number in answer else 'MISSED'} "
                  f"{number}), {ratios[-1]:.2f}x", flush=True)
        print(f"{name}: {found}/{args.examples} found, mean {sum(ratios) / len(ratios):.2f}x vs fp16 "
              f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
