"""Exported decode step on each runtime (onnxruntime, OpenVINO, IREE) vs the PyTorch eager session.

Models as `kvtopo export` names them: zoo names, `smollm2` (SmolLM2-135M-Instruct, the project's
real model, float32) or a checkpoint / GGUF path; llama and smollm2 by default. Default Config
(topo policy, 8x target) as exported (refit_after=None, eviction_scope="page"; the session runs
the same), contexts 1K and 4K: prefill by chunks, then the median latency of single-token decode
steps. The prompt is prose from models/real_tasks.py for a model with a tokenizer, random ids for
zoo models. Runtimes: HostRunner.forward (the decode-step graph plus the host's cache bookkeeping
and any page transition that step, run by the compressor graph) over the ONNX files (onnxruntime,
OpenVINO on CPU) or the IREE modules compiled from the MLIR (llvm-cpu, host CPU). PyTorch: the
model compiled with backend="kvtopo" (inductor off: eager) inside a kvtopo session. Quoted as
ratios to the PyTorch session measured in the same run (shared, noisy machines; the load average
is recorded before and after each model). Every runtime decodes the session's greedy tokens (fed
to it, not its own argmax), so the KV bytes it holds are those of the same sequence and must equal
the session's; how many of its own greedy tokens agreed with the session's is recorded too.

    python bench/export.py [--models llama smollm2 ...] [--contexts 1024 4096] [--steps 16]
                           [--runtimes onnxruntime openvino iree] [--out bench/results/export.json]
                           [--onnx-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from machine import command_line, describe_machine

ROOT = Path(__file__).resolve().parents[1]
RUNTIMES = ("onnxruntime", "openvino", "iree")
THREADS = 2


def _export_pkg():
    try:
        import kvtopo.export as kx
    except ImportError:
        sys.path.insert(0, str(ROOT))
        import export as kx
    return kx


def bench_model(name: str, contexts: list[int], steps: int, runtimes: list[str], onnx_dir: str | None = None) -> dict:
    """One model's rows: export (timed), then per context the session's and each runtime's
    median decode-step latency and the KV bytes each holds. `onnx_dir`: an ONNX export of this
    model to reuse when it was written for these contexts (else exported there)."""
    import kvtopo
    from kvtopo.config import Config
    from kvtopo.export_cli import load_model, prompt_ids
    from kvtopo.export.host_runner import HostRunner

    kx = _export_pkg()
    config = Config()
    t0 = time.perf_counter()
    model, tokenizer = load_model(name)
    load_s = round(time.perf_counter() - t0, 1)
    max_context = max(contexts) + steps + 8
    dirs = {"onnx": Path(onnx_dir or tempfile.mkdtemp(prefix="kvtopo_export_bench_onnx_")),
            "iree": Path(tempfile.mkdtemp(prefix="kvtopo_export_bench_iree_"))}
    export_s, paths = {}, {}
    reused = dirs["onnx"] / "layout.json"
    if onnx_dir and reused.is_file() and json.loads(reused.read_text())["max_context"] == max_context:
        export_s["onnx"] = "reused"
        paths.update({g: str(dirs["onnx"] / f"{g}.onnx") for g in ("decode_step", "compressor")}, layout=str(reused))
    for kind in [k for k in (("onnx", "iree") if "iree" in runtimes else ("onnx",)) if k not in export_s]:
        t0 = time.perf_counter()
        export = kx.export_onnx if kind == "onnx" else kx.export_iree
        paths.update(export(model, dirs[kind], config=config, max_context=max_context))
        export_s[kind] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {'export_onnx' if kind == 'onnx' else 'export_iree (MLIR + IREE compile)'} "
              f"{export_s[kind]:.0f} s", flush=True)
    sizes = {Path(p).name: Path(p).stat().st_size for p in paths.values()}
    runners = {rt: HostRunner(dirs["iree" if rt == "iree" else "onnx"], runtime=rt, threads=THREADS) for rt in runtimes}
    exported = next(iter(runners.values())).config
    kvtopo.compile(model, inductor=False)

    def decode_ms(forward, ids, ctx, tokens=None):
        """Prefill `ids` by chunks, then `steps` single-token steps: (median ms per step, the greedy
        token after the prompt and after each step). The steps feed `tokens` when given, else the
        greedy ones."""
        chunk = config.prefill_chunk_size
        for s in range(0, ctx, chunk):
            logits = forward(ids[s:s + chunk], s)
        times, greedy = [], []
        for i in range(steps):
            greedy.append(int(np.argmax(logits[-1])))
            t = time.perf_counter()
            logits = forward(np.array([greedy[-1] if tokens is None else tokens[i]]), ctx + i)
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e3, greedy + [int(np.argmax(logits[-1]))]

    def session_forward(ids, start):
        with torch.no_grad():
            ids = torch.as_tensor(ids)[None]
            out = model(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None], use_cache=False)
        return out.logits[0].numpy()

    rows = []
    load_before = os.getloadavg()
    for ctx in contexts:
        ids = prompt_ids(model, tokenizer, ctx, seed=ctx)[0].numpy()
        with kvtopo.session(exported) as session:  # what the exported graphs do
            pt_ms, session_tokens = decode_ms(session_forward, ids, ctx)
            stats = session.stats()
        row = {"context": ctx, "pytorch_eager_session_ms": round(pt_ms, 3),
               "session_kv_bytes": stats.total_bytes - stats.per_kind.get("free", 0)}
        line = f"{name} context {ctx:5d}: pytorch eager session {pt_ms:8.2f} ms/step"
        for rt, runner in runners.items():
            runner.reset()
            ms, greedy = decode_ms(lambda chunk, start, r=runner: r.forward(chunk), ids, ctx, session_tokens)
            row.update({f"{rt}_ms": round(ms, 3), f"speedup_{rt}_vs_pytorch": round(pt_ms / ms, 2),
                        f"{rt}_kv_bytes": runner.nbytes(),
                        f"{rt}_greedy_tokens_equal": sum(a == b for a, b in zip(greedy, session_tokens))})
            line += f"   {rt} {ms:8.2f} ms ({pt_ms / ms:.2f}x)"
        rows.append(row)
        print(line)
        held = {rt: row[f"{rt}_kv_bytes"] for rt in runners}
        print(f"  KV bytes held: session {row['session_kv_bytes']}, " + ", ".join(f"{k} {v}" for k, v in held.items())
              + "; greedy tokens equal to the session's: " + ", ".join(
                  f"{rt} {row[f'{rt}_greedy_tokens_equal']}/{steps + 1}" for rt in runners))
    for file, size in sizes.items():
        print(f"  {file:20s} {size / 1e6:8.3f} MB")
    return {"model": name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "prompt": "random ids" if tokenizer is None else "prose (models/real_tasks.natural_text)",
            "max_context_exported": max_context, "load_seconds": load_s, "export_seconds": export_s,
            "config": {f: getattr(exported, f) for f in ("policy", "target_ratio", "page_size", "mid_bits",
                                                        "key_energy", "value_energy", "refit_after", "eviction_scope")},
            "load_average_1_5_15min": {"before": [round(x, 2) for x in load_before],
                                       "after": [round(x, 2) for x in os.getloadavg()]},
            "decode": rows, "file_bytes": sizes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama", "smollm2"],
                    help="as `kvtopo export` takes them: zoo names, smollm2, checkpoint or GGUF paths")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    ap.add_argument("--out", default=str(ROOT / "bench/results/export.json"))
    ap.add_argument("--onnx-dir", help="one model: reuse its ONNX export in this directory (or export there)")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)

    if args.onnx_dir and len(args.models) != 1:
        ap.error("--onnx-dir holds one model's export: give one model")
    runs = [bench_model(name, args.contexts, args.steps, args.runtimes, args.onnx_dir) for name in args.models]
    result = {"config": "Config() defaults as exported (refit_after=None, eviction_scope=page; see each run)",
              "runtimes_decode": "the session's greedy tokens", "command": command_line(__file__), "machine": describe_machine(),
              "decode_steps_timed": args.steps, "threads": THREADS, "runtimes": args.runtimes, "runs": runs}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
