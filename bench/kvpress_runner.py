"""kvpress's presses on bench/real_quality.py's examples; run inside .venv-kvpress (`make kvpress-env`).

    .venv-kvpress/bin/python bench/kvpress_runner.py REQUEST.json ANSWERS.json

bench/real_quality.py writes REQUEST.json (token ids of every example's conversation per setting,
prose prefixes with the full cache's continuation, the presses and nominal ratios, dtype, eos
ids) and reads ANSWERS.json back. kvpress 0.5.5 needs transformers < 5.3, the project a newer 5.x,
hence the separate venv and process; the model is the same GGUF file (models/pretrained.py).

Each press is kvpress's own class, applied as kvpress's pipeline applies it: `with press(model):`
around one forward of the tokens to compress into a fresh DynamicCache (the hooks compress only
that prefill), then the rest of the conversation -- question, greedy answer, next turn -- with
the compressed cache and explicit positions that continue the uncompressed ones, outside the
press. The conversation loop and teacher forcing are real_quality.py's (`converse`,
`forced_logits`), so both sides feed identical ids the same way. A press runs at
`compression_ratio = 1 - 1/r` for nominal r; `kept` is the tokens the cache still shows attention
at the end of each answer (of the forced text, in fidelity) over every token seen by then, on the
basis kvtopo's `kept` uses (the question and answers, held uncompressed, count); `prefill_kept`
is the cache's tokens after the prefill over the tokens prefilled. Both are averaged over layers
(KVzip's per-layer ratios differ). "full" is no press:
the kvpress environment's own full cache, the reference for KL and a check against kvtopo's.
"""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _imports():
    try:
        import kvpress
        import transformers
    except ImportError as err:
        raise SystemExit(f"bench/kvpress_runner.py needs kvpress ({err}); run it with .venv-kvpress/bin/python "
                         "after `make kvpress-env`") from err
    return kvpress, transformers


kvpress, transformers = _imports()
from real_quality import converse, forced_logits  # noqa: E402
from quality import kl_rows  # noqa: E402

PRESSES = {
    "snapkv": kvpress.SnapKVPress,
    "expected_attention": kvpress.ExpectedAttentionPress,
    "knorm": kvpress.KnormPress,
    "streaming_llm": kvpress.StreamingLLMPress,
    "tova": kvpress.TOVAPress,
    "keydiff": kvpress.KeyDiffPress,
    "kvzip": kvpress.KVzipPress,
}


class PressForward:
    """`forward` for `converse`: the first call is the prefill, under `press` (None: no press)."""

    def __init__(self, model, press):
        self.model, self.press = model, press
        self.cache = transformers.DynamicCache()
        self.position = 0
        self.prefill_kept = None

    def __call__(self, ids) -> torch.Tensor:
        first = self.position == 0
        n = len(ids)
        scope = self.press(self.model) if first and self.press is not None else contextlib.nullcontext()
        with scope:
            out = self.model(input_ids=torch.tensor([ids]), past_key_values=self.cache, use_cache=True,
                             position_ids=torch.arange(self.position, self.position + n)[None], logits_to_keep=1)
        if first:
            self.prefill_kept = kept_fraction(self.model, self.cache, n)
        self.position += n
        return out.logits[0, -1].float()

    def kept(self) -> float:
        """The share of every token seen so far that attention still sees."""
        return kept_fraction(self.model, self.cache, self.position)


def kept_fraction(model, cache, seen: int) -> float:
    """The (layer, kv-head, token) entries attention still sees over `seen` tokens: what the cache
    holds, less what kvpress masks head-wise (`masked_key_indices`: KVzip keeps every token and
    hides the evicted ones from attention)."""
    heads = model.config.num_key_value_heads
    held = 0
    for layer, block in zip(cache.layers, model.model.layers):
        masked = getattr(block.self_attn, "masked_key_indices", None)
        held += layer.keys.shape[-2] * heads - (len(masked[0]) if masked is not None else 0)
    return held / (len(cache.layers) * heads * seen)


