"""End-to-end generation: kvtopo.generate (default Config, and lossless) vs HF generate with its
normal cache.

One command: `python bench/generate_speed.py [--prompts 4096 16384 32768] [--new 32] [--model llama-8layer]`.
Each mode runs in its own subprocess so its peak resident memory (ru_maxrss) is its own; the model is
a Llama zoo model (`--model`: `llama`, 2 layers, the default, or `llama-8layer`; tiny either way: the
KV cache, not the weights, is what differs) or the real SmolLM2-135M-Instruct (`--model smollm2`,
`--dtype`; 30 layers of 3 kv-heads of 64 dims, so at long prompts its step reads far more cache
than weights; prompts past its 8K training context are fine for timing, not for quality). For each prompt length, after a
warm-up call at that length (compilation, allocation; `--warmup N`: two calls before all lengths
instead, of N tokens and of N + one prefill chunk, for the real model, whose long prefills take
minutes: the prompt is chunked in the session, so short calls compile the same graphs, but Dynamo
compiles them once more, with dynamic sizes, the first time it meets a second prompt length, which
one warm-up call would leave inside the timed call), each mode times (best of `--reps`) the whole generate call
(prefill + `new` tokens), stamping the end of each forward inside the call, so the time to the
first token and the decode rate (`new - 1` steps over the time from the first token to the last)
come from the same call. Each figure is the best of the reps. `--rounds N` runs the modes'
processes N times in turn (hf, kvtopo, hf, kvtopo, ...) and keeps each figure's best over the rounds:
on a shared machine whose speed drifts between processes, every mode then meets the same drift. Reported per mode and length: total seconds, end-to-end tokens/s
(`new / total`), decode tokens/s, KV bytes held, peak RSS of the process (over all lengths it ran,
so the longest prompt's), and agreement of the greedy tokens with the lossless session's (which
equal a no-cache recomputation with the uncompiled model; at these lengths HF generate's own tokens
drift from that recomputation, so they are no reference). The machine's load before and after is
recorded: ratios within one run are the figures, not absolute times. `--breakdown` also splits
kvtopo's mean decode step into the session's attention op, the C kernel inside it and the rest of
the model (wrapping both adds two clock reads per layer).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from machine import command_line, describe_machine

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("hf", "lossless", "kvtopo")
MODELS = ("llama", "llama-8layer", "smollm2")  # zoo models and the real model (models/pretrained.py)


def _stamped(model):
    """The compiled model inside a module that stamps the end of every forward, for kvtopo.generate
    (decode steps are the forwards of one token after the last prompt chunk)."""
    import torch

    class Stamped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.stamps = model, []
            self.config, self.generation_config = model.config, model.generation_config

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            self.stamps.append((kwargs["input_ids"].shape[1], time.perf_counter()))
            return out

    return Stamped()


class _StampLogits:
    """A logits processor for HF generate: it runs once per forward, right after it."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores):
        self.stamps.append((1, time.perf_counter()))
        return scores


class _DecodeClock:
    """`--breakdown`: seconds spent in decode steps (one-token calls) inside the session's
    attention op (`Session.attend`: the store's bookkeeping, the kernel's arguments) and, within
    it, inside the C decode kernel (its attention and its merge of the partials); the rest of a
    step is the model's other layers."""

    def __init__(self):
        from kvtopo.kernels import cpu_decode
        from kvtopo.runtime.session import Session

        self.attend = self.kernel = 0.0
        inside, clock = [False], self
        attend = Session.attend

        def timed_attend(session, layer, query, *args, **kwargs):
            if query.shape[2] != 1:
                return attend(session, layer, query, *args, **kwargs)
            start, inside[0] = time.perf_counter(), True
            try:
                return attend(session, layer, query, *args, **kwargs)
            finally:
                inside[0] = False
                clock.attend += time.perf_counter() - start

        kernel = cpu_decode.mid_kernel()

        class TimedKernel:  # the kernel's attention and merge are timed (not a decode batch's writes)
            def __getattr__(self, name):
                function = getattr(kernel, name)
                if name not in ("decode_segments", "merge_parts"):
                    return function

                def timed(*args):
                    start = time.perf_counter()
                    try:
                        return function(*args)
                    finally:
                        if inside[0]:
                            clock.kernel += time.perf_counter() - start
                return timed

        Session.attend = timed_attend
        if kernel is not None:
            cpu_decode.mid_kernel = TimedKernel


