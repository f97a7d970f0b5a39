"""KL fidelity of several Configs on SmolLM2-135M-Instruct: what each part of topo's coding costs.

    python bench/fidelity_configs.py                               # 2,048 tokens, seeds 0 and 1, every config
    python bench/fidelity_configs.py --seeds 1 --configs default-4x recent-256-4x --out FILE

bench/real_quality.py's fidelity measurement, for configs that differ in one choice each: the
same prose (``natural_text`` seeds, 0 and 1 by default, raw text, no template), the whole prefix in one
prefill chunk, the full cache's 64 greedy tokens forced one by one; per config the mean
KL(full || config) of the next-token distributions (and per forced position), greedy agreement with the full cache, the
achieved ``ratio_vs_fp16`` and the share of tokens held (kept). Float32 model compiled without
Inductor, 1 torch thread. Separates the error of Mid's codes (the no-eviction rows) from that of
eviction (the 4x rows) and of the Recent window (where eviction waits: 64 tokens, the default
until this bench measured it, or 256; 8-bit or 4-bit codes), and compares with kvtopo's SnapKV (exact
survivors) at the same nominal ratio. Each result records the full Config it ran.

Writes bench/results/fidelity_configs_<length>.json.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
from real_quality import FIDELITY_TOKENS, Prompts, SessionForward, forced_logits
from quality import kl_rows
from machine import command_line, describe_machine

import kvtopo

CHUNK = dict(prefill_chunk_size=8192)
OLD_RECENT = dict(recent_tokens=64, recent_bits=8)  # the default Recent window until it was measured here
CONFIGS = {
    "default-8x": kvtopo.Config(**CHUNK),
    "default-4x": kvtopo.Config(target_ratio=4, **CHUNK),
    "recent-64-8bit-8x": kvtopo.Config(**OLD_RECENT, **CHUNK),
    "recent-64-8bit-4x": kvtopo.Config(target_ratio=4, **OLD_RECENT, **CHUNK),
    "recent-4bit-8x": kvtopo.Config(recent_bits=4, **CHUNK),
    "recent-4bit-4x": kvtopo.Config(target_ratio=4, recent_bits=4, **CHUNK),
    "codes-no-eviction": kvtopo.Config(target_ratio=None, **CHUNK),
    "exact-recent-no-eviction": kvtopo.Config(target_ratio=None, recent_bits=None, **CHUNK),
    "8bit-mid-no-eviction": kvtopo.Config(target_ratio=None, mid_bits=8, **CHUNK),
    "8bit-mid-4x": kvtopo.Config(target_ratio=4, mid_bits=8, **CHUNK),
    "exact-mid-4x": kvtopo.Config(target_ratio=4, mid_bits=None, **CHUNK),
    "snapkv-4x": kvtopo.Config(policy="snapkv", target_ratio=4, **CHUNK),
}


def measure(model, config, prefix, forced, reference) -> dict:
    with kvtopo.session(config) as s, torch.no_grad():
        logits = forced_logits(SessionForward(model, s), prefix, forced)
        stats = s.stats()
    held = [h[0] for h in stats.held_tokens.values()]
    kl = kl_rows(reference, logits)
    return dict(kl=float(kl.mean()), kl_positions=[round(float(x), 5) for x in kl],
                agree=float((logits.argmax(-1) == torch.tensor(forced)).float().mean()),
                ratio=stats.ratio_vs_fp16, kept=sum(held) / (len(held) * stats.tokens[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048, help="prose tokens before the forced continuation")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="natural_text seeds of the prose")
    parser.add_argument("--configs", nargs="+", choices=tuple(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default bench/results/fidelity_configs_<length>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from kvtopo.models.pretrained import smollm2

    started = time.perf_counter()
    model, tokenizer = smollm2(torch.float32)
    kvtopo.compile(model, inductor=False)
    prompts = Prompts(tokenizer)
    full = kvtopo.Config.lossless(**CHUNK)
    runs = {name: [] for name in args.configs}
    for seed in args.seeds:
        prefix = prompts.text_window(seed, args.length)
        with torch.no_grad():
            out, reference = kvtopo.generate(model, torch.tensor([prefix]), FIDELITY_TOKENS, config=full,
                                             eos_token_id=None, return_logits=True, progress=False)
        forced = out[0, len(prefix):].tolist()
        for name in args.configs:
            row = measure(model, CONFIGS[name], prefix, forced, reference[0])
            runs[name].append(row)
            print(f"text {seed} {name}: KL {row['kl']:.4f}, agreement {row['agree']:.2f}, "
                  f"{row['ratio']:.2f}x vs fp16, kept {row['kept']:.2f}", flush=True)
    rows = {name: dict(config=repr(CONFIGS[name]), texts=r,
                       **{key: sum(t[key] for t in r) / len(r) for key in ("kl", "agree", "ratio", "kept")})
            for name, r in runs.items()}
    for name, row in rows.items():
        print(f"{name:26s} KL {row['kl']:.4f}  agreement {row['agree']:.2f}  {row['ratio']:.2f}x  kept {row['kept']:.2f}")
    meta = dict(length=args.length, seeds=args.seeds, forced_tokens=FIDELITY_TOKENS, dtype="float32",
                torch=torch.__version__, command=command_line(__file__), machine=describe_machine(), load=os.getloadavg(),
                seconds=time.perf_counter() - started)
    out = args.out or Path(__file__).resolve().parent / "results" / f"fidelity_configs_{args.length}.json"
    out.write_text(json.dumps(dict(meta=meta, configs=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
