"""The real-model benchmark's pieces without the real model: task generators and scorers
(models/real_tasks.py), the conversation loop on a tiny zoo model against kvtopo.generate, the
prompt segments in SmolLM2's chat template (its tokenizer only), and the kvpress runner in its
own environment on a tiny Llama (skipped, with the reason, where `make kvpress-env` was not run).

`bench/real_quality.py --quick` itself needs the real model for several minutes: it is not run here.
"""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import kvtopo
from kvtopo.models import real_tasks as R
from kvtopo.models import zoo

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import real_quality  # noqa: E402


def words(text: str) -> int:
    return len(text.split())


def all_examples(length=400, seeds=(0, 1)):
    return [R.make_example(task, length, seed, words) for task in R.TASKS for seed in seeds]


def test_examples_are_deterministic_and_fill_the_length():
    for task in R.TASKS:
        a, b = R.make_example(task, 400, 3, words), R.make_example(task, 400, 3, words)
        assert a == b
        assert 0.8 * 400 <= words(a.user()) <= 400, (task, words(a.user()))
        assert R.make_example(task, 400, 4, words) != a
        assert a.user().startswith(a.instruction) and a.questions[0].text in a.user()


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text, re.IGNORECASE) is not None


def test_every_answer_is_in_the_document_not_in_the_instruction_or_question():
    for ex in all_examples():
        for q in ex.questions:
            for answer in q.answers:
                assert _has_word(ex.document, answer), (ex.task, answer)
                assert not _has_word(ex.instruction, answer) and not _has_word(q.text, answer), (ex.task, answer)


def test_the_scorer_accepts_the_right_answer_and_rejects_wrong_or_hedged_ones():
    for ex in all_examples(seeds=(0, 1, 2)):
        for q in ex.questions:
            right = "The answer is " + ", ".join(q.answers) + "."
            assert R.score(right, q), (ex.task, right)
            assert R.score(right.upper() if q.kind == "uuid" else right, q)
            wrong = _other(q)
            swapped = "The answer is " + ", ".join((wrong,) + q.answers[1:]) + "."
            assert not R.score(swapped, q), (ex.task, swapped)
            assert not R.score(right + " Or maybe " + wrong + ".", q), ex.task
            assert not R.score("I do not know.", q)
            if len(q.answers) > 1:
                assert not R.score("The answer is " + q.answers[0] + ".", q)
            if q.kind in ("number", "uuid"):  # the value inside a longer one is another value
                for longer in ("1" + q.answers[0], q.answers[0] + "1"):
                    assert not R.score("The answer is " + ", ".join((longer,) + q.answers[1:]) + ".", q), longer


def test_has_number_finds_the_number_itself_only():
    assert R.has_number(4821, "The code is 4821.") and R.has_number("4821", "4821")
    assert not R.has_number(4821, "The code is 14821.") and not R.has_number(4821, "48210")
    assert R.has_number(4821937, "It is 4,821,937.") and not R.has_number(4821937, "It is 4821937.5")


def _other(q: R.Question) -> str:
    """A value of the question's kind that is not an answer."""
    if q.kind == "number":
        return str(int(q.answers[0]) + 1)
    if q.kind == "uuid":
        return "00000000-0000-4000-8000-000000000000"
    if q.kind == "varname":
        return "QQQQQ"
    return next(w for w in q.vocabulary if w.lower() not in {a.lower() for a in q.answers})


def test_score_rejects_a_non_string():
    q = R.make_example("niah_number", 400, 0, words).questions[0]
    with pytest.raises(TypeError, match="str"):
        R.score(None, q)


def test_closed_lists_are_single_disjoint_words_absent_from_the_filler():
    prose = " ".join(R.prose_paragraphs()).lower()
    lists = [R.CITIES, R.WORDS, R.NAMES, R.JOBS, R.PETS, R.PET_NAMES, R.COLORS]
    seen = set()
    for values in lists:
        for value in values:
            assert re.fullmatch(r"[A-Za-z]+", value), value
            assert value.lower() not in seen, value
            seen.add(value.lower())
            assert not re.search(rf"\b{value.lower()}\b", prose), value
    raw = " ".join(R.prose_paragraphs())
    assert "special magic" not in prose and "VAR " not in raw
    assert not re.search(r"\b\d{7}\b", prose)


