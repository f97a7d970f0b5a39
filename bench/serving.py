"""Serving at a fixed KV memory budget: transformers' continuous batching with its own paged cache
vs with kvtopo's store (serving/continuous_batching.py), on the same request stream.

The stream: `--requests` prompts of random ids, lengths uniform in `--min-prompt`..`--max-prompt`
tokens, `--new-tokens` greedy tokens each, arriving at engine steps drawn from a Poisson process
(exponential gaps of mean `--mean-gap` steps; reproducible, not wall time). The model: the zoo
Llama (float32, CPU). Both engines are driven one engine step at a time by the same loop.

The budget (`--budget-mb`, bytes of K/V) sizes transformers' own cache: its block count is the
budget over one block's K/V bytes, and it admits requests by free blocks. kvtopo's store is
admitted either (`--admission bytes`) by its own measured bytes against the same budget
(`kv_budget_bytes`: the session's bytes plus a conservative estimate of each step's new tokens; the
engine's block ledger is sized to hold the whole stream so it never binds), or (`--admission
ratio`, what the older results used) by the engine's logical block ledger given `target_ratio`
times as many blocks (lossless: the engine's block count). Either way what kvtopo really held is
measured after every step (`Session.stats().total_bytes`, pool slots free or live, codes,
metadata) and printed next to the budget — the run says whether the budget was kept, it does not
assume it. Lossless (`Config.lossless()`) must give every request the same tokens as the engine's
own cache; that is checked and printed. The machine's load (`os.getloadavg`) before and after is
recorded: the figures are wall-clock rates on shared cores.

kvtopo runs `Config.lossless()`, `Config()` and `Config(prompt_hold_tokens=0)` (a prompt's chunks
not waiting for its end: more requests fit while prompts are read; pages ranked chunk by chunk).

Reported per engine (the JSON's names):
- `peak_concurrent`: requests the scheduler holds active at once, at most;
- `decode_tokens_per_s`: generated tokens over the whole run's wall time, prefill included. With
  long prompts and few new tokens prefill compute sets it (20 prompts of 8K tokens are 164K
  prompt tokens against 640 generated), so concurrency can barely move it;
- `decode_only_tokens_per_s`: tokens generated in the engine steps whose batch holds only decode
  steps (one token per request, no prefill chunk), over those steps' wall time
  (`decode_only_steps`, `decode_only_s`, `decode_only_tokens`): the rate while the engine decodes,
  which is where holding more requests at once pays. `prefill_steps` / `prefill_s`: the other steps
  (every batch holding a prompt chunk, with or without decode steps beside it);
- `median_ttft_s`: median time to first token, from arrival;
- `peak_kv_bytes`: the most K/V bytes held (the engine's own cache: its whole preallocated cache).
`vs_engine` divides each by the engine's own figure. `--threads` sets torch's CPU threads.

    python bench/serving.py [--requests 10] [--min-prompt 4096] [--max-prompt 16384] [--budget-mb 12]
                            [--admission ratio|bytes] [--threads N] [--out bench/results/serving.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from machine import command_line, describe_machine  # noqa: E402

BLOCK = 32  # tokens per engine block


def stream(requests: int, min_prompt: int, max_prompt: int, new_tokens: int, mean_gap: float, vocab: int, seed: int):
    """[(arrival step, request id, prompt ids, new tokens)] in arrival order."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(mean_gap, requests)).astype(int)
    lengths = rng.integers(min_prompt, max_prompt + 1, requests)
    return [(int(a), f"r{i}", rng.integers(0, vocab, int(n)).tolist(), new_tokens)
            for i, (a, n) in enumerate(zip(arrivals, lengths))]


