"""Which layers keep a needle's value after topo's eviction, on SmolLM2 (bench/real_quality.py's tasks).

An accuracy cell says how often a needle was lost, not where. This runs the same examples and
conversation as bench/real_quality.py and records, for every layer and kv-head, how many of the
answer's tokens survive the joint eviction plan that moves the context into Mid (tokens outside
the plan -- exact and Recent pages -- count as kept). Example:

    python bench/needle_survival.py --task niah_number --setting agnostic --seed-offset 1000 \\
        --out bench/results/needle_survival/number_agnostic_val.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402
import real_quality as RQ  # noqa: E402
from machine import command_line, describe_machine  # noqa: E402

import kvtopo  # noqa: E402
from kvtopo.models import real_tasks as R  # noqa: E402
from kvtopo.runtime import layer_cache  # noqa: E402


@contextlib.contextmanager
def recorded_plans():
    """Yields a list that receives (layer cache, plan) for every non-empty joint eviction plan."""
    plans, planner = [], layer_cache.LayerCache._plan_joint_eviction

    def recording(self, entry, key, value):
        plan = planner(self, entry, key, value)
        if plan:
            plans.append((self, plan))
        return plan

    layer_cache.LayerCache._plan_joint_eviction = recording
    try:
        yield plans
    finally:
        layer_cache.LayerCache._plan_joint_eviction = planner


def kept_in_span(plan: dict, page_size: int, kv_heads: int, span: tuple[int, int]) -> list[int]:
    """Per kv-head, how many tokens of [start, end) a plan ({page: kept indices [Hkv, n]}) keeps;
    tokens of pages the plan does not cover are kept."""
    start, end = span
    kept = torch.ones(kv_heads, end - start, dtype=torch.bool)
    for page, tokens in plan.items():
        lo, hi = max(page * page_size, start), min((page + 1) * page_size, end)
        if lo >= hi:
            continue
        kept[:, lo - start:hi - start] = False
        for head in range(kv_heads):
            index = page * page_size + tokens[head].long()
            index = index[(index >= lo) & (index < hi)]
            kept[head, index - start] = True
    return kept.sum(-1).tolist()


def answer_span(prompts: RQ.Prompts, ids: list[int], answer: str) -> tuple[int, int]:
    """The fewest tokens [start, end) of `ids` whose decoding contains `answer`."""
    end = prompts.end_of(answer, ids)
    start = end - 1
    while answer not in prompts.tokenizer.decode(ids[start:end]):
        start -= 1
    return start, end


def summarise(rows: list[dict]) -> dict:
    """Mean count of layers, over examples answered right and wrong, where the answer is dropped
    whole in every kv-head and where some kv-head keeps it whole."""
    out = {}
    for label, group in (("correct", [r for r in rows if r["correct"]]), ("wrong", [r for r in rows if not r["correct"]])):
        width = [r["span"][1] - r["span"][0] for r in group]
        dropped = [sum(max(layer) == 0 for layer in r["kept"]) for r in group]
        whole = [sum(max(layer) == w for layer in r["kept"]) for r, w in zip(group, width)]
        out[label] = dict(examples=len(group),
                          layers_dropped=sum(dropped) / len(group) if group else None,
                          layers_whole=sum(whole) / len(group) if group else None)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="niah_number", choices=sorted(R.TASKS))
    parser.add_argument("--setting", default="agnostic", choices=RQ.SETTINGS)
    parser.add_argument("--ratio", type=float, default=4.0, help="topo's nominal target_ratio")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--seed-offset", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    quality.WINDOWS.clear()
    quality.WINDOWS.update(RQ.WINDOWS)
    from kvtopo.models.pretrained import smollm2

    model, tokenizer = smollm2(getattr(torch, args.dtype))
    kvtopo.compile(model, inductor=False)
    prompts = RQ.Prompts(tokenizer)
    eos = RQ.eos_ids(model)
    config = quality.base_config(policy="topo", target_ratio=args.ratio)
    kv_heads = model.config.num_key_value_heads
    rows, started = [], time.time()
    for seed in range(args.seed_offset, args.seed_offset + args.examples):
        example = R.make_example(args.task, args.length, seed, prompts.count)
        segments = prompts.segments(example)
        question = example.questions[0]
        span = answer_span(prompts, segments["context"], question.answers[0])
        turns, max_new = RQ.conversation(segments, args.setting)
        with recorded_plans() as plans:
            answers, memory = RQ.run_kvtopo(model, config, turns, max_new, eos)
        first = {}  # each layer's first plan: the one that moved the context into Mid
        for cache, plan in plans:
            first.setdefault(id(cache), plan)
        text = tokenizer.decode(answers[0], skip_special_tokens=True)
        rows.append(dict(seed=seed, correct=bool(R.score(text, question)), answer=text, span=list(span),
                         ratio=memory[0]["ratio"],
                         kept=[kept_in_span(plan, config.page_size, kv_heads, span) for plan in first.values()]))
        print(f"seed {seed}: {'right' if rows[-1]['correct'] else 'wrong'}, answer tokens {span}, "
              f"dropped in {sum(max(k) == 0 for k in rows[-1]['kept'])} of {len(first)} layers "
              f"({time.time() - started:.0f} s)", flush=True)
    result = dict(args={k: str(v) for k, v in vars(args).items()}, summary=summarise(rows), rows=rows,
                  command=command_line(__file__, argv), machine=describe_machine())
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
