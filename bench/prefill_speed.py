"""Prefill time of a long prompt under the default compression vs the lossless session.

One command: `python bench/prefill_speed.py [--prompts 4096 8192] [--chunks 4096 512] [--repeats 3]
[--out prefill_speed.json] [--profile]`. The model is the Llama zoo model (tiny: the store's
work, not the model's, is what differs), compiled with `kvtopo.compile(model, inductor=False)`,
on 1 torch thread. Each case is `kvtopo.generate(model, ids, 1)` (prefill in chunks of `chunk`
tokens, then the first token from the last chunk's logits: no decode step), timed after a
warm-up; Config(), Config(prompt_hold_tokens=0) (each chunk's pages enter Mid as it pushes them
out of Recent) and lossless runs alternate within the same process, and each mode's best of
`repeats` is reported with its ratio to lossless. The warm-up also records the most bytes the
store held after any chunk (what waiting pages cost while the prompt is read). The 1-minute load average is recorded
before and after (the machine may be shared). `--profile` adds a cProfile breakdown of one
Config() prefill per case (top functions by own time). Writes bench/results/<out>.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

import kvtopo
from kvtopo.models import zoo
from machine import command_line, describe_machine

RESULTS = Path(__file__).resolve().parent / "results"
MODES = {"lossless": kvtopo.Config.lossless, "config": kvtopo.Config,
         "no_hold": lambda: kvtopo.Config(prompt_hold_tokens=0)}


def prefill(model, ids: torch.Tensor, config: kvtopo.Config, chunk: int, peak: bool = False) -> tuple[int, int]:
    """One prefill of `ids` in a fresh session: (the bytes the store holds after it, the most it
    held after any chunk; with `peak` only, for the stats it reads after every chunk cost time)."""
    with kvtopo.session(config) as s:
        most, step = [0], s.step

        @contextlib.contextmanager
        def counted(*args, **kwargs):
            with step(*args, **kwargs) as inside:
                yield inside
            most[0] = max(most[0], s.stats().total_bytes)

        if peak:
            s.step = counted
        kvtopo.generate(model, ids, 1, prefill_chunk_size=chunk, progress=False)
        return s.stats().total_bytes, most[0]


def profile(model, ids: torch.Tensor, chunk: int, top: int = 25) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    prefill(model, ids, kvtopo.Config(), chunk)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--chunks", type=int, nargs="+", default=[4096, 512])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="prefill_speed.json")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(1)
    model = zoo.build("llama", max_position_embeddings=max(args.prompts) + 8)
    kvtopo.compile(model, inductor=False)
    load_before = os.getloadavg()
    rows, profiles = [], {}
    with torch.no_grad():
        for prompt in args.prompts:
            ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(0))
            for chunk in args.chunks:
                times = {mode: [] for mode in MODES}
                kv_bytes, peak_bytes = {}, {}
                for mode, make in MODES.items():  # warm-up: compiles this chunk shape, allocates
                    kv_bytes[mode], peak_bytes[mode] = prefill(model, ids, make(), chunk, peak=True)
                for _ in range(args.repeats):
                    for mode, make in MODES.items():
                        start = time.perf_counter()
                        prefill(model, ids, make(), chunk)
                        times[mode].append(time.perf_counter() - start)
                best = {mode: min(t) for mode, t in times.items()}
                row = {"prompt": prompt, "chunk": chunk, "lossless_s": best["lossless"], "config_s": best["config"],
                       "no_hold_s": best["no_hold"], "ratio": best["config"] / best["lossless"],
                       "no_hold_ratio": best["no_hold"] / best["lossless"], "times": times, "kv_bytes": kv_bytes,
                       "peak_kv_bytes": peak_bytes, "load_1min": os.getloadavg()[0]}
                rows.append(row)
                print(f"prompt {prompt:6} chunk {chunk:5}: lossless {row['lossless_s']:7.3f}s  "
                      f"Config() {row['config_s']:7.3f}s ({row['ratio']:4.2f}x)  "
                      f"no hold {row['no_hold_s']:7.3f}s ({row['no_hold_ratio']:4.2f}x)  peak KV MB "
                      + " / ".join(f"{m} {b / 2**20:.1f}" for m, b in peak_bytes.items())
                      + f"  load {row['load_1min']:.2f}", flush=True)
                if args.profile:
                    profiles[f"{prompt}/{chunk}"] = profile(model, ids, chunk)
                    print(profiles[f"{prompt}/{chunk}"], flush=True)
    result = {"model": "llama zoo", "config": repr(kvtopo.Config()), "threads": 1, "repeats": args.repeats,
              "statistic": "best of repeats",
              "load_before": load_before, "load_after": os.getloadavg(), "command": command_line(__file__), "machine": describe_machine(), "rows": rows}
    if profiles:
        result["profiles"] = profiles
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {RESULTS / args.out}")


if __name__ == "__main__":
    main()