def kv_bytes_per_token(model) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def run_engine(model, plans, num_blocks: int, max_batch_tokens: int, session=None, kv_bytes=None,
               kv_budget_bytes=None) -> dict:
    """Drive one engine over the stream step by step; `session`: kvtopo's store (else the engine's own
    cache), admitted by its bytes when `kv_budget_bytes` is given."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    from kvtopo.serving.continuous_batching import KvtopoBatchingManager

    greedy = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    engine = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=BLOCK, max_batch_tokens=max_batch_tokens,
                                      safety_margin=0.0)
    manager = (KvtopoBatchingManager(model, session, greedy, engine, kv_budget_bytes=kv_budget_bytes)
               if session is not None
               else ContinuousBatchingManager(model, greedy, engine))
    processor = manager._create_batch_processor()
    manager.batch_processor, manager.current_batch = processor, 0
    pending, arrived, outputs, step = list(plans), {}, {}, 0
    peak_active = peak_bytes = 0
    phases = {"decode_only": [0, 0.0, 0], "prefill": [0, 0.0, 0]}  # steps, seconds, tokens generated
    t0 = time.perf_counter()
    with torch.no_grad():
        while len(outputs) < len(plans):
            while pending and pending[0][0] <= step:
                _, rid, prompt, new = pending.pop(0)
                manager.add_request(prompt, request_id=rid, max_new_tokens=new, record_timestamps=True)
                arrived[rid] = time.perf_counter()
            if len(arrived) > len(outputs):  # something to run (else only the clock of arrivals moves)
                batches, started = manager.current_batch, time.perf_counter()
                manager._generation_loop_body(processor, bootstrapping=False)
                if manager.current_batch > batches:  # a forward ran: what its batch held
                    batch = processor.inputs_and_outputs.requests_in_batch
                    phase = phases["decode_only" if all(r.query_length == 1 for r in batch) else "prefill"]
                    phase[0] += 1
                    phase[1] += time.perf_counter() - started
                    phase[2] += sum(r.has_new_token for r in batch)
                peak_active = max(peak_active, len(processor.scheduler.active_requests))
                held = session.stats().total_bytes if session is not None else kv_bytes
                peak_bytes = max(peak_bytes, held)
            while not manager.output_router.output_queue.empty():
                out = manager.output_router.output_queue.get()
                if out.is_finished() or out.error is not None:
                    outputs[out.request_id] = out
            step += 1
    wall = time.perf_counter() - t0
    failed = [rid for rid, out in outputs.items() if out.error is not None]
    if failed or len(outputs) != len(plans):
        raise RuntimeError(f"{len(outputs)} of {len(plans)} requests returned; failed: {failed}")
    generated = sum(len(out.generated_tokens) for out in outputs.values())
    ttft = [out.timestamps[0] - arrived[rid] for rid, out in outputs.items() if out.timestamps]
    misses = manager.kv_cache.budget_misses if session is not None else 0
    (decode_steps, decode_s, decode_tokens), (prefill_steps, prefill_s, _) = phases["decode_only"], phases["prefill"]
    return {"wall_s": round(wall, 2), "steps": step, "peak_concurrent": peak_active, "peak_kv_bytes": int(peak_bytes),
            "budget_misses": misses,
            "generated_tokens": generated, "decode_tokens_per_s": round(generated / wall, 2),
            "decode_only_steps": decode_steps, "decode_only_s": round(decode_s, 2), "decode_only_tokens": decode_tokens,
            "decode_only_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else None,
            "prefill_steps": prefill_steps, "prefill_s": round(prefill_s, 2),
            "median_ttft_s": round(statistics.median(ttft), 2) if ttft else None,
            "tokens": {rid: out.generated_tokens for rid, out in outputs.items()}}


# What each figure of a run means (written into the JSON next to them).
FIGURES = {
    "decode_tokens_per_s": "generated tokens / the whole run's wall time (prefill included)",
    "decode_only_tokens_per_s": "tokens generated in steps whose batch holds only decode steps / those steps' "
                                "wall time",
    "decode_only_steps": "engine steps whose batch holds only decode steps (one token per request)",
    "decode_only_s": "wall time of those steps",
    "decode_only_tokens": "tokens generated in those steps",
    "prefill_steps": "engine steps whose batch holds a prompt chunk (with or without decode steps)",
    "prefill_s": "wall time of those steps",
    "median_ttft_s": "median time from a request's arrival to its first generated token",
    "peak_concurrent": "most requests the scheduler held active at once",
    "peak_kv_bytes": "most K/V bytes held (the engine's own cache: its whole preallocated cache)",
}


def _ratio(a, b):
    return round(a / b, 2) if a is not None and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--min-prompt", type=int, default=4096)
    p.add_argument("--max-prompt", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--mean-gap", type=float, default=4.0, help="mean engine steps between arrivals")
    p.add_argument("--budget-mb", type=float, default=12.0, help="K/V bytes both engines may hold (MB)")
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--admission", choices=("ratio", "bytes"), default="ratio",
                   help="kvtopo admitted by target_ratio x the engine's blocks, or by its measured bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving.json"))
    args = p.parse_args()

    from kvtopo.config import Config
    from kvtopo.models import zoo
    from kvtopo.runtime.session import Session
    from kvtopo.serving.continuous_batching import ledger_blocks

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = zoo.build("llama")
    per_token = kv_bytes_per_token(model)
    budget = int(args.budget_mb * 1e6)
    blocks = budget // (per_token * BLOCK)
    if blocks * BLOCK < args.max_prompt + args.new_tokens:
        raise SystemExit(f"--budget-mb {args.budget_mb} holds {blocks * BLOCK} tokens: not one request of "
                         f"{args.max_prompt + args.new_tokens}; raise it")
    plans = stream(args.requests, args.min_prompt, args.max_prompt, args.new_tokens, args.mean_gap,
                   model.config.vocab_size, args.seed)
    compressed = Config()
    by_bytes = args.admission == "bytes"
    ledger = ledger_blocks([len(prompt) + new for _, _, prompt, new in plans], BLOCK)
    load_before = os.getloadavg()
    print(f"{args.requests} requests of {args.min_prompt}-{args.max_prompt} tokens + {args.new_tokens}; budget "
          f"{budget / 1e6:.1f} MB = {blocks} blocks of {BLOCK} tokens ({per_token} B/token in the engine's cache)",
          flush=True)

    runs = {}
    for name, session, num_blocks in (
            ("transformers paged cache", None, blocks),
            ("kvtopo lossless", Session(Config.lossless()), ledger if by_bytes else blocks),
            (f"kvtopo Config() (target_ratio={compressed.target_ratio:g})", Session(compressed),
             ledger if by_bytes else int(blocks * compressed.target_ratio)),
            # A prompt's chunks wait for its end by default (Config.prompt_hold_tokens): the same
            # coding with its pages moved as each chunk pushes them out of Recent.
            ("kvtopo Config(prompt_hold_tokens=0)", Session(compressed.replace(prompt_hold_tokens=0)),
             ledger if by_bytes else int(blocks * compressed.target_ratio))):
        # The engine's own cache is allocated whole: it holds the budget from the start.
        model = zoo.build("llama")
        if session is None:
            row = run_engine(model, plans, num_blocks, args.max_batch_tokens, kv_bytes=blocks * BLOCK * per_token)
        else:
            with session:
                row = run_engine(model, plans, num_blocks, args.max_batch_tokens, session=session,
                                 kv_budget_bytes=budget if by_bytes else None)
        row["engine_blocks"] = num_blocks
        row["within_budget"] = row["peak_kv_bytes"] <= budget
        runs[name] = row
        print(f"  {name:42s} peak concurrent {row['peak_concurrent']:3d}   {row['decode_tokens_per_s']:8.2f} tok/s   "
              f"decode-only steps {row['decode_only_tokens_per_s']} tok/s ({row['decode_only_steps']} steps)   "
              f"median TTFT {row['median_ttft_s']} s   peak KV {row['peak_kv_bytes'] / 1e6:7.2f} MB "
              f"({'within' if row['within_budget'] else 'OVER'} budget)", flush=True)

    own, lossless = runs["transformers paged cache"], runs["kvtopo lossless"]
    same = own["tokens"] == lossless["tokens"]
    print(f"lossless tokens equal the engine's own: {same}")
    for row in runs.values():
        row["vs_engine"] = {"concurrent": round(row["peak_concurrent"] / own["peak_concurrent"], 2),
                            "decode_tokens_per_s": round(row["decode_tokens_per_s"] / own["decode_tokens_per_s"], 2),
                            "decode_only_tokens_per_s": _ratio(row["decode_only_tokens_per_s"],
                                                               own["decode_only_tokens_per_s"])}
    result = {"model": "zoo llama (float32, CPU)", "args": vars(args), "threads": torch.get_num_threads(),
              "figures": FIGURES, "budget_bytes": budget,
              "engine_blocks_for_budget": blocks, "lossless_tokens_equal": same,
              "load_avg_before": [round(x, 2) for x in load_before],
              "load_avg_after": [round(x, 2) for x in os.getloadavg()], "command": command_line(__file__), "machine": describe_machine(),
              "runs": {name: {k: v for k, v in row.items() if k != "tokens"} for name, row in runs.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
