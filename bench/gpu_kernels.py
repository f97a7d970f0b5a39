"""Triton decode kernels vs dense bf16 SDPA on a CUDA device: latency and achieved bandwidth.

    python bench/gpu_kernels.py [--lengths 8192 ... 131072] [--batches 1 16] [--reps 20]

One Llama-3-8B-shaped layer (32 query heads, 8 kv-heads, head dim 128), one decode step (one
query token per sequence). Per sequence the compressed history is built directly on the device
in the runtime's layout (kernels.quant.quantize, as runtime/codecs.py encodes pages): 96 exact
bf16 tokens (a sink page, the Terminal page, the new token), 2 int8 Recent pages of 32 tokens,
and a projected Mid segment of 92% of the remaining tokens in full 32-row pages (the kept
fraction topo's eviction leaves at 8x on bench/decode_speed.py's data), for two codings:
  "8x":      ranks 22 per kv-head, 8-bit codes  (Config(mid_bits=8, key/value_energy=0.97))
  "projected": ranks 14 per kv-head, 4-bit codes  (Config(key_energy=0.9, value_energy=0.9); the
             default coding until projection became opt-in, named "default" in results from then)
Every sequence of a batch has its own data (no cache sharing between sequences).

Methods, timed with CUDA events (median of --reps after warm-up):
  dense_bf16     F.scaled_dot_product_attention, q [B, Hkv, G, d] vs k/v [B, Hkv, L, d] bf16
                 (GQA folded into query rows: K/V read once per kv-head);
  kvtopo_<cfg>   kernels.triton_decode.triton_decode_batch (what the runtime calls: one launch
                 per kind of segment for the whole batch), eagerly, and — when capture works —
                 replayed as a CUDA graph (launch overhead removed). Results from before the
                 batched launch (B launches of each kernel) are in the older JSON files.
Bytes: dense = K+V bytes; kvtopo = DecodeSegments.nbytes (codes, statistics, exact K/V,
bases). Achieved bandwidth = bytes / time, quoted against the device's measured copy bandwidth
(a 1 GiB device-to-device copy: read + write bytes / time).

Prints a table, writes bench/results/gpu_kernels.json. Runs in well under 5 minutes on an
H100/H200-class device; exits with a message (status 1) when there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HQ, HKV, D, PAGE = 32, 8, 128, 32
CODINGS = {"8x": (22, 8), "projected": (14, 4)}
RESULTS = Path(__file__).resolve().parent / "results" / "gpu_kernels.json"


def copy_bandwidth(device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.nbytes / statistics.median(times)


def make_segments(length: int, rank: int, bits: int, device, seed: int):
    from kvtopo.kernels.decode_inputs import DecodeSegments, MidCodes, RecentCodes
    from kvtopo.kernels.quant import quantize

    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    exact = (randn(HKV, 97, D).bfloat16(), randn(HKV, 97, D).bfloat16())
    kq = quantize(randn(HKV, 2, PAGE, D), 8, reduce_dim=2)
    vq = quantize(randn(HKV, 2 * PAGE, D), 8, reduce_dim=-1)
    recent = RecentCodes(kq.codes.reshape(HKV, 2 * PAGE, D), kq.scale.float().reshape(HKV, 2, D),
                         kq.offset.float().reshape(HKV, 2, D), vq.codes, vq.scale.float()[..., 0],
                         vq.offset.float()[..., 0], 8, PAGE, D, D)
    rows = max(1, int(0.92 * (length - 161)))
    pages = -(-rows // PAGE)
    c = HKV * rank
    ranks = torch.full((HKV,), rank, dtype=torch.int32, device=device)
    starts = torch.arange(HKV, dtype=torch.int32, device=device) * rank
    sides = []
    for _ in range(2):
        decay = torch.exp(-torch.arange(rank, device=device) / 8.0).repeat(HKV)
        q = quantize(3 * randn(pages, PAGE, c) * decay, bits, reduce_dim=1)
        codes = q.codes.reshape(pages * PAGE, -1)[:rows].contiguous()
        vectors = torch.linalg.qr(randn(HKV, D, D))[0][..., :rank].contiguous()
        sides.append((codes, q.scale.float().reshape(pages, c), q.offset.float().reshape(pages, c), vectors, randn(HKV, D)))
    row_stat = (torch.arange(rows, device=device) // PAGE).to(torch.int32)
    (kr, ks, ko, kv, km), (vr, vs, vo, vv, vm) = sides
    mid = MidCodes(kr, ks, ko, bits, starts, ranks, kv, km, vr, vs, vo, bits, starts, ranks, vv, vm, row_stat)
    return DecodeSegments(exact, recent, mid)


def cuda_time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graphed(fn):
    """fn captured as one CUDA graph (None if capture fails)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as exc:  # noqa: BLE001 - report and go on eagerly
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {exc}; eager only)")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU needed: build small inputs on the CPU and check the kernels (Triton interpreter) "
                         "against the float64 reference; times nothing")
    args = ap.parse_args()
    if args.dry_run:
        dry_run()
        return
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_kernels.py needs a CUDA device and none is available "
                 "(torch.cuda.is_available() is False): nothing was measured.")
    from kvtopo.kernels.decode_reference import reference_decode
    from kvtopo.kernels.triton_decode import triton_decode_attention, triton_decode_batch

    device = torch.device("cuda")
    began = time.time()
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    print(f"{name}: measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    scale = D**-0.5

    # correctness on the device first (float64 reference on the same stored data)
    check = {}
    for coding, (rank, bits) in CODINGS.items():
        segs = make_segments(8192, rank, bits, device, seed=1)
        q = torch.randn(HQ, D, device=device)
        out = triton_decode_attention(q, segs, scale)
        ref = reference_decode(q, segs, scale)
        check[coding] = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"  {coding}: relative error vs float64 reference at 8K tokens: {check[coding]:.2e}")

    rows = []
    for length in args.lengths:
        for batch in args.batches:
            row = {"tokens": length, "batch": batch}
            qd = torch.randn(batch, HKV, HQ // HKV, D, device=device, dtype=torch.bfloat16)
            k = torch.randn(batch, HKV, length, D, device=device, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            t = cuda_time(lambda: F.scaled_dot_product_attention(qd, k, v, scale=scale), args.reps)
            dense_bytes = k.nbytes + v.nbytes
            row["dense_bf16"] = {"ms": t * 1e3, "bytes": dense_bytes, "GBps": dense_bytes / t / 1e9,
                                 "of_copy_bw": dense_bytes / t / bandwidth}
            del k, v
            for coding, (rank, bits) in CODINGS.items():
                seqs = [make_segments(length, rank, bits, device, seed=100 + i) for i in range(batch)]
                qs = torch.randn(batch, HQ, D, device=device)
                outs = torch.empty(batch, HQ, D, device=device)

                def step():
                    outs.copy_(triton_decode_batch(qs, seqs, scale))

                nbytes = sum(s.nbytes for s in seqs)
                t = cuda_time(step, args.reps)
                entry = {"ms": t * 1e3, "bytes": nbytes, "GBps": nbytes / t / 1e9, "of_copy_bw": nbytes / t / bandwidth,
                         "speedup_vs_dense_bf16": row["dense_bf16"]["ms"] / (t * 1e3)}
                replay = graphed(step)
                if replay is not None:
                    tg = cuda_time(replay, args.reps)
                    entry.update({"graph_ms": tg * 1e3, "graph_GBps": nbytes / tg / 1e9,
                                  "graph_of_copy_bw": nbytes / tg / bandwidth,
                                  "graph_speedup_vs_dense_bf16": row["dense_bf16"]["ms"] / (tg * 1e3)})
                row[coding] = entry
                del seqs
            rows.append(row)
            parts = [f"{length:>7} tok  B={batch:<3}", f"dense bf16 {row['dense_bf16']['ms']:8.3f} ms "
                     f"({row['dense_bf16']['of_copy_bw']:.0%} of copy bw)"]
            for coding in CODINGS:
                e = row[coding]
                graph = f", graph {e['graph_ms']:.3f} ms x{e['graph_speedup_vs_dense_bf16']:.1f}" if "graph_ms" in e else ""
                parts.append(f"{coding} {e['ms']:8.3f} ms x{e['speedup_vs_dense_bf16']:.1f} "
                             f"({e['of_copy_bw']:.0%} of copy bw{graph})")
            print(" | ".join(parts), flush=True)
            torch.cuda.empty_cache()
    result = {"benchmark": "gpu_kernels", "device": name, "copy_bandwidth_Bps": bandwidth,
              "layer": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D}, "codings": CODINGS,
              "device_check_rel_err": check, "rows": rows, "seconds": time.time() - began}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({time.time() - began:.0f} s)")


def dry_run() -> None:
    import os

    os.environ["TRITON_INTERPRET"] = "1"
    from kvtopo.kernels.decode_reference import reference_decode
    from kvtopo.kernels.triton_decode import triton_decode_batch

    for coding, (rank, bits) in CODINGS.items():
        seqs = [make_segments(400 + 50 * i, rank, bits, torch.device("cpu"), seed=1 + i) for i in range(2)]
        q = torch.randn(2, HQ, D)
        out = triton_decode_batch(q, seqs, D**-0.5)
        for i, segs in enumerate(seqs):
            ref = reference_decode(q[i], segs, D**-0.5)
            err = ((out[i].double() - ref).norm() / ref.norm()).item()
            print(f"dry run {coding}, sequence {i}: {segs.mid.tokens} Mid rows, {segs.nbytes} bytes, "
                  f"relative error {err:.2e}")
            assert err < 1e-5, err


if __name__ == "__main__":
    main()
