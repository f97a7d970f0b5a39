"""Instruction adherence under compression on SmolLM2-135M-Instruct, with and without protected spans.

    python bench/instruction_adherence.py            # 4 rules x 3 examples, ~1K-token documents
    python bench/instruction_adherence.py --quick    # 4 rules x 1 example, ~500 tokens, topo and snapkv

Each example (models/instruction_tasks.py): a system prompt with one rule code can check
(uppercase, an "Answer:" prefix, a closing DONE, a code word never revealed), a document with one
number fact, a question about it; the whole prompt in one prefill chunk (query-aware), 48 greedy
tokens. Every compressing policy runs twice: as is, and with ``protected_spans`` covering the
system prompt's tokens (its pages stay exact). Rows: rule adherence, fact recall and the achieved
``ratio_vs_fp16``. Float32 model compiled without Inductor (exact pages cost twice their fp16 bytes).
Writes bench/results/instruction_adherence[_quick].json.

Measured (--quick, 4 prompts of 612-760 tokens, 60-73 of them the system prompt, nominal 8x):
the full cache kept 1/4 rules and recalled 4/4 facts: SmolLM2-135M does not follow the three
format rules even uncompressed (it answers "The special magic number for ... is ..."), and keeps
the code word only because it never knew it ("The code word is "Ellipsis""), so on this model the
benchmark cannot show a rule forgotten under compression. topo: rules 1/4, facts 3/4 at 1.94x,
protected 1/4, 3/4 at 1.60x; snapkv: 1/4, 0/4 at 0.97x, protected 1/4, 0/4 at 0.88x (its exact
float32 Recent window exceeds the budget at these lengths).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (kivi's bits per nominal ratio)

import kvtopo  # noqa: E402
from kvtopo.models.instruction_tasks import RULES, make_instruction_example  # noqa: E402
from kvtopo.models.pretrained import chat_prompt, smollm2  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NEW_TOKENS = 48


def policy_config(policy: str, ratio: float) -> kvtopo.Config:
    """The policy at a nominal `ratio` (kivi has no budget: its bits set the ratio, 16 / bits)."""
    if policy == "full":
        return kvtopo.Config.lossless()
    if policy == "kivi":
        return kvtopo.Config(policy="kivi", target_ratio=None, mid_bits=quality.KIVI_BITS[ratio])
    return kvtopo.Config(policy=policy, target_ratio=ratio)


def system_tokens(tokenizer, system: str, ids: torch.Tensor) -> int:
    """Tokens of the templated system message at the start of `ids` (checked to be a prefix)."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    prefix = tokenizer(text, add_special_tokens=False).input_ids
    if ids[0, : len(prefix)].tolist() != prefix:
        raise RuntimeError("the chat template does not tokenize the system message as a prefix of the prompt")
    return len(prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=None, help="document tokens (default 1000, quick 500)")
    parser.add_argument("--examples", type=int, default=None, help="examples per rule (default 3, quick 1)")
    parser.add_argument("--policies", nargs="+", default=None,
                        help="compressing policies (default topo snapkv streaming h2o kivi; quick topo snapkv)")
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    tokens = args.tokens or (500 if args.quick else 1000)
    examples = args.examples or (1 if args.quick else 3)
    policies = args.policies or (["topo", "snapkv"] if args.quick else ["topo", "snapkv", "streaming", "h2o", "kivi"])

    model, tokenizer = smollm2(torch.float32)
    kvtopo.compile(model, inductor=False)
    count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    prompts = []
    for rule in RULES:
        for seed in range(examples):
            example = make_instruction_example(rule, tokens, seed, count)
            ids = chat_prompt(tokenizer, example.user, example.system)
            prompts.append((example, ids, system_tokens(tokenizer, example.system, ids)))
    runs = [("full", False)] + [(p, protect) for p in policies for protect in (False, True)]
    rows, answers = [], []
    for policy, protect in runs:
        start, adhered, recalled, ratios = time.perf_counter(), 0, 0, []
        for example, ids, span in prompts:
            config = policy_config(policy, args.ratio).replace(prefill_chunk_size=8192)
            if protect:
                config = config.replace(protected_spans=((0, span),))
            with kvtopo.session(config) as s:
                out = kvtopo.generate(model, ids, max_new_tokens=NEW_TOKENS, progress=False)
                ratios.append(s.stats().ratio_vs_fp16)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            adhered += example.adheres(answer)
            recalled += example.answered(answer)
            answers.append(dict(policy=policy, protected=protect, rule=example.rule, number=example.number,
                                prompt_tokens=ids.shape[1],
                                system_tokens=span, adheres=example.adheres(answer),
                                answered=example.answered(answer), ratio=ratios[-1], answer=answer))
        row = dict(policy=policy, protected=protect, nominal=1.0 if policy == "full" else args.ratio,
                   adherence=adhered / len(prompts), recall=recalled / len(prompts),
                   ratio=sum(ratios) / len(ratios), seconds=round(time.perf_counter() - start, 1))
        rows.append(row)
        print(f"{policy:>9} {'protected' if protect else 'as is':>9}: rules kept {adhered}/{len(prompts)}, "
              f"facts {recalled}/{len(prompts)}, {row['ratio']:.2f}x vs fp16 ({row['seconds']:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"instruction_adherence{'_quick' if args.quick else ''}.json"
    meta = dict(model="SmolLM2-135M-Instruct (float32)", document_tokens=tokens, examples_per_rule=examples,
                rules=list(RULES), new_tokens=NEW_TOKENS, ratio=args.ratio, setting="query-aware, one prefill chunk")
    path.write_text(json.dumps(dict(meta=meta, results=rows, answers=answers), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
