"""`kvtopo export onnx|mlir MODEL --out DIR [--config JSON] [--max-context N] [--target RUNTIME] [--profile npu]`.

MODEL is a zoo name, `smollm2` (the project's real model, models/pretrained.py), or a path: a
Hugging Face checkpoint directory or a `.gguf` file. Real models are loaded in float32, the
precision the graphs are exported in. A config or model the export refuses (an unsupported policy,
refused attention, a sliding window, a hybrid) is a usage error: its reason, exit status 2.

`--target` compiles the export for a runtime of this machine and smoke-runs it: a prompt and a few
greedy steps through HostRunner on that runtime and through the PyTorch session; the exit status
is 1 when the tokens differ (other than at a near-tie, export/check.py) or a logit differs by more
than --max-logit-error. The prompt is prose from models/real_tasks.py when the model comes
with a tokenizer, random token ids otherwise; by default just long enough that a page reaches Mid
under the config (so the compressor runs), where --max-context allows: a run that reaches no Mid
page says so. --smoke-prompt, --smoke-tokens and --max-logit-error are usage errors without
--target. onnx: onnxruntime or openvino; mlir: iree (the MLIR is then exported with a dynamic
token count and compiled to .vmfb, export_iree).

`--profile npu` exports fully static graphs with float16 at their boundaries (batch 1, one token
per decode-step call, the cache capacities of --max-context; export/layout.py); the smoke run then
prefills one token per call and compares with the float32 session doing the same.

Registered by adding `add_export` to `SUBCOMMANDS` in kvtopo/cli.py:
    from kvtopo.export_cli import add_export
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtopo.export import DEFAULT_MAX_CONTEXT, DEFAULT_MLIR_MAX_CONTEXT, out_dir_problem


def add_export(subparsers) -> None:
    from kvtopo.models import zoo

    p = subparsers.add_parser(
        "export", help="export a model's decode step and page compressor to ONNX or MLIR",
        description="Export the kvtopo-rewritten decode step (cache as explicit tensors) and the exp-free page "
                    "compressor. onnx: decode_step.onnx, compressor.onnx, layout.json (run with "
                    "kvtopo.export.host_runner.HostRunner). mlir: <graph>.<torch|linalg-on-tensors|stablehlo>.mlir.")
    p.add_argument("format", choices=("onnx", "mlir"))
    p.add_argument("model", metavar="MODEL",
                   help=f"zoo model name ({', '.join(zoo.ZOO_MODELS)}), {PRETRAINED} (SmolLM2-135M-Instruct), or a "
                        "path to a Hugging Face checkpoint directory or a .gguf file (loaded in float32)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--config", metavar="JSON", default=None,
                   help='kvtopo Config fields as JSON (or a path to a JSON file), e.g. \'{"page_size": 16}\'')
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help=f"tokens the fixed cache buffers hold (default: {DEFAULT_MAX_CONTEXT} for onnx, "
                        f"{DEFAULT_MLIR_MAX_CONTEXT} for mlir)")
    p.add_argument("--target", choices=sorted(TARGET_FORMAT), default=None,
                   help="compile for this runtime and smoke-run against the PyTorch session "
                        "(onnx: onnxruntime|openvino; mlir: iree)")
    p.add_argument("--profile", choices=("npu",), default=None,
                   help="npu: static shapes (batch 1, 1 token per decode-step call, fixed cache buffers) and "
                        "float16 cache/activation tensors at the graph boundary")
    p.add_argument("--smoke-tokens", type=int, default=None, metavar="N",
                   help=f"greedy steps of the smoke run after the prompt, with --target (default: {SMOKE_TOKENS})")
    p.add_argument("--smoke-prompt", type=int, default=None, metavar="N",
                   help="prompt tokens of the smoke run, with --target (default: the fewest after which a page is "
                        "Mid under --config, so that the compressor runs: sink + Recent + Terminal pages and one "
                        "token more, 321 for Config(); at most --max-context minus --smoke-tokens)")
    p.add_argument("--max-logit-error", type=float, default=None, metavar="E",
                   help="the largest logit difference from the PyTorch session the smoke run accepts, with --target "
                        f"(default: {MAX_LOGIT_ERROR})")
    p.set_defaults(run=_run_export)


TARGET_FORMAT = {"onnxruntime": "onnx", "openvino": "onnx", "iree": "mlir"}
PRETRAINED = "smollm2"
SMOKE_TOKENS = 8
# The smoke run's default bound on |runtime - session| logits: float32 runtimes differ from PyTorch
# by summation order, up to 1.5e-2 measured (SmolLM2 on onnxruntime and OpenVINO,
# tests/export/test_smollm2_export.py, docs/measurements.md; zoo models 1e-4 to 1e-2), while a
# runtime that drops or misreads part of the cache is off by whole logits. A larger model may need
# a larger bound: --max-logit-error.
MAX_LOGIT_ERROR = 0.1


def load_model(spec: str):
    """The model MODEL names, as `(model, tokenizer or None)`: a zoo name, `smollm2`, or a path
    to a Hugging Face checkpoint directory or a GGUF file (float32)."""
    import torch

    from kvtopo.cli import UsageError
    from kvtopo.models import pretrained, zoo

    if spec in zoo.ZOO_MODELS:
        return zoo.build(spec), None
    if spec == PRETRAINED:
        return pretrained.smollm2(torch.float32)
    if not Path(spec).expanduser().exists() and "/" not in spec and not spec.endswith(".gguf"):
        raise UsageError(f"unknown model {spec!r}: not a zoo name ({', '.join(zoo.ZOO_MODELS)}), not {PRETRAINED}, "
                         "and no file or directory of that name")
    try:
        return pretrained.load_checkpoint(spec, torch.float32)
    except pretrained.CheckpointError as err:
        raise UsageError(f"model path {err}") from None


def _run_export(args: argparse.Namespace) -> int:
    from kvtopo.cli import UsageError, parse_config

    if args.max_context is not None and args.max_context < 1:
        raise UsageError(f"--max-context {args.max_context} is invalid: an int >= 1 (tokens)")
    if args.target is not None and TARGET_FORMAT[args.target] != args.format:
        raise UsageError(f"--target {args.target} runs {TARGET_FORMAT[args.target]} exports, not {args.format}")
    smoke_options = (("--smoke-tokens", args.smoke_tokens), ("--smoke-prompt", args.smoke_prompt),
                     ("--max-logit-error", args.max_logit_error))
    if args.target is None and any(value is not None for _, value in smoke_options):
        given = " and ".join(option for option, value in smoke_options if value is not None)
        raise UsageError(f"{given} without --target: they set the smoke run, which only --target does")
    max_context = args.max_context or (DEFAULT_MAX_CONTEXT if args.format == "onnx" else DEFAULT_MLIR_MAX_CONTEXT)
    config = parse_config(args.config)
    mid_after = None
    if args.target is not None:
        mid_after = tokens_to_mid(config, max_context)
        _check_smoke(args, max_context, mid_after)
    try:
        from kvtopo import export as kx
    except ImportError:
        import export as kx
    try:
        kx.layout.check_exportable(config)
    except NotImplementedError as err:
        raise UsageError(f"--config: {err}") from None
    _check_out(args.out)
    model, tokenizer = load_model(args.model)
    common = dict(config=config, max_context=max_context, profile=args.profile)
    try:
        if args.format == "onnx":
            paths = kx.export_onnx(model, args.out, **common)
        elif args.target == "iree":
            paths = kx.export_iree(model, args.out, **common)
        else:
            paths = kx.export_mlir(model, args.out, **common)
    except (NotImplementedError, ValueError) as err:  # the export's refusals (RefusedAttention is a ValueError)
        raise UsageError(f"{args.model}: {err}") from None
    for name, path in paths.items():
        print(f"{name}: {path}")
    if args.target is None:
        return 0
    return _smoke_run(model, args.out, args.target, prompt_ids(model, tokenizer, args.smoke_prompt),
                      args.smoke_tokens, mid_after, args.max_logit_error)


def tokens_to_mid(config, max_context: int) -> int | None:
    """The fewest tokens of a sequence with a Mid page under `config` (runtime/phases.py: every
    Initial and Recent page full, then the Terminal page begun), or None past `max_context`."""
    from kvtopo.runtime.phases import PhasePlan

    plan = PhasePlan(config.page_size, config.sink_tokens, config.recent_tokens, config.protected_spans)
    pages = next((n for n in range(1, plan.pages(max_context) + 1) if plan.mid_pages(n)), None)
    return None if pages is None else (pages - 1) * config.page_size + 1


def _check_smoke(args: argparse.Namespace, max_context: int, mid_after: int | None) -> None:
    """Fill in the smoke run's defaults (a prompt reaching Mid where max_context allows) and check both."""
    from kvtopo.cli import UsageError

    if args.smoke_tokens is None:
        args.smoke_tokens = SMOKE_TOKENS
    if args.smoke_prompt is None:
        args.smoke_prompt = max(1, min(mid_after or max_context, max_context - args.smoke_tokens))
    if not 1 <= args.smoke_prompt < max_context:
        raise UsageError(f"--smoke-prompt {args.smoke_prompt} is invalid: 1 .. max context {max_context} - 1")
    if args.max_logit_error is None:
        args.max_logit_error = MAX_LOGIT_ERROR
    if not args.max_logit_error > 0:  # also refuses nan
        raise UsageError(f"--max-logit-error {args.max_logit_error} is invalid: a number > 0 (logit units)")
    if not 1 <= args.smoke_tokens <= max_context - args.smoke_prompt:
        raise UsageError(f"--smoke-tokens {args.smoke_tokens} is invalid: 1 .. max context {max_context} - "
                         f"the {args.smoke_prompt}-token prompt")


