"""Decode attention latency per layer vs context length: dense SDPA vs kvtopo's fast path.

    python bench/decode_speed.py [--quick] [--lengths 1024 2048 ...] [--threads 1] [--reps 15]

One Llama-3-8B-shaped attention layer (32 query heads, 8 kv-heads, head dim 128), one sequence,
one decode step (one query token). Structured keys/values (per kv-head: a few offset channels
+ rank-64 structure with decaying energy + noise) are fed through a real
`kvtopo.session(kvtopo.Config(...))`: the first 64 tokens through `s.attend(...)`, the rest
appended to the same layer store in 4096-token chunks (`LayerCache.observe` + `append`, exactly
what `attend` does after attending — the prefill's own attention output is not needed here and
would cost O(L^2) on these 2 cores). The store grows to each context length in turn; at each
one the same decode query and new token are timed through:

  dense fp32 SDPA   F.scaled_dot_product_attention on the uncompressed K/V (+ the new token),
                    GQA folded into query rows (q [1, Hkv, G, d] vs k/v [1, Hkv, L, d]) — the
                    fastest dense formulation here (enable_gqa=True measured slower);
  dense bf16 SDPA   the same in bfloat16;
  kvtopo <config>   `kvtopo.runtime.decode_view.attend_cache`: gathers the stored codes
                    (exact pages + new token, Recent codes, packed Mid codes) and runs the CPU
                    path (one C kernel call over all of them), end to end per layer.

Configs: "default" = kvtopo.Config() (topo, target 8x vs fp16, Mid as 4-bit KIVI-style codes:
keys per channel per page, values per token, read by the C kernel on an identity basis);
"projected" = Config(key_energy=0.9, value_energy=0.9) (directional pruning, opt-in: 4-bit
coefficients at 0.9 energy, bases refitted as the sequence doubles; the default before
projection became opt-in, measured as "default" in results from before that); "8x" =
Config(mid_bits=8, key_energy=0.97, value_energy=0.97, refit_after=None), which lands near 8x
vs fp16 on this data; "8x_refits" is the same with refits on: each Mid epoch a refit adds is one
more pass of the C kernel per step. "default" is also timed as "default_torch", the same step
with its Mid segment dequantized and attended by torch (`MidSegment.attention_inputs`, the path
unprojected Mid took before the kernel read it), and
its summary gives the kernel's speedup over that. The measured
ratio vs fp16 and the bytes held are reported per length.

"bytes" is what the decode step reads (DecodeSegments.nbytes: exact K/V, codes, statistics,
bases); "bytes_held" is the store's own accounting (session.stats(): pool slots, metadata).

Methods are interleaved rep by rep (the machine is shared); each row reports the median and the
minimum wall time and (with --threads 1) the median CPU time of the calling thread, which
leaves out the time other jobs hold the core; ratios are quoted from each. Writes bench/results/decode_speed.json and .png.

    python bench/decode_speed.py --batch 16 [--lengths 4096 32768] [--configs default 8x] [--threads 1]

Batch mode: B sequences (each its own structured K/V) in one session's layer store, every one
grown to each length in turn; one decode step of all B timed as

  dense_fp32          one SDPA over the batch's uncompressed K/V [B, Hkv, L+1, d] (GQA folded);
  dense_fp32_one      the same for sequence 0 alone (batch 1);
  <config>_batched    `decode_view.attend_cache_batch`: every sequence's segments gathered, one
                      batched decode call (one C kernel call over every exact, Recent and Mid
                      segment of every sequence);
  <config>_singles    B calls of `decode_view.attend_cache`, one per sequence (batch 1, B times);
  <config>_one        that call for sequence 0 alone (batch 1). Each rep runs the methods in this
                      order, so `_batched` finds its codes after other methods' data went through
                      the caches ("cold"), `_one` right after `_singles` read the same codes ("warm");
  read                `src.sum()` over a 256 MiB float32 buffer: the rate at which this run can
                      stream bytes from memory (a step, like it, reads and writes almost nothing);
  copy                `dst.copy_(src)` of that buffer, bytes of src per second: kept for comparison
                      only (it also writes, so its rate is well under the read rate and would make
                      a lenient floor);
  sgemm               a 1024 x 1024 float32 matrix product (`torch.mm`): the arithmetic rate this
                      run sees on the same threads, interleaved with the methods.

"bytes" is what a step reads (the sum of DecodeSegments.nbytes; dense: its K/V); GB/s divide it
by the minimum wall time and are set against the read's. "flops" is the arithmetic a step cannot
skip (`step_flops`: a multiply and an add per query head, stored token and key or value column
attended); the step's two floors are bytes at the read's rate and flops at the sgemm's rate, and
each row reports its minimum time over each floor (`min_over_each_floor`: "bandwidth" is the
read floor) and over the larger one (`min_over_floor`: on a machine whose sgemm rate is low
against its read rate, the arithmetic floor). os.getloadavg() is recorded before and
after each length. Writes bench/results/decode_speed_batch.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.kernels import cpu_decode, fast_decode
from kvtopo.kernels.decode_reference import reference_decode
from kvtopo.runtime import decode_view
from machine import command_line, describe_machine

RESULTS = Path(__file__).resolve().parent / "results"
HQ, HKV, D = 32, 8, 128
SCALE = D**-0.5
CONFIGS = {
    "default": kvtopo.Config(),
    "projected": kvtopo.Config(key_energy=0.9, value_energy=0.9),
    "8x": kvtopo.Config(mid_bits=8, key_energy=0.97, value_energy=0.97, refit_after=None),
    "8x_refits": kvtopo.Config(mid_bits=8, key_energy=0.97, value_energy=0.97),
}
# Configs also timed with their Mid segment dequantized and attended by torch ("<name>_torch").
TORCH_MID = ("default",)
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
QUICK = [1024, 2048, 4096]
BATCH_LENGTHS = [4096, 32768]
BATCH_CONFIGS = ["default", "8x"]
STREAM_FLOATS = 64 << 20  # 256 MiB: far beyond the private caches
SGEMM_SIZE = 1024


def structured_kv(n: int, seed: int = 0, kv_heads: int = HKV, head_dim: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [kv_heads, n, head_dim] (see the module docstring; rank 64 at most head_dim)."""
    g = torch.Generator().manual_seed(seed)

    def side():
        rank = min(64, head_dim)
        energy = torch.exp(-torch.arange(rank) / 12.0)
        basis = torch.linalg.qr(torch.randn(kv_heads, head_dim, rank, generator=g))[0]
        offset = torch.zeros(kv_heads, 1, head_dim)
        offset[..., :4] = 3.0
        x = torch.empty(kv_heads, n, head_dim)
        for i in range(0, n, 8192):  # chunked: bounded temporaries
            m = min(8192, n - i)
            latent = torch.randn(kv_heads, m, rank, generator=g) * energy
            noise = 0.05 * torch.randn(kv_heads, m, head_dim, generator=g)
            x[:, i: i + m] = 4 * latent @ basis.transpose(1, 2) + offset + noise
        return x

    return side(), side()