def test_cwe_has_one_clear_winner_and_vartrack_keeps_chain_order():
    for seed in range(3):
        ex = R.make_example("cwe", 400, seed, words)
        counts = Counter(line.split(". ", 1)[1] for line in ex.document.splitlines())
        (winner, top), (_, second) = counts.most_common(2)
        assert (winner,) == ex.questions[0].answers and top >= 6 and top > 2 * second
        assert set(counts) == set(ex.questions[0].vocabulary)
        ex = R.make_example("vartrack", 400, seed, words)
        for name, value in re.findall(r"VAR ([A-Z]{5}) = (\d{7})\.", ex.document):
            alias = re.search(rf"VAR ([A-Z]{{5}}) = VAR {name}\.", ex.document)
            assert alias and ex.document.index(f"VAR {name} = {value}") < alias.start()
            assert any(q.answers == (value,) and alias.group(1) in q.text for q in ex.questions)


def test_bad_task_or_length_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        R.make_example("nope", 512, 0, words)
    with pytest.raises(ValueError, match="length"):
        R.make_example("qa", 64, 0, words)
    with pytest.raises(ValueError, match="exceeds"):
        R.make_example("qa", 200, 0, lambda text: 10 * words(text))


# -- the conversation loop ---------------------------------------------------------------------------
class Scripted:
    """A forward that answers from a script and records what it was fed."""

    def __init__(self, script):
        self.script, self.fed = list(script), []

    def __call__(self, ids):
        self.fed.append(list(ids))
        logits = torch.zeros(10)
        logits[self.script.pop(0)] = 1.0
        return logits


def test_converse_stops_at_eos_unfed_and_feeds_a_cut_token_before_the_next_turn():
    # turn 0: chunks [1,2] and [3] -> 5, 6, eos(9); turn 1: [4] -> 7, 8 (limit 2, cut)
    forward = Scripted([0, 5, 6, 9, 7, 8])
    answered = []
    answers = real_quality.converse(forward, [[[1, 2], [3]], [[4]]], [4, 2], [9], answered.append)
    assert answers == [[5, 6], [7, 8]] and answered == [0, 1]
    assert forward.fed == [[1, 2], [3], [5], [6], [4], [7]]
    forward = Scripted([5, 6])
    assert real_quality.converse(forward, [[[1]], [[4]]], [1, 1], [9]) == [[5], [6]]
    assert forward.fed == [[1], [5, 4]]  # the cut token 5 goes in before the next turn


def test_settings_split_the_same_ids():
    segments = dict(context=[1, 2, 3], questions=[[4, 5], [6]], max_new=[8, 9])
    assert real_quality.conversation(segments, "aware") == ([[[1, 2, 3, 4, 5]]], [8])
    assert real_quality.conversation(segments, "agnostic") == ([[[1, 2, 3], [4, 5]], [[6]]], [8, 9])
    with pytest.raises(ValueError, match="unknown setting"):
        real_quality.conversation(segments, "other")


def test_session_forward_gives_kvtopo_generate_tokens_in_one_chunk_or_two():
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    config = kvtopo.Config.lossless(prefill_chunk_size=64)
    expected = kvtopo.generate(model, prompt, 12, config=config, eos_token_id=None)[0, 40:].tolist()
    ids = prompt[0].tolist()
    for turns in ([[ids]], [[ids[:25], ids[25:]]]):
        answers, memory = real_quality.run_kvtopo(model, config, turns, [12], eos=[])
        assert answers == [expected]
        assert memory[0]["kept"] == 1.0 and memory[0]["ratio"] > 0
    small = kvtopo.Config.lossless(prefill_chunk_size=16)  # the forward splits into the session's chunks
    assert real_quality.run_kvtopo(model, small, [[ids]], [12], eos=[])[0] == [expected]


