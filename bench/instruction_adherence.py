"""Instruction adherence under compression on SmolLM2-135M-Instruct, with and without protected spans.

    python bench/instruction_adherence.py            # 6 rules x 3 examples, ~2K-token documents, 5 policies
    python bench/instruction_adherence.py --quick    # 6 rules x 1 example, ~1K tokens, topo and snapkv
    python bench/instruction_adherence.py --rules name closing_time --policies topo snapkv --examples 4

Each example (models/instruction_tasks.py): a system prompt with one rule code can check, a
document with one number fact, and a question after it. Format rules (uppercase, an "Answer:"
prefix, a closing DONE, a code word never revealed) govern the answer to a question about the
fact; persona rules (the assistant's name, the reading room's closing time) are what the question
asks for. Two settings, as in bench/real_quality.py: query-aware (the whole prompt in one prefill
chunk) and query-agnostic (system prompt and document prefilled, and compressed, before the
question's chunk arrives). 32 greedy tokens. Every compressing policy runs twice: as is, and
with ``protected_spans`` covering the system prompt's tokens (its pages stay exact). Rows per
setting: rules kept (per rule and in all), facts recalled (over the examples that ask for the
fact) and the achieved ``ratio_vs_fp16``. Float32 model compiled without Inductor (exact pages
cost twice their fp16 bytes). Writes bench/results/instruction_adherence[_quick].json, or --out.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (kivi's bits per nominal ratio)
import real_quality  # noqa: E402  (the two settings' conversations, run through a session)
from machine import command_line, describe_machine  # noqa: E402

import kvtopo  # noqa: E402
from kvtopo.models.instruction_tasks import RULES, make_instruction_example  # noqa: E402
from kvtopo.models.pretrained import chat_prompt, smollm2  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
NEW_TOKENS = 32
SETTINGS = ("aware", "agnostic")


def policy_config(policy: str, ratio: float) -> kvtopo.Config:
    """The policy at a nominal `ratio` (kivi has no budget: its bits set the ratio, 16 / bits), the
    whole prompt in one prefill chunk per turn."""
    if policy == "full":
        config = kvtopo.Config.lossless()
    elif policy == "kivi":
        config = kvtopo.Config(policy="kivi", target_ratio=None, mid_bits=quality.KIVI_BITS[ratio])
    else:
        config = kvtopo.Config(policy=policy, target_ratio=ratio)
    return config.replace(**real_quality.WINDOWS)


def system_tokens(tokenizer, system: str, ids: torch.Tensor) -> int:
    """Tokens of the templated system message at the start of `ids` (checked to be a prefix)."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False)
    prefix = tokenizer(text, add_special_tokens=False).input_ids
    if ids[0, : len(prefix)].tolist() != prefix:
        raise RuntimeError("the chat template does not tokenize the system message as a prefix of the prompt")
    return len(prefix)


def turns_of(ids: list[int], question_at: int, setting: str) -> list[list[list[int]]]:
    """The conversation of one prompt (real_quality.converse): aware, one chunk; agnostic, the
    system prompt and document, then the question."""
    if setting == "aware":
        return [[ids]]
    if setting == "agnostic":
        return [[ids[:question_at], ids[question_at:]]]
    raise ValueError(f"unknown setting {setting!r}; expected one of {SETTINGS}")


def kept_per_rule(run: list[dict], rules) -> dict[str, int]:
    """How many answers of one run (setting, policy, protection) keep each rule; a row's adherence
    is their sum over the run's answers."""
    return {rule: sum(a["adheres"] for a in run if a["rule"] == rule) for rule in rules}


