"""End-to-end generation: kvtopo.generate (default Config) vs HF generate with its normal cache.

One command: `python bench/generate_speed.py [--prompt 4096] [--new 32]`. Each mode runs in its
own subprocess so its peak resident memory (ru_maxrss) is its own; the model is the Llama zoo
model (tiny: the KV cache, not the weights, is what differs). Reported: wall time of the whole
generate call (prefill + `new` tokens) after a warm-up call, and agreement of the greedy tokens
with the lossless session's (which equal a no-cache recomputation with the uncompiled model; at
this length HF generate's own tokens drift from that recomputation, so they are no reference).
Writes bench/results/generate_speed.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def run_mode(mode: str, prompt: int, new: int) -> dict:
    import torch

    import kvtopo
    from kvtopo.models import zoo

    torch.set_num_threads(1)
    model = zoo.build("llama", max_position_embeddings=prompt + new + 8)
    ids = torch.randint(0, 256, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if mode == "hf":
            def run():
                return model.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0), None
        else:
            kvtopo.compile(model, inductor=False)
            config = kvtopo.Config() if mode == "kvtopo" else kvtopo.Config.lossless()

            def run():
                with kvtopo.session(config) as s:
                    return kvtopo.generate(model, ids, new), s.stats().total_bytes
        run()  # warm-up: compiles, allocates
        start = time.perf_counter()
        out, kv_bytes = run()
        total = time.perf_counter() - start
    return {"mode": mode, "prompt": prompt, "new": new, "total_s": total,
            "tokens_per_s": new / total, "kv_bytes": kv_bytes,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "tokens": out[0, prompt:].tolist()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=4096)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--mode", choices=("hf", "kvtopo", "lossless"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.prompt, args.new)))
        return
    rows = []
    for mode in ("hf", "lossless", "kvtopo"):
        print(f"running {mode} ...", flush=True)
        done = subprocess.run([sys.executable, __file__, "--mode", mode, "--prompt", str(args.prompt),
                               "--new", str(args.new)], capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    hf, exact = rows[0], rows[1]
    print(f"{'mode':10} {'total s':>8} {'vs HF':>6} {'peak RSS MB':>12} {'KV bytes':>10} {'= lossless':>10}")
    for r in rows:
        r["agreement_with_lossless"] = sum(a == b for a, b in zip(r["tokens"], exact["tokens"])) / len(exact["tokens"])
        print(f"{r['mode']:10} {r['total_s']:8.2f} {r['total_s'] / hf['total_s']:6.2f} {r['peak_rss_mb']:12.0f} "
              f"{str(r['kv_bytes']):>10} {r['agreement_with_lossless']:10.0%}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "generate_speed.json").write_text(json.dumps({"rows": rows, "threads": 1, "model": "llama zoo"}, indent=1))
    print(f"wrote {RESULTS / 'generate_speed.json'}")


if __name__ == "__main__":
    main()
