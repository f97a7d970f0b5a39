"""IREE compilation of the exported MLIR: `<graph>.torch.mlir` -> `<graph>.vmfb` for `llvm-cpu`.

IREE takes the `torch` output (its own torch -> linalg conversion, the input IREE's PyTorch
frontends feed it) or, for the static graphs of the "npu" profile only, `stablehlo`: IREE cannot
compile the `stablehlo.dynamic_reshape` of a decode step with a dynamic token count, so
export_iree refuses that combination. torch-mlir's `linalg-on-tensors` output is not an IREE input:
it lowers cumsum (the compressor's slot numbering) to `tm_tensor.scan`, a dialect IREE does not
read. The decode step is compiled with a dynamic token count (export_mlir(tokens=None)), so one
module runs prefill chunks and decode steps; `export.host_runner.HostRunner(dir, runtime="iree")`
drives both modules.

`sources_dir` dumps each dispatch's `hal.executable` source as IREE formed it
(--iree-hal-dump-executable-sources-to): what the code generator is given, after IREE's own
rewrites, so a property such as "the compressor computes no exponential" can be checked on what
really runs, not only on the input MLIR.
"""

from __future__ import annotations

from pathlib import Path

from .executors import INSTALL_HINT
from .mlir_export import ENTRY

VMFB_SUFFIX = "vmfb"
INPUT_TYPES = {"torch": "torch", "stablehlo": "stablehlo"}  # export_mlir output type -> --iree-input-type


class IreeCompileError(RuntimeError):
    """iree-compile rejected an exported graph; the message names the file and quotes the diagnostics."""


def compile_vmfb(mlir_path, vmfb_path, output_type: str = "torch", target: str = "llvm-cpu",
                 target_cpu: str = "host", sources_dir=None) -> str:
    """Compile one exported MLIR file to a vmfb module; returns the vmfb path."""
    if output_type not in INPUT_TYPES:
        raise ValueError(f"output_type={output_type!r} is invalid: IREE compiles {tuple(INPUT_TYPES)} exports")
    try:
        from iree.compiler import CompilerToolError, compile_file
    except ImportError as err:
        raise ImportError(f"compiling the exported MLIR needs the package 'iree-base-compiler' ({INSTALL_HINT}): "
                          f"{err}") from err
    flags = ["--iree-hal-target-device=local", f"--iree-hal-local-target-device-backends={target}"]
    if target == "llvm-cpu":
        flags.append(f"--iree-llvmcpu-target-cpu={target_cpu}")
    if sources_dir is not None:
        Path(sources_dir).mkdir(parents=True, exist_ok=True)
        flags.append(f"--iree-hal-dump-executable-sources-to={sources_dir}")
    try:
        compile_file(str(mlir_path), input_type=INPUT_TYPES[output_type], extra_args=flags, output_file=str(vmfb_path))
    except CompilerToolError as err:
        raise IreeCompileError(f"iree-compile could not compile {mlir_path} for {target}:\n{str(err)[-4000:]}") from None
    return str(vmfb_path)


def compile_export(export_dir, output_type: str = "torch", target: str = "llvm-cpu", sources_dir=None) -> dict[str, str]:
    """Compile both graphs of an MLIR export; `sources_dir/<graph>/` receives each graph's dispatch sources."""
    d = Path(export_dir)
    paths = {}
    for graph in ENTRY:
        dump = None if sources_dir is None else Path(sources_dir) / graph
        paths[f"{graph}.{VMFB_SUFFIX}"] = compile_vmfb(d / f"{graph}.{output_type}.mlir", d / f"{graph}.{VMFB_SUFFIX}",
                                                       output_type, target, sources_dir=dump)
    return paths
