"""Two builds of the CPU decode kernel, timed alternately on the same store: is a change faster?

    python bench/kernel_ab.py --base HEAD~1 [--candidate WORKTREE] [--configs default 8x]
                              [--layer llama3-8b|smollm2] [--length 32768] [--threads 1]
                              [--rounds 12] [--calls 40]

On this shared machine the speed of a core drifts by 10-20% between runs minutes apart, so two
runs of bench/decode_speed.py cannot tell a 5% change of the kernel from the drift. Here both
builds (kernels/csrc/mid_decode.cpp at git revision `--base`, and at `--candidate`: a revision or
the working tree) are loaded in one process and called in turns on the same store: each round
times `--calls` decode steps of one build, then of the other, so both see the same drift. The
store and query are bench/decode_speed.py's (one Llama-3-8B-shaped layer, or with `--layer
smollm2` one of SmolLM2's shape: 9 query heads, 3 kv-heads of 64 dims; structured K/V, one
sequence grown to `--length`); the step is `cpu_decode_batch` over its DecodeSegments (the
segments gathered once: only the kernel differs). Codes are warm (read by the previous call).
Each build's output is checked against the float64 reference first.

Reports per config the minimum and the median of every round's minimum per build and the ratio
candidate / base (below 1: the candidate is faster). A working-tree build is recorded with its
source's diff against HEAD (`diff_from_head`), so a change timed and never committed (one tried
and dropped) can be applied again (`git apply`) and timed again. Writes bench/results/kernel_ab.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kvtopo  # noqa: E402
from machine import command_line, describe_machine  # noqa: E402
from decode_speed import CONFIGS, D, HKV, HQ, grow_sequence, rel_err, structured_kv  # noqa: E402
from kvtopo.kernels import cpu_decode  # noqa: E402
from kvtopo.kernels.decode_reference import reference_decode  # noqa: E402
from kvtopo.runtime import decode_view  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SOURCE = cpu_decode.SOURCE.relative_to(ROOT)
WORKTREE = "WORKTREE"
# Attention layer shapes (query heads, kv-heads, head dim): bench/decode_speed.py's, and SmolLM2's
# (the model of bench/generate_speed.py --model smollm2).
LAYERS = {"llama3-8b": (HQ, HKV, D), "smollm2": (9, 3, 64)}


def git(*args: str) -> bytes:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True)
    if done.returncode:
        raise SystemExit(f"kernel_ab: git {' '.join(args)} failed: {done.stderr.decode().strip()}")
    return done.stdout


def source_at(revision: str, into: Path) -> tuple[Path, dict]:
    """The kernel source at a git revision (or the working tree's), written into `into`, and what
    identifies it: the commit and a short hash of the text (the working tree's: also its diff
    against HEAD)."""
    changes = {}
    if revision == WORKTREE:
        text, commit = cpu_decode.SOURCE.read_bytes(), WORKTREE
        changes = {"head": git("rev-parse", "--short", "HEAD").decode().strip(),
                   "diff_from_head": git("diff", "HEAD", "--", str(SOURCE)).decode()}
    else:
        text, commit = git("show", f"{revision}:{SOURCE}"), git("rev-parse", "--short", revision).decode().strip()
    digest = hashlib.sha256(text).hexdigest()[:10]
    path = into / f"mid_decode_{digest}.cpp"
    path.write_bytes(text)
    return path, {"revision": revision, "commit": commit, "source_sha256": digest, **changes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the kernel source to compare against")
    ap.add_argument("--candidate", default=WORKTREE, help=f"git revision, or {WORKTREE} (default)")
    ap.add_argument("--configs", nargs="+", default=["default", "8x"], choices=sorted(CONFIGS))
    ap.add_argument("--layer", choices=sorted(LAYERS), default="llama3-8b", help="the layer's shape")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=40, help="timed calls of one build per round")
    ap.add_argument("--out", type=Path, default=RESULTS / "kernel_ab.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    builds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for role, revision in (("base", args.base), ("candidate", args.candidate)):
            path, identity = source_at(revision, Path(tmp))
            print(f"building {role} ({identity})", flush=True)
            digest = identity["source_sha256"]
            try:
                kernel = cpu_decode.build_kernel(path, f"kvtopo_ab_{digest}")
            except (OSError, RuntimeError, ImportError) as error:
                raise SystemExit(f"kernel_ab: building the {role} kernel ({revision}) failed:\n{error}") from error
            builds[role] = {**identity, "kernel": kernel}

    q_heads, kv_heads, head_dim = LAYERS[args.layer]
    scale = head_dim**-0.5
    keys, values = structured_kv(args.length + 1, seed=0, kv_heads=kv_heads, head_dim=head_dim)
    k_new, v_new = keys[:, args.length:].clone(), values[:, args.length:].clone()
    q = torch.randn(1, q_heads, 1, head_dim, generator=torch.Generator().manual_seed(0)) * 0.3
    result = {"benchmark": "kernel_ab", "layer": {"name": args.layer, "q_heads": q_heads, "kv_heads": kv_heads,
                                                  "head_dim": head_dim},
              "length": args.length, "threads": args.threads, "rounds": args.rounds,
              "calls": args.calls, "builds": {r: {k: v for k, v in b.items() if k != "kernel"} for r, b in builds.items()},
              "load_before": os.getloadavg(), "command": command_line(__file__), "machine": describe_machine(), "configs": {}}
    for name in args.configs:
        with kvtopo.session(CONFIGS[name]) as s:
            grow_sequence(s, 0, q[0], keys, values, scale, 0, args.length)
            segs = decode_view.decode_segments(s.layers["layer0"], 0, k_new, v_new)
            expected = reference_decode(q[0, :, 0], segs, scale)

            def step():
                return cpu_decode.cpu_decode_batch(q[:, :, 0], [segs], scale)

            def use(build: dict) -> None:  # the kernel cpu_decode_batch calls
                cpu_decode.mid_kernel = lambda: build["kernel"]

            minima = {role: [] for role in builds}
            errors = {}
            own_kernel = cpu_decode.mid_kernel
            try:
                for role, build in builds.items():
                    use(build)
                    try:
                        errors[role] = rel_err(step()[0], expected)
                    except RuntimeError as error:  # the build's checks refuse what the store hands over
                        raise SystemExit(
                            f"kernel_ab: the {role} kernel ({build['revision']}) refused the store's segments "
                            f"(kernels that read float32 statistics only are older than the store's float16 "
                            f"ones; choose a later --{role}):\n{error}") from error
                for _ in range(args.rounds):
                    for role, build in builds.items():
                        use(build)
                        best = float("inf")
                        for _ in range(args.calls):
                            start = time.perf_counter()
                            step()
                            best = min(best, time.perf_counter() - start)
                        minima[role].append(1e3 * best)
            finally:
                cpu_decode.mid_kernel = own_kernel
            row = {"ratio_vs_fp16": s.stats().ratio_vs_fp16, "rel_err_vs_float64": errors}
            for role in builds:
                row[role] = {"min_ms": min(minima[role]), "median_of_round_minima_ms": statistics.median(minima[role])}
            row["candidate_over_base"] = {
                "min": row["candidate"]["min_ms"] / row["base"]["min_ms"],
                "median": row["candidate"]["median_of_round_minima_ms"] / row["base"]["median_of_round_minima_ms"]}
            result["configs"][name] = row
            print(f"{name}: base {row['base']['min_ms']:.3f} ms, candidate {row['candidate']['min_ms']:.3f} ms "
                  f"(min), candidate / base {row['candidate_over_base']['min']:.3f} (min), "
                  f"{row['candidate_over_base']['median']:.3f} (median); rel. error vs float64 "
                  f"{errors['base']:.1e} / {errors['candidate']:.1e}", flush=True)
    result["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