def make_press(name: str, nominal: float):
    return None if name == "full" else PRESSES[name](compression_ratio=1.0 - 1.0 / nominal)


def tokenizer_for_kvzip(model, tokenizer, work: Path) -> None:
    """KVzipPress loads the tokenizer from `model.config.name_or_path`; a GGUF model has none there.
    Saved as is, transformers 5.2 reloads it as a CodeLlamaTokenizer that maps most text to <unk>;
    its tokenizer.json read as a plain fast tokenizer encodes like the original (checked)."""
    tokenizer.save_pretrained(work)
    config_path = work / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config))
    reloaded = transformers.AutoTokenizer.from_pretrained(work)
    probe = "Repeat the previous context exactly.\n\n<|im_end|>\n<|im_start|>assistant\n"
    if reloaded(probe, add_special_tokens=False).input_ids != tokenizer(probe, add_special_tokens=False).input_ids:
        raise RuntimeError(f"the tokenizer saved in {work} for KVzipPress does not encode like the model's")
    model.config.name_or_path = str(work)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit("usage: kvpress_runner.py REQUEST.json ANSWERS.json")
    request = json.loads(Path(argv[0]).read_text())
    unknown = [p for p in request["presses"] if p not in PRESSES]
    if unknown:
        raise SystemExit(f"unknown presses {unknown}; known: {sorted(PRESSES)}")
    torch.set_num_threads(request["threads"])
    started = time.perf_counter()
    from kvtopo.models.pretrained import smollm2

    model, tokenizer = smollm2(getattr(torch, request["dtype"]))
    work = tempfile.TemporaryDirectory(prefix="kvpress-tokenizer-")  # removed when the process ends
    if "kvzip" in request["presses"]:
        tokenizer_for_kvzip(model, tokenizer, Path(work.name))
    eos = request["eos"]
    methods = [("full", 1.0)] + [(p, r) for p in request["presses"] for r in request["ratios"]]
    total = len(methods) * (sum(len(e["settings"]) for e in request["examples"]) + len(request["fidelity"]))
    done, rows, fidelity = 0, [], []

    def progress(what: str) -> None:
        nonlocal done
        done += 1
        print(f"kvpress {done}/{total} ({time.perf_counter() - started:.0f} s): {what}", file=sys.stderr, flush=True)

    with torch.no_grad():
        for example in request["examples"]:
            for setting, conv in example["settings"].items():
                for name, nominal in methods:
                    forward, kept = PressForward(model, make_press(name, nominal)), []
                    answers = converse(forward, conv["turns"], conv["max_new"], eos,
                                       on_answer=lambda _: kept.append(forward.kept()))
                    rows.append(dict(id=example["id"], setting=setting, press=name, nominal=nominal, answers=answers,
                                     kept=kept, prefill_kept=forward.prefill_kept))
                    progress(f"{example['id']} {setting} {name} {nominal:g}x")
        for text in request["fidelity"]:
            reference = None
            for name, nominal in methods:
                forward = PressForward(model, make_press(name, nominal))
                logits = forced_logits(forward, text["prefix"], text["forced"])
                agree = float((logits.argmax(-1) == torch.tensor(text["forced"])).float().mean())
                if name == "full":
                    reference = logits
                fidelity.append(dict(id=text["id"], length=text["length"], seed=text["seed"], press=name,
                                     nominal=nominal, kl=float(kl_rows(reference, logits).mean()), agree=agree,
                                     kept=forward.kept(), prefill_kept=forward.prefill_kept))
                progress(f"fidelity {text['id']} {name} {nominal:g}x")
    meta = dict(kvpress=getattr(kvpress, "__version__", None) or _version("kvpress"),
                transformers=transformers.__version__, torch=torch.__version__, python=platform.python_version(),
                seconds=time.perf_counter() - started)
    Path(argv[1]).write_text(json.dumps(dict(meta=meta, rows=rows, fidelity=fidelity)))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
