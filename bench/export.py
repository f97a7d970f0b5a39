"""Exported decode step on onnxruntime vs the PyTorch eager session, and exported file sizes.

A zoo model (llama by default; deepseek-v3 for MLA, whose cache is the latent + RoPE key), default
Config (topo policy, 8x target) as exported (refit_after=None, eviction_scope="page"; the session
runs the same), contexts 1K and 4K: prefill by chunks,
then the median latency of single-token decode steps. onnxruntime: HostRunner.forward (the
decode-step graph plus the host's cache bookkeeping and any page transition that step, run by
the compressor graph). PyTorch: the model compiled with backend="kvtopo" (inductor off: eager)
inside a kvtopo session. Quoted as a ratio measured in one run (shared, noisy machines).

    python bench/export.py [--model llama|deepseek-v3|...] [--steps 16] [--out bench/results/export.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _export_pkg():
    try:
        import kvtopo.export as kx
    except ImportError:
        sys.path.insert(0, str(ROOT))
        import export as kx
    return kx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="zoo model name")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--out", default=None, help="default: bench/results/export.json (llama), export_<model>.json")
    args = ap.parse_args()
    torch.set_num_threads(2)

    import kvtopo
    from kvtopo.config import Config
    from kvtopo.models import zoo
    from kvtopo.runtime.host_runner import HostRunner

    kx = _export_pkg()
    config = Config()
    model = zoo.build(args.model)
    out_path = Path(args.out or ROOT / "bench/results" / ("export.json" if args.model == "llama"
                                                           else f"export_{args.model}.json"))
    tmp = Path(tempfile.mkdtemp(prefix="kvtopo_export_bench_"))
    t0 = time.perf_counter()
    paths = kx.export_onnx(model, tmp, config=config, max_context=max(args.contexts) + args.steps + 8)
    export_s = time.perf_counter() - t0
    sizes = {Path(p).name: Path(p).stat().st_size for p in paths.values()}
    runner = HostRunner(tmp, threads=2)
    kvtopo.compile(model, inductor=False)

    rows = []
    for ctx in args.contexts:
        ids = torch.randint(0, model.config.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx))
        chunk = config.prefill_chunk_size
        # onnxruntime
        runner.reset()
        for s in range(0, ctx, chunk):
            logits = runner.forward(ids[s:s + chunk].numpy())
        token = int(np.argmax(logits[-1]))
        ort_times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            logits = runner.forward(np.array([token]))
            ort_times.append(time.perf_counter() - t)
            token = int(np.argmax(logits[-1]))
        # PyTorch eager session
        pt_times = []
        with kvtopo.session(runner.config) as session, torch.no_grad():  # what the exported graphs do
            for s in range(0, ctx, chunk):
                out = model(input_ids=ids[None, s:s + chunk], position_ids=torch.arange(s, min(s + chunk, ctx))[None],
                            use_cache=False)
            token = int(out.logits[0, -1].argmax())
            for i in range(args.steps):
                t = time.perf_counter()
                out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[ctx + i]]), use_cache=False)
                pt_times.append(time.perf_counter() - t)
                token = int(out.logits[0, -1].argmax())
            stats = session.stats()
        ort_ms, pt_ms = statistics.median(ort_times) * 1e3, statistics.median(pt_times) * 1e3
        rows.append({"context": ctx, "onnxruntime_ms": round(ort_ms, 3), "pytorch_eager_session_ms": round(pt_ms, 3),
                     "speedup_ort_vs_pytorch": round(pt_ms / ort_ms, 2), "host_kv_bytes": runner.nbytes(),
                     "session_kv_bytes": stats.total_bytes - stats.per_kind.get("free", 0)})
        print(f"context {ctx:5d}: onnxruntime {ort_ms:8.2f} ms/step   pytorch eager session {pt_ms:8.2f} ms/step   "
              f"ratio {pt_ms / ort_ms:.2f}x")
    for name, size in sizes.items():
        print(f"{name:20s} {size / 1e6:8.3f} MB")
    result = {"model": f"{args.model} (zoo)", "config": "Config() defaults as exported (topo, target_ratio=8, page_size=32, refit_after=None, eviction_scope=page)",
              "max_context_exported": max(args.contexts) + args.steps + 8, "decode_steps_timed": args.steps,
              "threads": 2, "export_seconds": round(export_s, 1), "decode": rows, "file_bytes": sizes}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