def _check_out(out: str) -> None:
    """--out must be a writable directory or a path one can be created at: checked before the model loads."""
    from kvtopo.cli import UsageError

    if not out:
        raise UsageError("--out is empty: give the output directory")
    problem = out_dir_problem(out)
    if problem is not None:
        at, what = problem
        raise UsageError(f"--out {out} {what}" if at == Path(out) else f"--out {out}: {at} {what}")


def prompt_ids(model, tokenizer, tokens: int, seed: int = 0):
    """input_ids [1, tokens]: prose from models/real_tasks.py through `tokenizer` (a real model
    is judged on text), or random ids when there is none (zoo models)."""
    import torch

    from kvtopo.models.real_tasks import natural_text

    if tokenizer is None:
        return torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    ids = tokenizer(natural_text(seed, 8 * tokens), add_special_tokens=False, return_tensors="pt").input_ids
    return ids[:, :tokens]


def _smoke_run(model, out_dir, runtime: str, input_ids, new_tokens: int, mid_after: int | None,
               max_logit_error: float) -> int:
    from kvtopo.export.check import compare_with_session

    (agreement,) = compare_with_session(model, out_dir, [runtime], input_ids, new_tokens)
    print(agreement.describe(max_logit_error))
    if not any(page.phase.value == "mid" for layer in agreement.runner.layers for page in layer.pages):
        needed = "more than --max-context" if mid_after is None else mid_after
        print(f"note: the smoke run's {input_ids.shape[1]} + {new_tokens} tokens reached no Mid page (this config "
              f"needs {needed} tokens), so the compressor never ran: only exact and Recent attention were compared")
    return 0 if agreement.passes(max_logit_error) else 1