def build_model(name: str, positions: int, dtype: str):
    """The model to time: a zoo model sized for `positions`, or SmolLM2 in `dtype`."""
    import torch

    if name == "smollm2":
        from kvtopo.models.pretrained import smollm2

        model, _ = smollm2(getattr(torch, dtype))
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, positions)
        return model
    from kvtopo.models import zoo

    return zoo.build(name, max_position_embeddings=positions)


def run_mode(mode: str, model_name: str, prompts: list[int], new: int, reps: int, dtype: str,
             warmup: int | None, breakdown: bool = False, threads: int = 1) -> list[dict]:
    import torch
    from transformers import LogitsProcessorList

    import kvtopo

    torch.set_num_threads(threads)
    model = build_model(model_name, max(prompts) + new + 8, dtype)
    if mode != "hf":
        kvtopo.compile(model, inductor=False)
    config = kvtopo.Config() if mode == "kvtopo" else kvtopo.Config.lossless()
    clock = _DecodeClock() if breakdown and mode != "hf" else None

    def run(ids):
        """(generated ids, KV bytes held, seconds to the first token, seconds of the decode steps)."""
        start = time.perf_counter()
        with torch.no_grad():
            if mode == "hf":
                stamped = _StampLogits()
                out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                     logits_processor=LogitsProcessorList([stamped]))
                kv_bytes, stamps = None, stamped.stamps
            else:
                stamped = _stamped(model)
                with kvtopo.session(config) as s:
                    out = kvtopo.generate(stamped, ids, new, eos_token_id=None, progress=False)
                    kv_bytes = s.stats().total_bytes
                stamps = stamped.stamps[-new:]
        if len(stamps) < new or any(n != 1 for n, _ in stamps[1:]):
            raise RuntimeError(f"{mode}: expected {new} stamped steps, got {[n for n, _ in stamps]}")
        return out, kv_bytes, stamps[0][1] - start, stamps[-1][1] - stamps[0][1]

    def prompt_ids(length: int):
        return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))

    if warmup:  # two lengths: Dynamo recompiles with dynamic sizes when it meets a second one
        run(prompt_ids(warmup))
        run(prompt_ids(warmup + kvtopo.Config().prefill_chunk_size))
    rows = []
    for prompt in prompts:
        ids = prompt_ids(prompt)
        if not warmup:
            run(ids)  # warm-up at this length: compiles its shapes, allocates
        timed = []
        if clock is not None:
            clock.attend = clock.kernel = 0.0
        for _ in range(reps):
            start = time.perf_counter()
            out, kv_bytes, first, decode = run(ids)
            timed.append((time.perf_counter() - start, first, decode))
        total = min(t for t, _, _ in timed)
        first = min(f for _, f, _ in timed)
        decode = min(d for _, _, d in timed)
        rows.append({"mode": mode, "prompt": prompt, "new": new, "total_s": total, "first_token_s": first,
                     "decode_s": decode, "tokens_per_s": new / total, "decode_tokens_per_s": (new - 1) / decode,
                     "kv_bytes": kv_bytes, "tokens": out[0, prompt:].tolist()})
        if clock is not None:  # means over the reps' decode steps (the figures above are bests)
            steps = reps * (new - 1)
            rows[-1]["breakdown_ms_per_step"] = dict(
                step=1e3 * sum(d for _, _, d in timed) / steps, attention_op=1e3 * clock.attend / steps,
                c_kernel=1e3 * clock.kernel / steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for row in rows:
        row["peak_rss_mb"] = rss
    return rows


def best_of_rounds(rows: list[dict]) -> dict:
    """One mode's row for one prompt over the rounds: each time its best (the rates follow), peak
    RSS the largest, the decode breakdown of the round with the best decode; every round's total
    kept. Greedy tokens are the same in every round."""
    best = dict(min(rows, key=lambda r: r["decode_s"]))
    for key in ("total_s", "first_token_s", "decode_s"):
        best[key] = min(r[key] for r in rows)
    best["tokens_per_s"] = best["new"] / best["total_s"]
    best["decode_tokens_per_s"] = (best["new"] - 1) / best["decode_s"]
    best["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rows)
    best["round_totals_s"] = [r["total_s"] for r in rows]
    if any(r["tokens"] != best["tokens"] for r in rows):
        raise SystemExit(f"{best['mode']}: the rounds generated different tokens")
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[4096])
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--reps", type=int, default=2, help="timed calls per length; the best of each figure is kept")
    p.add_argument("--model", choices=MODELS, default="llama", help="zoo model (default llama: 2 layers) or smollm2")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="smollm2's dtype")
    p.add_argument("--out", type=Path, default=RESULTS / "generate_speed.json")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="modes to run, in this order (hf, the baseline, always runs; without lossless there is no agreement)")
    p.add_argument("--warmup", type=int, help="warm-up calls of this many tokens and of one prefill chunk more, "
                                                 "instead of one per length")
    p.add_argument("--breakdown", action="store_true",
                   help="also time, per decode step, kvtopo's attention op and the C kernel inside it")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every mode (1: steadier on a shared machine)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the modes' processes this many times in turn (hf, kvtopo, hf, kvtopo, ...) and keep "
                        "each figure's best over all rounds, so that a drift of the machine's speed between "
                        "processes reaches every mode alike")
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.new < 2:
        p.error("--new must be >= 2 (the decode rate is measured beyond the first token)")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.model, args.prompts, args.new, args.reps, args.dtype, args.warmup,
                                  args.breakdown, args.threads)))
        return
    load_before = os.getloadavg()
    modes = list(dict.fromkeys(args.modes if "hf" in args.modes else ["hf", *args.modes]))  # run in this order
    runs = {mode: [] for mode in modes}  # per mode, each round's rows
    for round_ in range(args.rounds):
        for mode in modes:
            print(f"running {mode} at {args.prompts} (round {round_ + 1} of {args.rounds}) ...", flush=True)
            done = subprocess.run([sys.executable, __file__, "--mode", mode, "--model", args.model,
                                   "--prompts", *map(str, args.prompts),
                                   "--new", str(args.new), "--reps", str(args.reps), "--dtype", args.dtype,
                                   "--threads", str(args.threads),
                                   *(["--warmup", str(args.warmup)] if args.warmup else []),
                                   *(["--breakdown"] if args.breakdown else [])],
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    by_mode = {mode: [best_of_rounds([rows[i] for rows in rounds]) for i in range(len(args.prompts))]
               for mode, rounds in runs.items()}
    rows = []
    print(f"{'prompt':>7} {'mode':9} {'total s':>8} {'tok/s vs HF':>11} {'decode tok/s vs HF':>18} "
          f"{'peak RSS MB':>11} {'KV bytes':>10} {'= lossless':>10}")
    for i, prompt in enumerate(args.prompts):
        hf, exact = by_mode["hf"][i], by_mode.get("lossless", [None] * len(args.prompts))[i]
        for mode in modes:
            r = by_mode[mode][i]
            r["agreement_with_lossless"] = (None if exact is None else
                                            sum(a == b for a, b in zip(r["tokens"], exact["tokens"])) / len(exact["tokens"]))
            r["tokens_per_s_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
            r["decode_tokens_per_s_vs_hf"] = r["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
            rows.append(r)
            print(f"{prompt:7d} {mode:9} {r['total_s']:8.2f} {r['tokens_per_s_vs_hf']:11.2f} "
                  f"{r['decode_tokens_per_s_vs_hf']:18.2f} {r['peak_rss_mb']:11.0f} {str(r['kv_bytes']):>10} "
                  f"{'-' if exact is None else format(r['agreement_with_lossless'], '.0%'):>10}")
            if "breakdown_ms_per_step" in r:
                b = r["breakdown_ms_per_step"]
                print(f"{'':17} decode step {b['step']:.2f} ms: attention op {b['attention_op']:.2f} ms "
                      f"(C kernel {b['c_kernel']:.2f}), the rest of the model {b['step'] - b['attention_op']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "threads": args.threads, "rounds": args.rounds, "model": "SmolLM2-135M-Instruct" if args.model == "smollm2" else f"{args.model} zoo",
                                    "dtype": args.dtype if args.model == "smollm2" else "float32", "reps": args.reps,
                                    "load_avg_before": [round(x, 2) for x in load_before],
                                    "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                                    "command": command_line(__file__), "machine": describe_machine()}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
