"""The runtimes that execute the exported graphs, behind one interface: `run(graph, inputs) -> outputs`.

`export.host_runner.HostRunner` keeps the cache and applies the page lifecycle; an executor only
runs one of the two exported graphs ("decode_step" or "compressor") on named numpy arrays and
returns named numpy arrays, so the same scheduler drives every toolchain:

  onnxruntime  decode_step.onnx, compressor.onnx              (export_onnx)
  openvino     the same ONNX files, compiled for an OpenVINO device ("CPU"; "NPU" where present)
  iree         decode_step.vmfb, compressor.vmfb compiled from the MLIR (export_iree, export/iree.py)

Input and output names come from the exported layout (`graph_signature`), so an executor whose
runtime calls functions positionally (IREE) feeds the same names as one that names its ports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from .compressor import compressor_class
from .decode_step import input_names, output_names
from .layout import CacheLayout

RUNTIMES = ("onnxruntime", "openvino", "iree")
GRAPHS = ("decode_step", "compressor")
INSTALL_HINT = "install the test extra: pip install -e '.[test]'"


class Executor(Protocol):
    runtime: str

    def run(self, graph: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run `graph` on the arrays named by its inputs (extra names are ignored). The outputs are
        arrays the caller owns, not views of buffers the runtime reuses on its next run."""


def graph_signature(layout: CacheLayout, graph: str) -> tuple[list[str], list[str]]:
    """Input and output names of an exported graph, in the order the graph declares them."""
    if graph == "decode_step":
        return input_names(layout), output_names(layout)
    if graph == "compressor":
        cls = compressor_class(layout)
        return list(cls.INPUTS), list(cls.OUTPUTS)
    raise ValueError(f"unknown graph {graph!r}; the export has {GRAPHS}")


def _require(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"running the exported graphs with {package} needs the package {package!r} "
                          f"({INSTALL_HINT}): {err}") from err


def _files(export_dir: Path, suffix: str, made_by: str) -> dict[str, Path]:
    paths = {g: export_dir / f"{g}.{suffix}" for g in GRAPHS}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"missing {', '.join(missing)}: write them with {made_by}")
    return paths


class OnnxRuntimeExecutor:
    """The ONNX files in onnxruntime, run through IO bindings. An input passed as the same
    array object as on the graph's previous run is not bound again: onnxruntime reads the
    array's memory where it lies (a CPU `OrtValue` wraps it, no copy), so the host runner's
    cache buffers, updated in place, cost nothing per step to feed."""

    runtime = "onnxruntime"

    def __init__(self, export_dir, layout: CacheLayout, threads: int | None = None, providers=None):
        ort = _require("onnxruntime", "onnxruntime")
        self._ort_value = ort.OrtValue.ortvalue_from_numpy
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        providers = providers or ["CPUExecutionProvider"]
        self.sessions = {g: ort.InferenceSession(str(p), opts, providers=providers)
                         for g, p in _files(Path(export_dir), "onnx", "export_onnx").items()}
        self.bindings = {g: s.io_binding() for g, s in self.sessions.items()}
        self.bound: dict[str, dict[str, np.ndarray]] = {g: {} for g in self.sessions}  # name -> array bound
        self.ports = {g: ([i.name for i in s.get_inputs()], [o.name for o in s.get_outputs()])
                      for g, s in self.sessions.items()}

    def run(self, graph, inputs):
        session, binding, bound = self.sessions[graph], self.bindings[graph], self.bound[graph]
        names_in, names_out = self.ports[graph]
        for name in names_in:
            array = inputs[name]
            if bound.get(name) is not array:
                # Keep the array itself: the bound OrtValue reads its memory.
                bound[name] = array if array.flags.c_contiguous else np.ascontiguousarray(array)
                binding.bind_ortvalue_input(name, self._ort_value(bound[name]))
        for name in names_out:  # fresh outputs each run: their shapes follow the token count
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return dict(zip(names_out, binding.copy_outputs_to_cpu()))


class OpenVinoExecutor:
    """The ONNX files compiled by OpenVINO. Inference precision is pinned to float32: the CPU
    plugin otherwise runs bfloat16 on CPUs that have it, which changes tokens."""

    runtime = "openvino"

    def __init__(self, export_dir, layout: CacheLayout, threads: int | None = None, device: str = "CPU"):
        ov = _require("openvino", "openvino")
        core = ov.Core()
        if device not in core.available_devices:
            raise RuntimeError(f"OpenVINO device {device!r} is not present here; available: {core.available_devices}")
        props = {"INFERENCE_PRECISION_HINT": "f32"}
        if threads:
            props["INFERENCE_NUM_THREADS"] = threads
        self.compiled = {g: core.compile_model(core.read_model(str(p)), device, props)
                         for g, p in _files(Path(export_dir), "onnx", "export_onnx").items()}
        self.requests = {g: m.create_infer_request() for g, m in self.compiled.items()}

    def run(self, graph, inputs):
        model = self.compiled[graph]
        # Shared, not copied: the host runner does not touch its buffers while a graph runs.
        result = self.requests[graph].infer({i.get_any_name(): inputs[i.get_any_name()] for i in model.inputs},
                                            share_inputs=True)
        return {o.get_any_name(): np.array(result[o], copy=True) for o in model.outputs}


class IreeExecutor:
    """The vmfb modules IREE compiled from the MLIR (export/iree.py), called positionally in the
    layout's order. IREE integers are signless: an 8-bit result comes back as int8, and the
    exported graphs' only 8-bit tensors are uint8 codes, so it is viewed as uint8."""

    runtime = "iree"

    def __init__(self, export_dir, layout: CacheLayout, threads: int | None = None, driver: str = "local-task"):
        rt = _require("iree.runtime", "iree-base-runtime")
        from .iree import ENTRY, VMFB_SUFFIX

        if threads:
            rt.flags.parse_flags(f"--task_topology_max_group_count={threads}")
        self.layout = layout
        config = rt.Config(driver)
        self.functions = {}
        for graph, path in _files(Path(export_dir), VMFB_SUFFIX, "export_iree").items():
            context = rt.SystemContext(config=config)
            context.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(path)))
            self.functions[graph] = context.modules.module[ENTRY[graph]]

    def run(self, graph, inputs):
        names_in, names_out = graph_signature(self.layout, graph)
        out = self.functions[graph](*[np.asarray(inputs[n], order="C") for n in names_in])
        out = out if isinstance(out, (tuple, list)) else (out,)
        arrays = [np.array(o.to_host(), copy=True) for o in out]
        return {n: a.view(np.uint8) if a.dtype == np.int8 else a for n, a in zip(names_out, arrays, strict=True)}


_EXECUTORS = {"onnxruntime": OnnxRuntimeExecutor, "openvino": OpenVinoExecutor, "iree": IreeExecutor}


def open_executor(runtime: str, export_dir, layout: CacheLayout, threads: int | None = None, **options) -> Executor:
    """The executor of `runtime` over the graphs in `export_dir` (options: onnxruntime `providers`,
    openvino `device`, iree `driver`)."""
    if runtime not in _EXECUTORS:
        raise ValueError(f"runtime={runtime!r} is invalid: one of {RUNTIMES}")
    return _EXECUTORS[runtime](export_dir, layout, threads=threads, **options)
