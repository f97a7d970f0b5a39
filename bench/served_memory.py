"""Peak resident memory of serving with transformers' continuous batching: kvtopo's store as its KV
cache (serving/continuous_batching.py) against the engine's own paged cache, on the same prompts.

Each mode runs in its own subprocess, so its peak RSS (`ru_maxrss`) is its own: the model is
loaded, `--prompts` prompts of `--prompt-tokens` random ids are served greedily for `--new-tokens`
tokens each, `--max-batch-tokens` tokens per forward. Modes:
- `kvtopo`: `generate_batch(model, prompts, Config())`;
- `kvtopo-lossless`: the same with `Config.lossless()`;
- `engine`: transformers' `model.generate_batch` with its own cache, which it sizes to the memory
  it finds free (on CPU, most of the machine's: `ContinuousBatchingConfig.max_memory_percent`).
Reported per mode: resident memory before serving (the model loaded), the most it reached while
serving (sampled every 20 ms), the process's peak (`ru_maxrss`, loading included), the session's
peak KV bytes (kvtopo), and the wall time. The JSON records the commit and any uncommitted change to the code it ran.

    python bench/served_memory.py [--model smollm2|zoo-llama] [--prompts 4] [--prompt-tokens 2048]
                                  [--modes kvtopo kvtopo-lossless engine] [--out bench/results/served_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from machine import describe_machine

ROOT = Path(__file__).resolve().parents[1]
MODES = ("kvtopo", "kvtopo-lossless", "engine")


def resident_mb() -> float:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


class PeakResident:
    """The most resident memory sampled every `every` seconds while the `with` block runs: serving's
    own peak (`ru_maxrss` is the process's, loading the model included)."""

    def __init__(self, every: float = 0.02):
        self.every, self.peak_mb, self._done = every, 0.0, threading.Event()

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak_mb = max(self.peak_mb, resident_mb())
            self._done.wait(self.every)

    def __enter__(self) -> "PeakResident":
        self.peak_mb = resident_mb()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak_mb = max(self.peak_mb, resident_mb())


def load(model_name: str, dtype: torch.dtype):
    if model_name == "smollm2":
        from kvtopo.models.pretrained import smollm2

        return smollm2(dtype)[0]
    from kvtopo.models import zoo

    return zoo.build("llama").to(dtype)


def serve(args) -> dict:
    """One mode in this process (the subprocess `main` starts)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    torch.set_num_threads(args.threads)
    model = load(args.model, getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, model.config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.prompts)]
    greedy = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    engine = ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens)
    before, started, kv_peak = resident_mb(), time.perf_counter(), None
    with torch.no_grad(), PeakResident() as serving:
        if args.mode == "engine":
            out = model.generate_batch(prompts, generation_config=greedy, max_new_tokens=args.new_tokens,
                                       continuous_batching_config=engine, warmup=False)
        else:
            from kvtopo.config import Config
            from kvtopo.serving.continuous_batching import generate_batch

            config = Config.lossless() if args.mode == "kvtopo-lossless" else Config()
            result = generate_batch(model, prompts, config, max_new_tokens=args.new_tokens, generation_config=greedy,
                                    continuous_batching_config=engine)
            out, kv_peak = result.outputs, result.peak.total_bytes
    generated = sum(len(o.generated_tokens) for o in out.values())
    return dict(mode=args.mode, rss_before_mb=before, serving_peak_rss_mb=serving.peak_mb,
                process_peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                kv_peak_mb=None if kv_peak is None else kv_peak / 2 ** 20, generated_tokens=generated,
                seconds=time.perf_counter() - started)


def code_state() -> dict:
    """The commit the run's code is at, and the tracked files it had changed (a run of older code)."""

    def git(*argv):
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no")
    return dict(commit=git("rev-parse", "HEAD"), uncommitted=changed.split("\n") if changed else [])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=("smollm2", "zoo-llama"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in the subprocess
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "served_memory.json")
    args = p.parse_args(argv)
    if min(args.prompts, args.prompt_tokens, args.new_tokens, args.max_batch_tokens, args.threads) < 1:
        p.error("--prompts, --prompt-tokens, --new-tokens, --max-batch-tokens and --threads must be >= 1")
    if args.mode:
        print(json.dumps(serve(args)))
        return {}
    rows = []
    forwarded = list(argv if argv is not None else sys.argv[1:])
    for mode in args.modes:
        print(f"{mode}: serving {args.prompts} x {args.prompt_tokens} tokens ...", flush=True)
        run = subprocess.run([sys.executable, __file__, *forwarded, "--mode", mode], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{mode} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        kv = "" if r["kv_peak_mb"] is None else f", session KV peak {r['kv_peak_mb']:.1f} MB"
        print(f"  RSS before serving {r['rss_before_mb']:.0f} MB, while serving at most "
              f"{r['serving_peak_rss_mb']:.0f} MB{kv}, {r['generated_tokens']} tokens in {r['seconds']:.1f} s", flush=True)
    report = dict(meta=dict(command=" ".join(["bench/served_memory.py", *forwarded]), model=args.model,
                            dtype=args.dtype, prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                            new_tokens=args.new_tokens, max_batch_tokens=args.max_batch_tokens, threads=args.threads,
                            machine=describe_machine(), **code_state()),
                  rows=rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