def test_a_served_answer_reports_its_own_requests_budget_not_the_sessions():
    """Served together, each answer's `budget_missed` is its request's, as one conversation at a time
    reports it: a request that met its budget is not marked missed because another one missed."""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    served = zoo.build("llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (120, 90, 150)]
    config = kvtopo.Config(target_ratio=1.2, page_size=8, sink_tokens=8, recent_tokens=16, observation_window=8,
                           prefill_chunk_size=16)
    alone = [real_quality.run_kvtopo(model, config, [[ids]], [6], eos=[])[1][0]["budget_missed"] for ids in prompts]
    memory = real_quality.serve_kvtopo(served, config, prompts, [6, 6, 6], eos=[-1], batch_tokens=16)[1]
    assert [m["budget_missed"] for m in memory] == alone
    assert 0 < sum(alone) < len(alone)  # some met their budget, some did not


def test_served_prompts_give_the_sessions_answers_and_only_one_turn_is_served(capsys):
    """`--engine continuous-batching`: a cell's prompts served together by transformers' engine
    (split into 16-token forwards) answer as one conversation at a time does, each cut at its own
    limit and at an eos; the agnostic setting (two chunks, a second turn) is refused. (Served
    uncompiled: a compiled model batches as the uncompiled one, tests/serving.)"""
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    served = zoo.build("llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 23, 57)]
    config = kvtopo.Config.lossless(prefill_chunk_size=16)
    alone = [real_quality.run_kvtopo(model, config, [[ids]], [limit], eos=[])[0][0]
             for ids, limit in zip(prompts, (12, 5, 9))]
    answers, memory = real_quality.serve_kvtopo(served, config, prompts, [12, 5, 9], eos=[-1], batch_tokens=16)
    assert answers == alone and [len(a) for a in answers] == [12, 5, 9]
    assert [m["kept"] for m in memory] == [1.0] * 3 and all(m["ratio"] > 0 for m in memory)
    assert memory[0]["fp16_bytes"] < memory[2]["fp16_bytes"]  # each request's own: 40 + 11 against 57 + 8 tokens
    eos = alone[0][3]
    cut = real_quality.serve_kvtopo(served, config, prompts[:1], [12], eos=[eos], batch_tokens=16)[0][0]
    assert cut == alone[0][:alone[0].index(eos)]
    with pytest.raises(SystemExit):
        real_quality.parse_args(["--engine", "continuous-batching", "--settings", "agnostic"])
    assert "--settings aware only" in capsys.readouterr().err
    assert real_quality.parse_args(["--engine", "continuous-batching"]).settings == ["aware"]


# -- the real model's chat template (tokenizer only) ----------------------------------------------------
@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from kvtopo.models.pretrained import weights_path

    path = weights_path()
    return real_quality.Prompts(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))


def test_segments_are_the_chat_prompt_split_after_the_document(prompts):
    from kvtopo.models.pretrained import chat_prompt

    ex = R.make_example("qa", 512, 0, prompts.count)
    assert prompts.count(ex.user()) <= 512
    seg = prompts.segments(ex)
    assert seg["context"] + seg["questions"][0] == chat_prompt(prompts.tokenizer, ex.user())[0].tolist()
    decode = prompts.tokenizer.decode
    assert decode(seg["context"]).endswith(ex.document.split()[-1])
    assert decode(seg["questions"][0]).strip().startswith(ex.questions[0].text)
    second = decode(seg["questions"][1])
    assert second.startswith("<|im_end|>") and ex.questions[1].text in second and second.endswith("assistant\n")
    assert seg["max_new"] == [q.max_new_tokens for q in ex.questions]


# -- kvpress, in its own environment ----------------------------------------------------------------------
def test_missing_kvpress_env_names_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setattr(real_quality, "KVPRESS_PYTHON", tmp_path / "none" / "bin" / "python")
    with pytest.raises(SystemExit, match="make kvpress-env"):
        real_quality.run_kvpress({}, tmp_path)


KVPRESS_CHECK = r"""
import json, sys, torch, transformers
sys.path.insert(0, "bench")
import kvpress_runner as K
from real_quality import converse
cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).eval()
ids = torch.randint(3, 256, (1, 200)).tolist()[0]
out = {}
with torch.no_grad():
    ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    out["hf"] = ref[0, 200:].tolist()
    full = K.PressForward(model, None)
    out["full"] = converse(full, [[ids]], [8], [])[0]
    out["full_kept"] = full.kept()
    for name in ("snapkv", "knorm", "streaming_llm"):
        press = K.make_press(name, 4.0)
        forward, kept = K.PressForward(model, press), []
        answer = converse(forward, [[ids[:150], ids[150:]]], [8], [], on_answer=lambda _: kept.append(forward.kept()))[0]
        out[name] = [type(press).__module__, answer, forward.prefill_kept, kept]
from pathlib import Path
import tempfile
from kvtopo.models.pretrained import weights_path
path = weights_path()
tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
with tempfile.TemporaryDirectory() as work:
    K.tokenizer_for_kvzip(model, tokenizer, Path(work))  # raises if the saved tokenizer encodes otherwise
    out["kvzip_tokenizer"] = transformers.AutoTokenizer.from_pretrained(model.config.name_or_path)(
        "Repeat the previous context exactly.", add_special_tokens=False).input_ids
    out["tokenizer"] = tokenizer("Repeat the previous context exactly.", add_special_tokens=False).input_ids
print(json.dumps(out))
"""


def test_kvpress_runner_presses_a_tiny_llama():
    python = real_quality.KVPRESS_PYTHON
    if not python.exists():
        # CI builds it (.ci/run); elsewhere it is an optional, separate environment.
        message = f"{python} missing: `make kvpress-env` builds kvpress's environment"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    proc = subprocess.run([str(python), "-c", KVPRESS_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["full"] == out["hf"] and out["full_kept"] == 1.0
    for name in ("snapkv", "knorm", "streaming_llm"):
        module, answer, prefill_kept, kept = out[name]
        assert module.startswith("kvpress.presses.") and len(answer) == 8
        assert prefill_kept == pytest.approx(0.25, abs=0.01)  # 1 - 1/4 of the 150 context tokens removed
        # At the answer's end: those, the 50 tokens after them and the 7 answer tokens fed, all held,
        # over the 207 seen (the last answer token, cut by the limit, is not fed).
        assert kept == [pytest.approx((150 * prefill_kept + 50 + 7) / 207, abs=1e-6)]
    assert out["kvzip_tokenizer"] == out["tokenizer"] and 0 not in out["tokenizer"]


def test_prefill_chunk_and_hold_reach_every_session_config_and_bad_values_are_refused(capsys):
    import quality

    saved = dict(quality.WINDOWS)
    try:
        real_quality.use_windows(real_quality.parse_args([]))
        whole = real_quality.config_of(dict(policy="topo", overrides=dict(target_ratio=4.0)))
        real_quality.use_windows(real_quality.parse_args(["--prefill-chunk", "512"]))
        chunked = real_quality.config_of(dict(policy="topo", overrides=dict(target_ratio=4.0)))
        real_quality.use_windows(real_quality.parse_args(["--prefill-chunk", "512", "--prompt-hold-tokens", "0"]))
        unheld = real_quality.config_of(dict(policy="topo", overrides=dict(target_ratio=4.0)))
    finally:
        quality.WINDOWS.clear()
        quality.WINDOWS.update(saved)
    assert whole.prefill_chunk_size == real_quality.WINDOWS["prefill_chunk_size"] == 8192
    assert chunked.prefill_chunk_size == 512 and chunked.prompt_hold_tokens == kvtopo.Config().prompt_hold_tokens
    assert chunked.replace(prefill_chunk_size=8192) == whole  # nothing else changes
    assert unheld == chunked.replace(prompt_hold_tokens=0)
    for bad in (["--prefill-chunk", "0"], ["--prompt-hold-tokens", "-1"]):
        with pytest.raises(SystemExit):
            real_quality.parse_args(bad)
        assert "--prefill-chunk must be >= 1" in capsys.readouterr().err


def test_measured_lengths_pick_solved_cells_and_merge_a_remeasured_task(tmp_path, capsys):
    from types import SimpleNamespace

    def measure(tasks, accuracy):
        args = SimpleNamespace(tasks=tasks, dtype="float32", examples=5, seed_offset=1000, out=tmp_path)
        results = [dict(task=t, length=n, accuracy=a) for t in tasks for n, a in accuracy.items()]
        rows = [dict(task=t, length=n) for t in tasks for n in accuracy]
        return real_quality.write_lengths(args, results, rows, {"total": 1.0}, "lengths")

    first = measure(list(R.TASKS), {2048: 0.8, 512: 1.0, 1024: 0.6})
    assert first["cells"]["qa"] == [512, 2048]  # >= 0.8, in length order
    again = measure(["qa"], {512: 0.4})
    assert again["cells"]["qa"] == [] and again["cells"]["cwe"] == [512, 2048]
    assert len(again["examples"]) == 3 * (len(R.TASKS) - 1) + 1 and len(again["meta"]["runs"]) == 2
    assert json.loads((tmp_path / "lengths.json").read_text())["accuracy"]["qa"] == {"512": 0.4}
    args = SimpleNamespace(tasks=["qa"], dtype="bfloat16", examples=5, seed_offset=1000, out=tmp_path)
    other = real_quality.write_lengths(args, [dict(task="qa", length=512, accuracy=1.0)], [], {}, "lengths")
    assert list(other["cells"]) == ["qa"] and "measured otherwise" in capsys.readouterr().out
