"""The `kvtopo` command line (`kvtopo ...` or `python -m kvtopo ...`).

    kvtopo inspect llama                       # attention sites of a zoo model, found or refused
    kvtopo inspect deepseek-v3 --attn eager --tokens 16
    kvtopo serve path/to/checkpoint --config '{"target_ratio": 8}'   # OpenAI-compatible server

Each subcommand is one `_add_<name>(subparsers)` function that registers its parser and sets
`run=<handler>`; a handler takes the parsed arguments and returns the exit code. To add a
subcommand (e.g. `export`), write its `_add_...` function and list it in `SUBCOMMANDS`.
Usage errors (bad arguments, unknown model names) exit with status 2, like argparse's own; a real
model that cannot be fetched or verified (`pretrained.FetchError`) exits with status 1 and its reason.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Sequence

from kvtopo.export_cli import add_export
from kvtopo.models.pretrained import FetchError


class UsageError(Exception):
    """A bad command line: reported on stderr with exit status 2."""


# -- inspect -------------------------------------------------------------------------------------
def _add_inspect(subparsers) -> None:
    from kvtopo.models import zoo

    p = subparsers.add_parser(
        "inspect",
        help="list the attention sites kvtopo finds (or refuses) in a zoo model",
        description="Trace a zoo model with Dynamo and print every attention site kvtopo rewrites, with its "
                    "shape facts, and every attention-like pattern it refuses, with the reason.",
    )
    p.add_argument("model", metavar="MODEL", help=f"zoo model name: {', '.join(zoo.ZOO_MODELS)}")
    p.add_argument("--attn", choices=zoo.ATTN_IMPLEMENTATIONS, default="sdpa",
                   help="HF attention implementation to build the model with (default: sdpa)")
    p.add_argument("--tokens", type=_positive_int, default=8, metavar="N",
                   help="prompt length of the traced call (default: 8)")
    p.set_defaults(run=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    import torch

    import kvtopo
    from kvtopo.models import zoo

    if args.model not in zoo.ZOO_MODELS:
        raise UsageError(f"unknown zoo model {args.model!r}; choose one of: {', '.join(zoo.ZOO_MODELS)}")
    model = zoo.build(args.model, attn_implementation=args.attn)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    report = kvtopo.inspect(model, ids, use_cache=False)

    layers = zoo.num_attention_layers(model)
    print(f"{args.model} (attn={args.attn}, {layers} attention layer(s)), traced on {args.tokens} token(s), "
          f"{len(report.reports)} graph(s)")
    for site in report.sites:
        print(f"  found   {site.describe()}")
    for refusal in report.refusals:
        print(f"  refused {refusal.describe()}")
    if not report.reports:
        print("  Dynamo produced no graph")
    print(f"{len(report.sites)} site(s) rewritten, {len(report.refusals)} refused")
    return 0


def parse_config(text: str | None):
    """A kvtopo Config from `--config`: JSON fields inline (`'{"target_ratio": 4}'`) or a JSON
    file's path; None gives `Config()`. Text that starts like JSON (`{` or `[`) is inline."""
    import json

    from kvtopo.config import Config

    if text is None:
        return Config()
    try:
        fields = json.loads(text) if text.lstrip().startswith(("{", "[")) else json.loads(open(text).read())
        if not isinstance(fields, dict):
            raise UsageError(f"--config: expected a JSON object of Config fields, got a {type(fields).__name__}")
        if "protected_spans" in fields:
            # JSON has no tuples; anything else is left for Config to refuse with its own message.
            spans = fields["protected_spans"]
            if isinstance(spans, list):
                fields["protected_spans"] = tuple(tuple(s) if isinstance(s, list) else s for s in spans)
        return Config(**fields)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as err:
        raise UsageError(f"--config: {err}") from None


# -- serve ---------------------------------------------------------------------------------------
def _add_serve(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="transformers' OpenAI-compatible server with kvtopo's store as its KV cache",
        description="Run `transformers serve` (continuous batching on, CPU) on MODEL with every request's KV history "
                    "in one kvtopo session (kvtopo.serving.serve). Serves until interrupted.",
    )
    p.add_argument("model", metavar="MODEL", help="a checkpoint directory, <dir>:<file>.gguf, or smollm2")
    p.add_argument("--config", metavar="JSON", default=None,
                   help="kvtopo Config fields as JSON, inline or a file path (default: Config())")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="listen port, 1-65535 (default: 8000)")
    p.add_argument("--dtype", default="auto", help="model dtype, as transformers serve takes it (default: auto)")
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from kvtopo.serving.serve import ServerStartError, start_server

    config = parse_config(args.config)
    try:
        start_server(args.model, config, host=args.host, port=args.port, block=True, dtype=args.dtype)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None
    except ServerStartError as err:
        print(f"kvtopo serve: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the server and its engine are stopped, or given up on (KvtopoServer.stop)
        print("kvtopo serve: stopped", file=sys.stderr)
        if _threads_left():  # an engine thread that did not stop would keep the process from exiting
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
    return 0


def _threads_left() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: 1-65535")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


# -- the command ---------------------------------------------------------------------------------
SUBCOMMANDS = (_add_inspect, add_export, _add_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtopo", description="kvtopo: compiler-pass based KV-cache compression.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on argparse errors
    try:
        return args.run(args)
    except UsageError as err:
        parser.exit(2, f"{parser.prog} {args.command}: error: {err}\n")
    except FetchError as err:  # its message says what was wrong and what to do: no traceback
        parser.exit(1, f"{parser.prog} {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
