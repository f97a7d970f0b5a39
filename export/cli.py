"""`kvtopo export onnx|mlir MODEL --out DIR [--config JSON] [--max-context N] [--target RUNTIME]`.

`--target` compiles the export for a runtime of this machine and smoke-runs it: a short random
prompt and a few greedy steps through HostRunner on that runtime and through the PyTorch
session; the exit status is 1 when the tokens differ. onnx: onnxruntime or openvino; mlir: iree
(the MLIR is then exported with a dynamic token count and compiled to .vmfb, export_iree).

Registered by adding `_add_export` to `SUBCOMMANDS` in kvtopo/cli.py:
    from kvtopo.export.cli import _add_export
"""

from __future__ import annotations

import argparse
import json


def _add_export(subparsers) -> None:
    from kvtopo.models import zoo

    p = subparsers.add_parser(
        "export", help="export a zoo model's decode step and page compressor to ONNX or MLIR",
        description="Export the kvtopo-rewritten decode step (cache as explicit tensors) and the exp-free page "
                    "compressor. onnx: decode_step.onnx, compressor.onnx, layout.json (run with "
                    "kvtopo.runtime.host_runner.HostRunner). mlir: <graph>.<torch|linalg-on-tensors|stablehlo>.mlir.")
    p.add_argument("format", choices=("onnx", "mlir"))
    p.add_argument("model", metavar="MODEL", help=f"zoo model name: {', '.join(zoo.ZOO_MODELS)}")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--config", metavar="JSON", default=None,
                   help='kvtopo Config fields as JSON (or a path to a JSON file), e.g. \'{"page_size": 16}\'')
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="tokens the fixed cache buffers hold (default: 4096 for onnx, 512 for mlir)")
    p.add_argument("--target", choices=sorted(TARGET_FORMAT), default=None,
                   help="compile for this runtime and smoke-run against the PyTorch session "
                        "(onnx: onnxruntime|openvino; mlir: iree)")
    p.add_argument("--smoke-tokens", type=int, default=8, metavar="N",
                   help="greedy steps of the smoke run after a 32-token prompt (default: 8)")
    p.set_defaults(run=_run_export)


TARGET_FORMAT = {"onnxruntime": "onnx", "openvino": "onnx", "iree": "mlir"}
SMOKE_PROMPT = 32


def _config(text: str | None):
    from kvtopo.cli import UsageError
    from kvtopo.config import Config

    if text is None:
        return Config()
    try:
        fields = json.loads(text) if text.lstrip().startswith("{") else json.loads(open(text).read())
        if "protected_spans" in fields:
            fields["protected_spans"] = tuple(tuple(s) for s in fields["protected_spans"])
        return Config(**fields)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as err:
        raise UsageError(f"--config: {err}") from None


def _run_export(args: argparse.Namespace) -> int:
    from kvtopo.cli import UsageError
    from kvtopo.models import zoo

    if args.model not in zoo.ZOO_MODELS:
        raise UsageError(f"unknown zoo model {args.model!r}; choose one of: {', '.join(zoo.ZOO_MODELS)}")
    if args.max_context is not None and args.max_context < 1:
        raise UsageError(f"--max-context {args.max_context} is invalid: an int >= 1 (tokens)")
    if args.target is not None and TARGET_FORMAT[args.target] != args.format:
        raise UsageError(f"--target {args.target} runs {TARGET_FORMAT[args.target]} exports, not {args.format}")
    max_context = args.max_context or (4096 if args.format == "onnx" else 512)
    if args.target is not None and not 1 <= args.smoke_tokens <= max_context - SMOKE_PROMPT:
        raise UsageError(f"--smoke-tokens {args.smoke_tokens} is invalid: 1 .. max context {max_context} - "
                         f"the {SMOKE_PROMPT}-token prompt")
    try:
        from kvtopo import export as kx
    except ImportError:
        import export as kx
    config = _config(args.config)
    model = zoo.build(args.model)
    if args.format == "onnx":
        paths = kx.export_onnx(model, args.out, config=config, max_context=max_context)
    elif args.target == "iree":
        paths = kx.export_iree(model, args.out, config=config, max_context=max_context)
    else:
        paths = kx.export_mlir(model, args.out, config=config, max_context=max_context)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0 if args.target is None else _smoke_run(model, args.out, args.target, args.smoke_tokens)


def _smoke_run(model, out_dir, runtime: str, new_tokens: int) -> int:
    import torch

    from kvtopo.export.check import compare_with_session

    ids = torch.randint(0, model.config.vocab_size, (1, SMOKE_PROMPT), generator=torch.Generator().manual_seed(0))
    (agreement,) = compare_with_session(model, out_dir, [runtime], ids, new_tokens)
    print(agreement.describe())
    return 0 if agreement.same_tokens else 1