def step_flops(segs, q_heads: int) -> int:
    """Multiplies and adds (2 per column) one decode step needs over a sequence's segments: every
    query head against every stored token's key and value columns (a Mid row: its kv-head's key
    and value ranks; exact and Recent tokens: dk + dv). Per-page statistics, bases and merges
    are left out: they are not per token."""
    exact = segs.exact_kv()
    columns = 0
    if exact is not None:
        columns += exact[0].shape[1] * (exact[0].shape[2] + exact[1].shape[2]) * exact[0].shape[0]
    if segs.recent is not None:
        columns += segs.recent.tokens * (segs.recent.dk + segs.recent.dv) * segs.recent.k_codes.shape[0]
    for mid in ([segs.mid] if segs.mid is not None else []) + [m for m in segs.retired if hasattr(m, "k_ranks")]:
        columns += mid.tokens * int(mid.k_ranks.sum() + mid.v_ranks.sum())
    kv_heads = (exact[0] if exact is not None else segs.recent.k_codes).shape[0]
    return 2 * columns * (q_heads // kv_heads)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread). With one thread every method runs on the
    calling thread, so CPU time excludes the time other jobs on this shared machine hold it."""
    start, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - start, time.thread_time() - cpu


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def torch_mid_step(cache, q, k_new, v_new):
    """``attend_cache``'s step with the Mid segment dequantized and attended by torch."""
    mid = cache.sequences[0].mid
    segs = dataclasses.replace(decode_view.decode_segments(cache, 0, k_new, v_new), mid=None,
                               mid_other=mid.attention_inputs(), mid_other_projected=mid.encoding.project)
    return fast_decode.decode_attention(q, segs, SCALE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"lengths {QUICK} only")
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/kernel threads for every method (1: stable on a shared 2-core box)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None,
                    help="default results/decode_speed.json (decode_speed_quick.json with --quick, "
                         "decode_speed_batch.json with --batch)")
    ap.add_argument("--replot", action="store_true", help="only redraw the PNG from --out's JSON")
    ap.add_argument("--batch", type=int, help="batch mode: this many sequences (see the module docstring)")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), help=f"batch mode configs (default {BATCH_CONFIGS})")
    args = ap.parse_args()
    if args.out is None:  # a quick run never replaces the full run's results
        args.out = RESULTS / ("decode_speed_batch.json" if args.batch else
                              "decode_speed_quick.json" if args.quick else "decode_speed.json")
    if args.batch:
        torch.set_num_threads(args.threads)
        batch_main(args)
        return
    if args.replot:
        plot(json.loads(args.out.read_text())["rows"], args.out.with_suffix(".png"))
        return
    lengths = sorted(args.lengths or (QUICK if args.quick else LENGTHS))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    longest = lengths[-1]
    keys, values = structured_kv(longest + 1)
    k_new, v_new = keys[:, longest:].clone(), values[:, longest:].clone()
    q = torch.randn(HQ, D) * 0.3
    qg = q.reshape(1, HKV, HQ // HKV, D)
    c_kernel = cpu_decode.c_kernel_available()
    rows = []
    held = {name: 0 for name in CONFIGS}
    with contextlib.ExitStack() as entered:  # sessions exit in the reverse order of entering
        sessions = {name: entered.enter_context(kvtopo.session(cfg)) for name, cfg in CONFIGS.items()}
        for length in lengths:
            row = {"tokens": length}
            dense = torch.cat([keys[:, :length], k_new], 1)[None].contiguous()
            dense_v = torch.cat([values[:, :length], v_new], 1)[None].contiguous()
            dense16, dense16_v, qg16 = dense.bfloat16(), dense_v.bfloat16(), qg.bfloat16()
            exact = F.scaled_dot_product_attention(qg.double(), dense.double(), dense_v.double(), scale=SCALE)
            exact = exact.reshape(HQ, D)
            methods = {
                "dense_fp32": lambda: F.scaled_dot_product_attention(qg, dense, dense_v, scale=SCALE),
                "dense_bf16": lambda: F.scaled_dot_product_attention(qg16, dense16, dense16_v, scale=SCALE),
            }
            caches = {}
            for name, s in sessions.items():
                build = time.perf_counter()
                start = held[name]
                if start == 0:
                    first = min(64, length)
                    s.attend("layer0", torch.randn(1, HQ, first, D) * 0.3, keys[None, :, :first],
                             values[None, :, :first], None, SCALE)
                    start = first
                cache = s.layers["layer0"]
                grow(cache, 0, keys, values, start, length)
                held[name] = length
                caches[name] = cache
                stats = s.stats()
                out = decode_view.attend_cache(cache, 0, q[:, None], k_new, v_new, SCALE)[:, 0]
                segs = decode_view.decode_segments(cache, 0, k_new, v_new)
                stored = reference_decode(q, segs, SCALE)
                row[name] = {
                    "ratio_vs_fp16": stats.ratio_vs_fp16,
                    "bytes_held": stats.total_bytes,
                    "bytes": segs.nbytes,
                    "mid_rows": cache.sequences[0].mid.tokens if cache.sequences[0].mid else 0,
                    "rel_err_vs_exact_attention": rel_err(out, exact),
                    "rel_err_vs_float64_on_stored": rel_err(out, stored),
                    "build_s": time.perf_counter() - build,
                }
                methods[f"kvtopo_{name}"] = (lambda c=cache: decode_view.attend_cache(c, 0, q[:, None], k_new, v_new, SCALE))
                if name in TORCH_MID:
                    torch.testing.assert_close(torch_mid_step(cache, q, k_new, v_new), out, rtol=1e-4, atol=1e-5)
                    methods[f"{name}_torch"] = lambda c=cache: torch_mid_step(c, q, k_new, v_new)
            run_interleaved(methods, row, args)
            rows.append(row)
            print(format_row(row), flush=True)
            del dense, dense_v, dense16, dense16_v

    summary = summarize(rows)
    result = {
        "benchmark": "decode_speed",
        "layer": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D},
        "configs": {name: {k: v for k, v in vars(cfg).items() if k in (
            "policy", "page_size", "sink_tokens", "recent_tokens", "recent_bits", "mid_bits",
            "key_energy", "value_energy", "target_ratio")} for name, cfg in CONFIGS.items()},
        "threads": args.threads,
        "reps": args.reps,
        "c_kernel": c_kernel,
        "command": command_line(__file__),
        "machine": describe_machine(),
        "rows": rows,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def grow_sequence(session, seq: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  start: int, end: int) -> None:
    """Grow sequence `seq` of the session's layer "layer0" from `start` to `end` tokens of keys /
    values [Hkv, L, d]; from 0, its first 64 tokens go through `attend_sequence` with the query
    q [Hq, 1, d] (which makes the layer's store), the rest through `grow`."""
    q_heads, _, head_dim = q.shape
    if start == 0:
        session.attend_sequence("layer0", seq, q.expand(q_heads, 64, head_dim), keys[:, :64], values[:, :64], scale)
    grow(session.layers["layer0"], seq, keys, values, max(start, 64), end, q_heads=q_heads)


def grow(cache, seq: int, keys: torch.Tensor, values: torch.Tensor, start: int, end: int, q_heads: int = HQ) -> None:
    """Append tokens [start, end) of one sequence to the layer store in 4096-token chunks, as
    ``Session.attend`` stores them after attending (observe + append)."""
    kv_heads, _, head_dim = keys.shape
    for i in range(start, end, 4096):
        j = min(end, i + 4096)
        cache.observe(seq, torch.randn(q_heads, min(j - i, 32), head_dim) * 0.3, kv_heads)
        cache.append(seq, keys[:, i:j], values[:, i:j])


def batch_main(args) -> None:
    lengths = sorted(args.lengths or BATCH_LENGTHS)
    names = args.configs or BATCH_CONFIGS
    n, longest = args.batch, lengths[-1]
    torch.manual_seed(0)
    keys, values = torch.empty(n, HKV, longest + 1, D), torch.empty(n, HKV, longest + 1, D)
    for b in range(n):  # each sequence its own data; its last token is the step's new token
        keys[b], values[b] = structured_kv(longest + 1, seed=b)
    k_new, v_new = keys[:, :, longest:].clone(), values[:, :, longest:].clone()  # [B, Hkv, 1, d]
    q = torch.randn(n, HQ, 1, D) * 0.3
    qg = q.reshape(n, HKV, HQ // HKV, D)
    src, dst = torch.randn(STREAM_FLOATS), torch.empty(STREAM_FLOATS)
    mat_a, mat_b = torch.randn(SGEMM_SIZE, SGEMM_SIZE), torch.randn(SGEMM_SIZE, SGEMM_SIZE)
    rows, held = [], 0
    with contextlib.ExitStack() as entered:  # sessions exit in the reverse order of entering
        sessions = {name: entered.enter_context(kvtopo.session(CONFIGS[name])) for name in names}
        for length in lengths:
            row = {"tokens": length, "load_before": os.getloadavg()}
            if length == longest:
                dense, dense_v = keys, values
            else:
                dense = torch.cat([keys[:, :, :length], k_new], 2)
                dense_v = torch.cat([values[:, :, :length], v_new], 2)
            methods = {
                "dense_fp32": lambda: F.scaled_dot_product_attention(qg, dense, dense_v, scale=SCALE),
                "dense_fp32_one": lambda: F.scaled_dot_product_attention(qg[:1], dense[:1], dense_v[:1], scale=SCALE),
                "read": lambda: src.sum(),
                "copy": lambda: dst.copy_(src),
                "sgemm": lambda: torch.mm(mat_a, mat_b),
            }
            dense_flops = 2 * n * HQ * (length + 1) * 2 * D
            row["dense_fp32"] = {"bytes": dense.nbytes + dense_v.nbytes, "flops": dense_flops}
            row["dense_fp32_one"] = {"bytes": row["dense_fp32"]["bytes"] // n, "flops": dense_flops // n}
            row["read"] = {"bytes": src.nbytes}
            row["copy"] = {"bytes": src.nbytes}
            row["sgemm"] = {"bytes": 3 * mat_a.nbytes, "flops": 2 * SGEMM_SIZE**3}
            for name, s in sessions.items():
                build = time.perf_counter()
                for b in range(n):
                    grow_sequence(s, b, q[b], keys[b], values[b], SCALE, held, length)
                cache, seqs = s.layers["layer0"], list(range(n))
                segs = [decode_view.decode_segments(cache, b, k_new[b], v_new[b]) for b in seqs]
                batched = decode_view.attend_cache_batch(cache, seqs, q, k_new, v_new, SCALE)
                singles = torch.stack([decode_view.attend_cache(cache, b, q[b], k_new[b], v_new[b], SCALE) for b in seqs])
                torch.testing.assert_close(batched, singles, rtol=1e-5, atol=1e-6)
                row[name] = {
                    "ratio_vs_fp16": s.stats().ratio_vs_fp16,
                    "bytes": sum(x.nbytes for x in segs),
                    "mid_rows": [cache.sequences[b].mid.tokens if cache.sequences[b].mid else 0 for b in seqs],
                    "rel_err_vs_float64_on_stored_max": max(
                        rel_err(batched[b, :, 0], reference_decode(q[b, :, 0], segs[b], SCALE)) for b in seqs),
                    "build_s": time.perf_counter() - build,
                }
                flops = [step_flops(x, HQ) for x in segs]
                row[f"{name}_batched"] = {"bytes": row[name]["bytes"], "flops": sum(flops)}
                row[f"{name}_singles"] = {"bytes": row[name]["bytes"], "flops": sum(flops)}
                row[f"{name}_one"] = {"bytes": segs[0].nbytes, "flops": flops[0]}
                methods[f"{name}_batched"] = lambda c=cache: decode_view.attend_cache_batch(c, seqs, q, k_new, v_new, SCALE)
                methods[f"{name}_singles"] = lambda c=cache: [
                    decode_view.attend_cache(c, b, q[b], k_new[b], v_new[b], SCALE) for b in seqs]
                methods[f"{name}_one"] = lambda c=cache: decode_view.attend_cache(c, 0, q[0], k_new[0], v_new[0], SCALE)
            held = length
            run_interleaved(methods, row, args)
            for entry in row.values():
                if isinstance(entry, dict) and "min_ms" in entry:
                    entry["GBps_at_min"] = entry["bytes"] / entry["min_ms"] / 1e6
            sgemm_flops_per_ms = row["sgemm"]["flops"] / row["sgemm"]["min_ms"]
            for entry in row.values():
                if isinstance(entry, dict) and "GBps_at_min" in entry:
                    entry["fraction_of_read_GBps"] = entry["GBps_at_min"] / row["read"]["GBps_at_min"]
                if isinstance(entry, dict) and "flops" in entry and "min_ms" in entry:
                    entry["floor_ms"] = {"bandwidth": entry["bytes"] / row["read"]["GBps_at_min"] / 1e6,
                                         "arithmetic": entry["flops"] / sgemm_flops_per_ms}
                    entry["min_over_each_floor"] = {k: entry["min_ms"] / v for k, v in entry["floor_ms"].items()}
                    entry["min_over_floor"] = min(entry["min_over_each_floor"].values())  # over the larger floor
            row["load_after"] = os.getloadavg()
            rows.append(row)
            print(format_batch_row(row, names), flush=True)
            del dense, dense_v
    summary = {r["tokens"]: {name: batch_summary(r, name) for name in names} for r in rows}
    result = {
        "benchmark": "decode_speed_batch",
        "batch": n,
        "layer": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D},
        "configs": {name: {k: v for k, v in vars(CONFIGS[name]).items() if k in (
            "policy", "page_size", "sink_tokens", "recent_tokens", "recent_bits", "mid_bits",
            "key_energy", "value_energy", "target_ratio", "refit_after")} for name in names},
        "threads": args.threads,
        "reps": args.reps,
        "c_kernel": cpu_decode.c_kernel_available(),
        "command": command_line(__file__),
        "machine": describe_machine(),
        "rows": rows,
        "summary": summary,
    }
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")


def run_interleaved(methods: dict, row: dict, args) -> None:
    """Time every method, interleaved rep by rep after one warm-up each, into row[method]."""
    times = {m: [] for m in methods}
    for fn in methods.values():
        fn()
    for _ in range(args.reps):
        for m, fn in methods.items():
            times[m].append(timed(fn))
    for m, ts in times.items():
        entry = row.setdefault(m.removeprefix("kvtopo_"), {})
        wall, cpu = [t for t, _ in ts], [c for _, c in ts]
        entry["median_ms"] = statistics.median(wall) * 1e3
        entry["min_ms"] = min(wall) * 1e3
        if args.threads == 1:
            entry["cpu_median_ms"] = statistics.median(cpu) * 1e3


def batch_summary(row: dict, name: str) -> dict:
    """Ratios of one length and config: time of the other method / time of the batched call."""
    batched = row[f"{name}_batched"]
    stats = [s for s in ("min_ms", "median_ms", "cpu_median_ms") if s in batched]
    return {
        "singles_over_batched": {s: row[f"{name}_singles"][s] / batched[s] for s in stats},
        "dense_fp32_over_batched": {s: row["dense_fp32"][s] / batched[s] for s in stats},
        "dense_fp32_one_over_one": {s: row["dense_fp32_one"][s] / row[f"{name}_one"][s] for s in stats},
        "batched_fraction_of_read_GBps": batched["fraction_of_read_GBps"],
        "one_fraction_of_read_GBps": row[f"{name}_one"]["fraction_of_read_GBps"],
        "singles_fraction_of_read_GBps": row[f"{name}_singles"]["fraction_of_read_GBps"],
        "dense_fp32_fraction_of_read_GBps": row["dense_fp32"]["fraction_of_read_GBps"],
        "one_floor_ms": row[f"{name}_one"]["floor_ms"],
        "one_min_over_floor": row[f"{name}_one"]["min_over_floor"],
        "batched_min_over_floor": batched["min_over_floor"],
        "one_min_over_each_floor": row[f"{name}_one"]["min_over_each_floor"],
        "batched_min_over_each_floor": batched["min_over_each_floor"],
    }


def format_batch_row(row: dict, names: list[str]) -> str:
    parts = [f"{row['tokens']:>6} tok, load {row['load_before'][0]:.1f}->{row['load_after'][0]:.1f}"]
    parts.append(f"sgemm {row['sgemm']['flops'] / row['sgemm']['min_ms'] / 1e6:.1f} GFLOP/s")
    for m in ("read", "copy", "dense_fp32", "dense_fp32_one", *(f"{n}_{k}" for n in names for k in ("batched", "singles", "one"))):
        e = row[m]
        floor = (f", {e['min_over_each_floor']['bandwidth']:.2f}x read floor, "
                 f"{e['min_over_each_floor']['arithmetic']:.2f}x arithmetic floor" if "min_over_floor" in e else "")
        parts.append(f"{m} {e['min_ms']:7.2f} ms min ({e['GBps_at_min']:5.2f} GB/s{floor})")
    return " | ".join(parts)


def format_row(row: dict) -> str:
    parts = [f"{row['tokens']:>6} tok"]
    for m in ("dense_fp32", "dense_bf16", *CONFIGS, *(f"{n}_torch" for n in TORCH_MID)):
        e = row[m]
        cpu = f", cpu {e['cpu_median_ms']:6.2f}" if "cpu_median_ms" in e else ""
        parts.append(f"{m} {e['median_ms']:7.2f} ms (min {e['min_ms']:6.2f}{cpu})")
    for name in CONFIGS:
        e = row[name]
        parts.append(f"{name}: {e['ratio_vs_fp16']:.1f}x vs fp16, err {e['rel_err_vs_exact_attention']:.3f}")
    return " | ".join(parts)


def summarize(rows: list[dict]) -> dict:
    out = {}
    for name in CONFIGS:
        speed = {r["tokens"]: {
            "vs_dense_fp32_median": r["dense_fp32"]["median_ms"] / r[name]["median_ms"],
            "vs_dense_fp32_min": r["dense_fp32"]["min_ms"] / r[name]["min_ms"],
            "vs_dense_bf16_median": r["dense_bf16"]["median_ms"] / r[name]["median_ms"],
            "vs_dense_bf16_min": r["dense_bf16"]["min_ms"] / r[name]["min_ms"],
            **({"vs_dense_fp32_cpu": r["dense_fp32"]["cpu_median_ms"] / r[name]["cpu_median_ms"],
                "vs_dense_bf16_cpu": r["dense_bf16"]["cpu_median_ms"] / r[name]["cpu_median_ms"]}
               if "cpu_median_ms" in r[name] else {}),
        } for r in rows}
        scaling = []
        for a, b in zip(rows, rows[1:]):
            scaling.append({
                "tokens": [a["tokens"], b["tokens"]],
                "time_ratio_min": b[name]["min_ms"] / a[name]["min_ms"],
                "time_ratio_median": b[name]["median_ms"] / a[name]["median_ms"],
                "bytes_ratio": b[name]["bytes"] / a[name]["bytes"],
                "time_per_byte_ratio_min": (b[name]["min_ms"] / b[name]["bytes"]) / (a[name]["min_ms"] / a[name]["bytes"]),
                **({"cpu_time_ratio": b[name]["cpu_median_ms"] / a[name]["cpu_median_ms"],
                    "cpu_time_per_byte_ratio": (b[name]["cpu_median_ms"] / b[name]["bytes"])
                    / (a[name]["cpu_median_ms"] / a[name]["bytes"])} if "cpu_median_ms" in a[name] else {}),
            })
        out[name] = {"speedup": speed, "doubling": scaling}
        if name in TORCH_MID:
            out[name]["vs_torch_mid"] = {r["tokens"]: {
                stat: r[f"{name}_torch"][stat] / r[name][stat]
                for stat in ("median_ms", "min_ms", "cpu_median_ms") if stat in r[name]} for r in rows}
    at = [r for r in rows if r["tokens"] == 32768]
    if at:
        r = at[0]
        out["target_32k_8x_vs_fp32_at_least_4x"] = {
            "median": r["dense_fp32"]["median_ms"] / r["8x"]["median_ms"],
            "min": r["dense_fp32"]["min_ms"] / r["8x"]["min_ms"],
            **({"cpu": r["dense_fp32"]["cpu_median_ms"] / r["8x"]["cpu_median_ms"]} if "cpu_median_ms" in r["8x"] else {}),
        }
    return out


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    tokens = [r["tokens"] for r in rows]
    panels = [("median_ms", "wall time, median ms")]
    if "cpu_median_ms" in rows[0]["dense_fp32"]:
        panels.append(("cpu_median_ms", "CPU time of the thread, median ms"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for m, style in (("dense_fp32", "o-"), ("dense_bf16", "s-"), ("default", "^-"), ("projected", "d-"), ("8x", "v-"),
                         ("8x_refits", "x--")):
            if m not in rows[0]:  # results from before the config existed
                continue
            name = m if m.startswith("dense") else f"kvtopo {m} (~{rows[-1][m]['ratio_vs_fp16']:.0f}x vs fp16)"
            ax.plot(tokens, [r[m][key] for r in rows], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("Decode attention per layer: Llama-3-8B layer (32q/8kv, d=128), CPU, 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
