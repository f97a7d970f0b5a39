"""One needle, several Configs, on SmolLM2-135M-Instruct: a quick check of what a coding choice does.

    python bench/needle_configs.py                          # ~740-token prompts, every config, 4 examples
    python bench/needle_configs.py --tokens 1900 --configs full default projected-0.9
    python bench/needle_configs.py --ranks                  # per-head ranks at 0.9/0.95/0.99 energy

Validation examples (not bench/real_quality.py's generator or seeds): "The special magic number
for <city> is <7 digits>." at depth (i + 0.5) / n of ~``--tokens`` of CPython doc prose (a random
start per example), the question after it, the whole prompt in one prefill chunk, and the
answer's opening "The special magic number for <city> is" appended, so 9 greedy tokens show the
digits. Float32 model compiled without Inductor. Each row: needles found and the mean achieved
``ratio_vs_fp16`` (float32 exact pages cost twice their fp16 bytes).

Writes bench/results/needle_configs_<tokens>.json. Measured (``--examples 6``, prompts 717-774
tokens, ``needle_configs_600.json``; the 2 cores shared with other jobs; every config then had
the 64-token int8 Recent window, ``recent-64-8bit`` now):

    config                       found   achieved vs fp16
    full                          6/6    0.47x (float32 pages)
    default (8x)                  5/6    2.66x
    default-4x                    6/6    2.14x (budget missed: the exact pages alone exceed 4x)
    default-no-eviction           6/6    2.13x
    projected-0.9 (8x)            0/6    2.36x
    projected-0.9-no-eviction     2/6    2.32x
    energy-0.99-no-eviction       6/6    1.84x
    energy-1.0-no-eviction        6/6    1.75x
    energy-1.0-8x                 3/6    2.19x
    snapkv-8x                     0/6    1.97x

Directional pruning at 0.9 energy loses the needle even with nothing evicted; at 0.99 the
fp16 bases cost more than the pruning saves; plain 4-bit codes keep it, and with eviction at
8x (the default) lose one of six (a wrong digit run, "80674000"). A full-rank basis (1.0
energy: a rotation with per-direction statistics) is no better than plain codes and costs its
bases.
``--ranks`` (printed, not saved) on example 0's prose with the needle in the middle (748 tokens), mean rank of 64 dims over 30 layers x 3 kv-heads at
0.9 / 0.95 / 0.99 energy: keys 35.4 / 44.5 / 57.1, values 41.3 / 50.1 / 60.4.
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch

import kvtopo
from kvtopo.kernels.directions import principal_basis
from kvtopo.models.pretrained import chat_prompt, smollm2
from kvtopo.models.real_tasks import has_number, prose_run
from machine import command_line, describe_machine

CITIES = ["Oslo", "Lima", "Cairo", "Quito", "Hanoi", "Dakar", "Perth", "Tunis"]
PROJECTED = dict(key_energy=0.9, value_energy=0.9)
CONFIGS = {
    "full": kvtopo.Config.lossless(),
    "default": kvtopo.Config(),  # topo at 8x, 4-bit Mid codes, no projection
    "default-4x": kvtopo.Config(target_ratio=4),
    "default-no-eviction": kvtopo.Config(target_ratio=None),
    "projected-0.9": kvtopo.Config(**PROJECTED),  # the default before projection became opt-in
    "projected-0.9-no-eviction": kvtopo.Config(target_ratio=None, **PROJECTED),
    "energy-0.99-no-eviction": kvtopo.Config(target_ratio=None, key_energy=0.99, value_energy=0.99),
    "energy-1.0-no-eviction": kvtopo.Config(target_ratio=None, key_energy=1.0, value_energy=1.0),
    "energy-1.0-8x": kvtopo.Config(key_energy=1.0, value_energy=1.0),
    "snapkv-8x": kvtopo.Config(policy="snapkv"),
    # the default Recent window until bench/fidelity_configs.py measured it (now 256)
    "recent-64-8bit": kvtopo.Config(recent_tokens=64, recent_bits=8),
    "recent-4bit": kvtopo.Config(recent_bits=4),  # the 256-token window as 4-bit codes
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
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default bench/results/needle_configs_<tokens>.json)")
    args = parser.parse_args()
    model, tokenizer = smollm2(torch.float32)
    if args.ranks:
        print_ranks(model, needle_example(tokenizer, args.tokens, 0.5, 0)[0])
        return
    kvtopo.compile(model, inductor=False)
    out_path = args.out or Path(__file__).resolve().parent / "results" / f"needle_configs_{args.tokens}.json"
    started, rows = time.perf_counter(), {}
    for name in args.configs:
        config = CONFIGS[name].replace(prefill_chunk_size=8192)
        examples, start = [], time.perf_counter()
        for i in range(args.examples):
            ids, number = needle_example(tokenizer, args.tokens, (i + 0.5) / args.examples, i)
            with kvtopo.session(config) as s:
                out = kvtopo.generate(model, ids, max_new_tokens=9)
                ratio = s.stats().ratio_vs_fp16
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            found = has_number(number, answer)
            examples.append(dict(tokens=ids.shape[1], number=number, answer=answer, found=found, ratio=ratio))
            print(f"  {name} example {i}: {ids.shape[1]} tokens, {answer!r} ({'found' if found else 'MISSED'} "
                  f"{number}), {ratio:.2f}x", flush=True)
        found = sum(e["found"] for e in examples)
        mean_ratio = sum(e["ratio"] for e in examples) / len(examples)
        rows[name] = dict(config=repr(config), found=found, examples=examples, mean_ratio_vs_fp16=mean_ratio,
                          seconds=time.perf_counter() - start)
        print(f"{name}: {found}/{args.examples} found, mean {mean_ratio:.2f}x vs fp16 "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    meta = dict(tokens=args.tokens, examples=args.examples, dtype="float32", torch=torch.__version__,
                command=command_line(__file__), machine=describe_machine(), seconds=time.perf_counter() - started)
    out_path.write_text(json.dumps(dict(meta=meta, configs=rows), indent=1) + "\n")
    print(f"wrote {out_path}")

if __name__ == "__main__":
    main()
