"""MLIR export of the decode step and the page compressor through torch-mlir's FX importer.

`torch_mlir.fx.export_and_import(module, *args, output_type=...)` for each of "torch",
"linalg-on-tensors" and "stablehlo", written as `<graph>.<output type>.mlir` with entry function
`decode_step` / `compressor`. MLIR graphs are static: the decode step for `tokens` new tokens
(1 = one decode step; export another size for prefill chunks) over the layout's fixed capacities.
A lowering failure raises `MlirLoweringError` naming the graph, the output type and the ops
torch-mlir left unlowered (from its "failed to legalize operation '...'" diagnostics).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from .onnx_export import compressor_module, example_compressor_args, example_decode_args
from .decode_step import DecodeStep, capture, layout_for

OUTPUT_TYPES = ("torch", "linalg-on-tensors", "stablehlo")
ENTRY = {"decode_step": "decode_step", "compressor": "compressor"}


class MlirLoweringError(RuntimeError):
    """torch-mlir could not lower a graph; the message names the ops it could not lower."""


def _failed_ops(text: str) -> list[str]:
    ops = re.findall(r"failed to legalize operation '([^']+)'", text)
    ops += re.findall(r"unsupported by backend contract: (?:module initializers|.*?)'([\w.]+)'", text)
    ops += re.findall(r"found an op that was marked as backend illegal.*?'([\w.]+)'", text, re.S)
    return sorted(set(ops))


@contextmanager
def _stderr_to(path: str):
    """MLIR prints its diagnostics on file descriptor 2, not through Python: capture them there."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def lower(module: torch.nn.Module, args, output_type: str, func_name: str) -> str:
    from torch_mlir import fx

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "diagnostics.txt")
        try:
            with torch.no_grad(), _stderr_to(log):
                mlir_module = fx.export_and_import(module, *args, output_type=output_type, func_name=func_name)
            err = None
        except Exception as e:  # torch-mlir raises plain RuntimeErrors; the diagnostics went to fd 2
            err, text = e, Path(log).read_text() + "\n" + str(e)
    if err is not None:
        ops = _failed_ops(text)
        what = f"op(s) {', '.join(ops)}" if ops else "an op (see the diagnostics below)"
        raise MlirLoweringError(f"torch-mlir could not lower {func_name} to {output_type!r}: {what} could not be "
                                f"lowered\n{text[-4000:]}") from err
    return str(mlir_module)


def export_mlir_files(model, out_dir, config, max_context: int, output_types=OUTPUT_TYPES, tokens: int = 1):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    captured = capture(model, max(tokens, 2))
    layout = layout_for(model, captured, config, max_context)
    step = DecodeStep(captured, layout).eval()
    graphs = {"decode_step": (step, example_decode_args(layout, tokens)),
              "compressor": (compressor_module(layout), example_compressor_args(layout))}
    paths = {}
    for name, (module, args) in graphs.items():
        for output_type in output_types:
            text = lower(module, args, output_type, ENTRY[name])
            path = out / f"{name}.{output_type}.mlir"
            path.write_text(text)
            paths[f"{name}.{output_type}"] = str(path)
    (out / "layout.json").write_text(layout.to_json())
    paths["layout"] = str(out / "layout.json")
    return paths
