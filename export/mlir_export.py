"""MLIR export of the decode step and the page compressor through torch-mlir's FX importer.

`torch_mlir.fx.export_and_import(module, *args, output_type=...)` for each of "torch",
"linalg-on-tensors" and "stablehlo", written as `<graph>.<output type>.mlir` with entry function
`decode_step` / `compressor`. The cache capacities are static; the decode step takes `tokens` new
tokens (1 = one decode step, the NPU-friendly fully static graph), or, with `tokens=None`, a
dynamic token count (`[1, ?]` ids and positions) so one module runs prefill chunks and decode
steps alike (what the IREE host loop compiles, export/iree.py). `profile="npu"` is the static
graph with float16 at its boundary (export/layout.py); `dynamic_signature` checks that no tensor
type of an entry function's signature has a `?` dimension.
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

from .onnx_export import export_graphs

OUTPUT_TYPES = ("torch", "linalg-on-tensors", "stablehlo")
ENTRY = {"decode_step": "decode_step", "compressor": "compressor"}


class MlirLoweringError(RuntimeError):
    """torch-mlir could not lower a graph; the message names the ops it could not lower."""


def _failed_ops(text: str) -> list[str]:
    # An op torch-mlir does not know is a generic `torch.operator` whose `name` says which it is.
    unknown = re.findall(r'"torch\.operator"\([^)]*\)\s*<\{name = "([\w.]+)"', text)
    ops = [op for op in re.findall(r"failed to legalize operation '([^']+)'", text)
           if not (unknown and op == "torch.operator")] + unknown
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


def lower(module: torch.nn.Module | torch.export.ExportedProgram, args, output_type: str, func_name: str) -> str:
    """`module` (traced by torch.export with `args`) or an ExportedProgram (`args` unused) as MLIR
    text of `output_type`, entry `func_name`."""
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


def export_mlir_files(model, out_dir, config, max_context: int, output_types=OUTPUT_TYPES, tokens: int | None = 1,
                      profile: str | None = None):
    layout, graphs = export_graphs(model, config, max_context, tokens, profile)
    texts = {}
    for name, (module, args, dynamic) in graphs.items():
        with torch.no_grad():  # traced once, lowered to each output type (torch-mlir copies it to decompose)
            program = _without_dead_code(torch.export.export(module, args, dynamic_shapes=dynamic, strict=False))
        for output_type in output_types:
            text = texts[f"{name}.{output_type}"] = lower(program, args, output_type, ENTRY[name])
            if profile == "npu" and dynamic_signature(text, ENTRY[name]):
                raise ValueError(f"the npu profile's {name} graph ({output_type}) has dynamic dimensions in its "
                                 f"signature: {dynamic_signature(text, ENTRY[name])}")
    out = Path(out_dir)  # created once every graph is lowered: a failed export leaves no empty directory
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, text in texts.items():
        path = out / f"{key}.mlir"
        path.write_text(text)
        paths[key] = str(path)
    (out / "layout.json").write_text(layout.to_json())
    paths["layout"] = str(out / "layout.json")
    return paths


def _without_dead_code(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` without the values no output depends on, nor the metadata assertions on them
    (`aten._assert_tensor_metadata`, from `.to()` calls) that alone keep them in the graph.

    What they keep is the model's own attention mask, which the decode step's cached attention
    does not read: Hugging Face's packed-sequence detection (a cumsum over the positions), which
    torch-mlir cannot lower to stablehlo with a dynamic token count."""
    graph = program.graph_module.graph
    while True:
        graph.eliminate_dead_code()
        dead = [node for node in graph.nodes if node.target is torch.ops.aten._assert_tensor_metadata.default
                and all(len(value.users) == 1 for value in node.all_input_nodes)]
        if not dead:
            break
        for node in dead:
            graph.erase_node(node)
    program.graph_module.recompile()
    return program


def signature(text: str, func_name: str) -> str:
    """The signature of `func_name` in an MLIR module's text: its `func.func @name(...) -> (...)` line
    (MLIR prints a function's signature on one line)."""
    start = re.search(rf"func\.func @{re.escape(func_name)}\(", text)
    if start is None:
        raise ValueError(f"no function @{func_name} in the MLIR module")
    end = text.find("\n", start.end())
    return text[start.start(): None if end < 0 else end]


def dynamic_signature(text: str, func_name: str) -> list[str]:
    """The tensor types in `func_name`'s signature (arguments and results) with a dynamic dimension
    (`?`): none in a fully static graph. Reads torch (`!torch.vtensor<[1,?],si64>`) and builtin
    (`tensor<1x?xi64>`) types."""
    types = re.findall(r"!torch\.vtensor<[^>]*>|tensor<[^>]*>", signature(text, func_name))
    if not types:
        raise ValueError(f"no tensor types in the signature of @{func_name}")
    return [t for t in types if "?" in t]
