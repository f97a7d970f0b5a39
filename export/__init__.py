"""Export of kvtopo-rewritten models for NPU toolchains: ONNX (onnxruntime, OpenVINO) and MLIR (torch-mlir, IREE).

Two graphs per model (see export/decode_step.py, export/compressor.py, export/layout.py):
  decode_step  tokens + positions + the compressed cache as explicit tensors -> logits + each
               layer's new K/V and queries (also runs chunked prefill: the token count is dynamic)
  compressor   one page's K/V + observation queries + head bases + keep count -> kept tokens,
               codes, statistics; exponential-free (no Exp/Softmax/Sigmoid/Tanh/Erf)
`export.host_runner.HostRunner` drives the pair with the same phase scheduler as the PyTorch
session, on onnxruntime or OpenVINO (the ONNX files) or IREE (the compiled MLIR); see
export/executors.py. MLA models (DeepSeek-V2/V3) export the same pair over the cache their
session keeps: the latent + RoPE key, one kv-head whose value is the latent (export/layout.py).

    export_onnx("llama", "out/", config=Config(...))      # decode_step.onnx, compressor.onnx, layout.json
    export_mlir("llama", "out/", config=Config(...))      # <graph>.<torch|linalg-on-tensors|stablehlo>.mlir
    export_iree("llama", "out/", config=Config(...))      # + decode_step.vmfb, compressor.vmfb (IREE, llvm-cpu)

The "npu" profile (`profile="npu"` on each entry point, `kvtopo export --profile npu`) is what NPU
compilers want: no dynamic dimension anywhere (every ONNX input/output dim a number, no `?` in the
MLIR entry signatures; both checked at export), float16 cache and activation tensors at the
graphs' boundaries (uint8 codes and int64 ids/lengths as they are), float32 compute inside.
Its limits: batch 1; exactly 1 new token per decode-step call, so a prompt of N tokens is N calls
(prefill costs N graph runs instead of N / prefill_chunk_size; the simpler correct choice: a
fixed chunk with a valid-token count would need masked padding rows in every layer's attention
and in the host's appends); a sequence may reach `max_context` tokens (the fixed buffers; the
host runner raises past it); the page size, Recent/Mid page counts and ranks fixed by the
exported Config. HostRunner feeds and reads float16 arrays on every runtime.

Imports: runtime, passes, kernels, models and kvtopo.config only (tests/test_import_layers.py).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from kvtopo.config import Config

from .layout import NPU_TOKENS, PROFILES, check_profile

DEFAULT_MAX_CONTEXT = 4096
DEFAULT_MLIR_MAX_CONTEXT = 512  # MLIR graphs and IREE builds are static per capacity: kept small
MLIR_OUTPUT_TYPES = ("torch", "linalg-on-tensors", "stablehlo")


def out_dir_problem(out_dir) -> tuple[Path, str] | None:
    """(the path at fault, what is wrong with it) when no export can be written to `out_dir`, else
    None: it must be a directory files can be created in, or a path one can be created at. Cheap,
    so checked before any tracing; the directory itself is created only once the graphs are."""
    path = Path(out_dir)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return existing, "is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return existing, f"is not writable ({err.strerror})"
    return None


def _check_args(function: str, out_dir, config, max_context, **ints) -> None:
    """The arguments every export entry point takes, checked before any tracing."""
    if not isinstance(out_dir, (str, os.PathLike)) or str(out_dir) == "":
        raise TypeError(f"{function}: out_dir={out_dir!r} is invalid: a directory path (str or os.PathLike)")
    problem = out_dir_problem(out_dir)
    if problem is not None:
        raise ValueError(f"{function}: out_dir={str(out_dir)!r} is invalid: {problem[0]} {problem[1]}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"{function}: config={config!r} is invalid: None or a kvtopo.Config")
    for name, value in {"max_context": max_context, **ints}.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{function}: {name}={value!r} is invalid: an int >= 1 (tokens)")


@contextmanager
def _model(model_or_zoo_name):
    """The model to export, in eval mode (the graphs must not hold dropout); a caller's model gets
    each module's own train/eval mode back afterwards."""
    if isinstance(model_or_zoo_name, str):
        from kvtopo.models import zoo

        if model_or_zoo_name not in zoo.ZOO_MODELS:
            raise ValueError(f"unknown zoo model {model_or_zoo_name!r}; choose one of: {', '.join(zoo.ZOO_MODELS)}")
        yield zoo.build(model_or_zoo_name).eval()
        return
    if not isinstance(model_or_zoo_name, nn.Module):
        raise TypeError(f"expected an nn.Module or a zoo model name, got {type(model_or_zoo_name).__name__}")
    modes = [(module, module.training) for module in model_or_zoo_name.modules()]
    try:
        yield model_or_zoo_name.eval()
    finally:
        for module, training in modes:
            module.training = training


