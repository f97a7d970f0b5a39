"""What a batched decode step costs per layer outside the C kernel, by batch size.

    python bench/decode_python.py [--batches 1 4 16] [--length 1024] [--steps 96] [--rounds 3]
                                  [--layer smollm2|llama3-8b] [--threads 1] [--per-sequence] [--out FILE]

The decode step a `Session` runs for a batch of sequences in one layer (its layer's `DecodeBatch`,
runtime/decode_batch.py, from the second step on; with `--per-sequence` the path without it,
`Session._decode_batch`: each token written in place or appended, one batched kernel call, the
queries observed, in a Python loop over the sequences) is timed
on a real `kvtopo.session(kvtopo.Config())` store: `--batches` sequences of structured K/V (see
bench/decode_speed.py) grown to about `--length` tokens, staggered by 7 tokens each so that their
pages fill on different steps, as in a serving batch. Each round times `--steps` steps (page moves
included) twice: with the C kernel (`step`), and with the kernel's calls replaced by ones that do
nothing (`python`: what the step costs around the kernel). Reports each batch size's median and
mean per step over all rounds; the median of the steps in which a sequence opened a page
(`moving_median_us`: its pages moved between phases), of the steps right after those
(`after_move_median_us`: the decode views of what moved are rebuilt in them) and of the others
(`steady_median_us`); and `python` per sequence: the figure that says how
far the decode path is from costing the same Python at every batch size. Writes
bench/results/decode_python.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvtopo  # noqa: E402
from decode_speed import grow_sequence, structured_kv  # noqa: E402
from kernel_ab import LAYERS  # noqa: E402
from machine import command_line, describe_machine  # noqa: E402
from kvtopo.kernels import cpu_decode  # noqa: E402
from kvtopo.runtime.session import Session  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STAGGER = 7  # tokens between neighbouring sequences' lengths


class _NullKernel:
    """The C kernel's attention and merge doing nothing (merged output zeros): the step's Python
    alone. The store does not read attention outputs, so the steps still move the same pages.
    A decode batch's writes (`begin_step`: tokens into the pool, counts, scaled queries) are the
    store's work, so they run in the real kernel."""

    real = None

    def decode_segments(self, tensors, ints, threads, softcap) -> None:
        pass

    def merge_parts(self, outs, lses, first, merged) -> None:
        merged.zero_()

    def begin_step(self, *args) -> None:
        self.real.begin_step(*args)


@contextlib.contextmanager
def kernel_replaced():
    real = cpu_decode.mid_kernel
    _NullKernel.real = real()
    cpu_decode.mid_kernel = _NullKernel
    try:
        yield
    finally:
        cpu_decode.mid_kernel = real


def batch_store(batch: int, length: int, layer: tuple[int, int, int], scale: float):
    """A session with `batch` sequences in layer "layer0", sequence b grown to length + 7b % page."""
    hq, hkv, d = layer
    session = kvtopo.session(kvtopo.Config())
    session.__enter__()
    page = session.config.page_size
    q = torch.randn(batch, hq, 1, d, generator=torch.Generator().manual_seed(1)) * 0.3
    for b in range(batch):
        keys, values = structured_kv(length + page, seed=b, kv_heads=hkv, head_dim=d)
        grow_sequence(session, b, q[b], keys, values, scale, 0, length + STAGGER * b % page)
    return session, q


def time_steps(session, cache, seqs: list[int], q, k_new, v_new, scale: float, steps: int,
               per_sequence: bool = False) -> list[tuple[float, bool]]:
    """(seconds, whether a sequence opened a page: its pages moved) of each of `steps` steps:
    the step a `Session` runs (its `DecodeBatch` where it takes the batch), or with
    `per_sequence` the path without it (`Session._decode_batch`)."""
    times = []
    for _ in range(steps):
        pages = sum(cache.page_count(seq) for seq in seqs)
        start = time.perf_counter()
        if per_sequence:
            Session._decode_batch(cache, seqs, q, k_new, v_new, scale, None)
        else:
            session._attend_and_store(cache, seqs, q, k_new, v_new, scale, None, None, None)
        elapsed = time.perf_counter() - start
        times.append((elapsed, sum(cache.page_count(seq) for seq in seqs) != pages))
    return times


def measure(batch: int, args, layer: tuple[int, int, int]) -> dict:
    hq, hkv, d = layer
    scale = d ** -0.5
    gen = torch.Generator().manual_seed(2)
    k_new, v_new = (torch.randn(batch, hkv, 1, d, generator=gen) for _ in range(2))
    times = {"step": [], "python": []}
    for _ in range(args.rounds):
        for name in times:  # a fresh store per measurement: both see the same page moves
            session, q = batch_store(batch, args.length, layer, scale)
            try:
                cache, seqs = session.layers["layer0"], list(range(batch))
                with kernel_replaced() if name == "python" else contextlib.nullcontext():
                    time_steps(session, cache, seqs, q, k_new, v_new, scale, 2, args.per_sequence)  # warm-up
                    times[name] += time_steps(session, cache, seqs, q, k_new, v_new, scale, args.steps,
                                              args.per_sequence)
            finally:
                session.__exit__(None, None, None)
    row = {"batch": batch}
    for name, values in times.items():
        every = [t for t, _ in values]
        kinds = {"steady": [], "moving": [], "after_move": []}
        for i, (t, moved) in enumerate(values):  # each round's first step follows its warm-up steps
            kinds["moving" if moved else "after_move" if i and values[i - 1][1] else "steady"].append(t)
        row[name] = {"median_us": 1e6 * statistics.median(every), "mean_us": 1e6 * statistics.mean(every),
                     **{f"{kind}_median_us": 1e6 * statistics.median(ts) if ts else None for kind, ts in kinds.items()},
                     "steps_moving_pages": len(kinds["moving"]), "steps": len(values)}
    row["python_per_sequence_us"] = {k: v / batch for k, v in row["python"].items()
                                     if k.endswith("_us") and v is not None}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layer", choices=sorted(LAYERS), default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--per-sequence", action="store_true",
                    help="time the decode path without DecodeBatch (Session._decode_batch), for an A/B")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_python.json")
    args = ap.parse_args()
    if min(args.batches) < 1 or args.steps < 1 or args.rounds < 1 or args.length < 64:
        ap.error("--batches, --steps and --rounds must be at least 1, --length at least 64")
    if not cpu_decode.c_kernel_available():
        raise SystemExit("decode_python: the C kernel did not build; this bench times the path that uses it")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for batch in args.batches:
        rows.append(measure(batch, args, LAYERS[args.layer]))
        r = rows[-1]
        kinds = ", ".join(f"{kind} {'-' if r['python'][f'{kind}_median_us'] is None else round(r['python'][f'{kind}_median_us'])}"
                          for kind in ("steady", "moving", "after_move"))
        print(f"batch {batch:3d}: step median {r['step']['median_us']:8.0f} us (mean {r['step']['mean_us']:8.0f}); "
              f"python median {r['python']['median_us']:8.0f} us (mean {r['python']['mean_us']:8.0f}; medians: {kinds}); "
              f"per sequence {r['python_per_sequence_us']['mean_us']:6.1f} us (mean)", flush=True)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    result = {
        "benchmark": "decode_python",
        "revision": revision,
        "layer": dict(zip(("q_heads", "kv_heads", "head_dim"), LAYERS[args.layer]), name=args.layer),
        "config": "Config()",
        "length": args.length,
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "path": "per_sequence" if args.per_sequence else "session",
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "command": command_line(__file__),
        "machine": describe_machine(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