def rescore(path: Path) -> list[dict]:
    """Judge the answers stored in `path` again with the rules' current checks (for a check fixed
    after the run; the model is not run): each answer's `adheres`, each row's kept rules and
    adherence, written back, and the rescoring noted in `meta.rescored`. Returns the answers whose
    verdict changed, as they are now."""
    report = json.loads(path.read_text())
    changed = []
    for answer in report["answers"]:
        adheres = RULES[answer["rule"]].check(answer["answer"])
        if adheres != answer["adheres"]:
            answer["adheres"] = adheres
            changed.append(answer)
    for row in report["results"]:
        run = [a for a in report["answers"]
               if (a["setting"], a["policy"], a["protected"]) == (row["setting"], row["policy"], row["protected"])]
        row["kept_per_rule"] = kept_per_rule(run, row["kept_per_rule"])
        row["adherence"] = sum(row["kept_per_rule"].values()) / len(run)
    if changed:
        report["meta"].setdefault("rescored", []).append(dict(verdicts_changed=len(changed),
                                                              rules=sorted({a["rule"] for a in changed})))
    path.write_text(json.dumps(report, indent=1))
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=None, help="document tokens (default 2000, quick 1000)")
    parser.add_argument("--examples", type=int, default=None, help="examples per rule (default 3, quick 1)")
    parser.add_argument("--rules", nargs="+", choices=tuple(RULES), default=tuple(RULES))
    parser.add_argument("--policies", nargs="+", default=None,
                        help="compressing policies (default topo snapkv streaming h2o kivi; quick topo snapkv)")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=SETTINGS)
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=None, help="the JSON's path")
    parser.add_argument("--rescore", nargs="+", type=Path, default=None, metavar="JSON",
                        help="judge the answers stored in these JSONs again with the current rule checks and rewrite "
                             "them (no model run)")
    args = parser.parse_args()
    if args.rescore:
        for path in args.rescore:
            changed = rescore(path)
            print(f"{path}: {len(changed)} verdicts changed")
            for a in changed:
                print(f"  {a['setting']} {a['policy']} {'protected' if a['protected'] else 'as is'} {a['rule']}: "
                      f"{'kept' if a['adheres'] else 'broken'} by {a['answer']!r}")
        return
    tokens = args.tokens or (1000 if args.quick else 2000)
    examples = args.examples or (1 if args.quick else 3)
    policies = args.policies or (["topo", "snapkv"] if args.quick else ["topo", "snapkv", "streaming", "h2o", "kivi"])

    model, tokenizer = smollm2(torch.float32)
    kvtopo.compile(model, inductor=False)
    eos = real_quality.eos_ids(model)
    prompts = real_quality.Prompts(tokenizer)
    count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    cases = []
    for rule in args.rules:
        for seed in range(examples):
            example = make_instruction_example(rule, tokens, seed, count)
            ids = chat_prompt(tokenizer, example.user, example.system)
            span = system_tokens(tokenizer, example.system, ids)
            ids = ids[0].tolist()
            cases.append((example, ids, span, prompts.end_of(example.document, ids)))
    runs = [("full", False)] + [(p, protect) for p in policies for protect in (False, True)]
    rows, answers = [], []
    for setting in args.settings:
        for policy, protect in runs:
            start, ratios = time.perf_counter(), []
            recalled = asked = 0
            for example, ids, span, question_at in cases:
                config = policy_config(policy, args.ratio)
                if protect:
                    config = config.replace(protected_spans=((0, span),))
                (answer_ids,), (memory,) = real_quality.run_kvtopo(model, config, turns_of(ids, question_at, setting),
                                                                   [NEW_TOKENS], eos)
                ratios.append(memory["ratio"])
                answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
                adheres = example.adheres(answer)
                answered = example.answered(answer) if example.asks_fact else None
                asked += example.asks_fact
                recalled += bool(answered)
                answers.append(dict(setting=setting, policy=policy, protected=protect, rule=example.rule,
                                    number=example.number, prompt_tokens=len(ids), system_tokens=span,
                                    adheres=adheres, answered=answered, ratio=ratios[-1], answer=answer))
            kept = kept_per_rule(answers[-len(cases):], args.rules)
            row = dict(setting=setting, policy=policy, protected=protect,
                       nominal=1.0 if policy == "full" else args.ratio,
                       adherence=sum(kept.values()) / len(cases), kept_per_rule=kept, examples_per_rule=examples,
                       recall=recalled / asked if asked else None, ratio=sum(ratios) / len(ratios),
                       seconds=round(time.perf_counter() - start, 1))
            rows.append(row)
            per_rule = " ".join(f"{rule} {n}/{examples}" for rule, n in kept.items())
            facts = f", facts {recalled}/{asked}" if asked else ""
            print(f"{setting:>8} {policy:>9} {'protected' if protect else 'as is':>9}: rules kept "
                  f"{sum(kept.values())}/{len(cases)} ({per_rule}){facts}, {row['ratio']:.2f}x vs fp16 "
                  f"({row['seconds']:.0f} s)", flush=True)
    path = args.out or RESULTS / f"instruction_adherence{'_quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(model="SmolLM2-135M-Instruct (float32)", document_tokens=tokens, examples_per_rule=examples,
                rules=list(args.rules), new_tokens=NEW_TOKENS, ratio=args.ratio, settings=list(args.settings),
                command=command_line(__file__), machine=describe_machine())
    path.write_text(json.dumps(dict(meta=meta, results=rows, answers=answers), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