def _exported_config(config: Config | None) -> Config:
    """What the exported graphs do: they hold one set of Mid bases per layer, so the config
    they record fits them once (`refit_after=None`); their compressor ranks one page at a
    time (`eviction_scope="page"`); their decode step reads Recent codes up to a fixed
    capacity, so a chunked prompt's pages do not wait there for its end
    (`prompt_hold_tokens=0`). Refits, joint eviction and waiting are session features."""
    return (config or Config()).replace(refit_after=None, eviction_scope="page", prompt_hold_tokens=0)


def export_onnx(model_or_zoo_name, out_dir, config: Config | None = None,
                max_context: int = DEFAULT_MAX_CONTEXT, profile: str | None = None) -> dict[str, str]:
    """Write decode_step.onnx, compressor.onnx and layout.json to `out_dir`; return their paths.

    `max_context` sizes the fixed cache buffers (tokens a sequence may reach). `profile="npu"`:
    fully static graphs with float16 at their boundaries (see the module docstring). Raises
    `RefusedAttention` listing the sites kvtopo refused, if any.
    """
    _check_args("export_onnx", out_dir, config, max_context)
    check_profile("export_onnx", profile)
    from .onnx_export import export_onnx_files

    with _model(model_or_zoo_name) as model:
        return export_onnx_files(model, out_dir, _exported_config(config), max_context, profile)


def export_mlir(model_or_zoo_name, out_dir, config: Config | None = None, max_context: int = DEFAULT_MLIR_MAX_CONTEXT,
                output_types=MLIR_OUTPUT_TYPES, tokens: int | None = 1, profile: str | None = None) -> dict[str, str]:
    """Write decode_step.<type>.mlir and compressor.<type>.mlir for each output type.

    The cache has `max_context` static capacity; the decode step takes `tokens` new tokens (1: a
    decode step; a fully static graph) or, with `tokens=None`, a dynamic token count.
    `profile="npu"` fixes tokens to 1 and puts float16 at the graphs' boundaries. Raises
    `MlirLoweringError` naming the op that could not be lowered.
    """
    check_profile("export_mlir", profile)
    if profile == "npu":
        tokens = NPU_TOKENS
    _check_args("export_mlir", out_dir, config, max_context, **({} if tokens is None else {"tokens": tokens}))
    if tokens is not None and tokens > max_context:
        raise ValueError(f"export_mlir: tokens={tokens} is invalid: at most max_context={max_context} (a step's "
                         "new tokens must fit in the cache)")
    if isinstance(output_types, str) or not output_types or any(t not in MLIR_OUTPUT_TYPES for t in output_types):
        raise ValueError(f"export_mlir: output_types={output_types!r} is invalid: a non-empty sequence of "
                         f"{MLIR_OUTPUT_TYPES}")
    from .mlir_export import export_mlir_files

    with _model(model_or_zoo_name) as model:
        return export_mlir_files(model, out_dir, _exported_config(config), max_context, tuple(output_types), tokens,
                                 profile)


def export_iree(model_or_zoo_name, out_dir, config: Config | None = None, max_context: int = DEFAULT_MLIR_MAX_CONTEXT,
                output_type: str = "torch", target: str = "llvm-cpu", sources_dir=None,
                profile: str | None = None) -> dict[str, str]:
    """export_mlir with a dynamic token count (or the "npu" profile's static graphs), then IREE
    compiles both graphs to `<graph>.vmfb` (export/iree.py); `HostRunner(out_dir, runtime="iree")`
    runs them. `output_type="stablehlo"` needs `profile="npu"` (export/iree.py says why).
    `sources_dir`: where to dump the compiled dispatches' sources. Raises `IreeCompileError`
    quoting IREE's diagnostics."""
    from .iree import INPUT_TYPES, compile_export

    if output_type not in INPUT_TYPES:
        raise ValueError(f"export_iree: output_type={output_type!r} is invalid: one of {tuple(INPUT_TYPES)}")
    if output_type == "stablehlo" and profile != "npu":
        raise ValueError("export_iree: output_type='stablehlo' needs profile='npu' (static graphs): IREE cannot "
                         "compile the stablehlo of a decode step with a dynamic token count (its "
                         "stablehlo.dynamic_reshape); use output_type='torch'")
    paths = export_mlir(model_or_zoo_name, out_dir, config, max_context, output_types=(output_type,), tokens=None,
                        profile=profile)
    return {**paths, **compile_export(out_dir, output_type, target, sources_dir)}


__all__ = ["DEFAULT_MAX_CONTEXT", "DEFAULT_MLIR_MAX_CONTEXT", "PROFILES", "export_iree", "export_mlir", "export_onnx",
           "out_dir_problem"]
