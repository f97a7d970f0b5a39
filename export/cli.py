"""`kvtopo export onnx|mlir MODEL --out DIR [--config JSON] [--max-context N]`.

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
    p.set_defaults(run=_run_export)


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
    try:
        from kvtopo import export as kx
    except ImportError:
        import export as kx
    config = _config(args.config)
    if args.format == "onnx":
        paths = kx.export_onnx(args.model, args.out, config=config, max_context=args.max_context or 4096)
    else:
        paths = kx.export_mlir(args.model, args.out, config=config, max_context=args.max_context or 512)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0
