"""The `torch.compile` backend: `torch.compile(model, backend="kvtopo")`.

Registered through the `torch_dynamo_backends` entry point, so the name works in a fresh process
without importing kvtopo first. What a model's config declares and its graphs cannot show (windows
HF builds no mask for, modules that are not causal, LongRoPE's switch, a hybrid's state,
`runtime/declared_attention.py`) is registered here for the module whose forward Dynamo compiles,
as `kvtopo.compile` registers it, so that a bare `torch.compile` gets the same checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtopo.api import attends_through_the_session
from kvtopo.passes.manager import PassReport, run_passes
from kvtopo.runtime import declared_attention
from kvtopo.runtime.context import active_session

log = logging.getLogger("kvtopo")

# Reports of every graph compiled by this backend in this process, oldest first.
REPORTS: list[PassReport] = []

class RefusedAttention(RuntimeError):
    """A graph with attention the passes refused ran inside a session: that attention would see
    only the new chunk, never the cached history."""

    def __init__(self, report: PassReport):
        self.report = report
        reasons = "; ".join(r.describe() for r in report.refusals)
        super().__init__(
            f"this compiled graph has {len(report.refusals)} attention site(s) kvtopo refused, so inside a kvtopo "
            f"session they would attend over the new tokens only: {reasons}. Run the model outside a session "
            "(it is unchanged there), or use kvtopo.generate, which falls back to the model's own cache when "
            "no site was rewritten.")


# Why kvtopo graphs never become CUDA graphs (mode="reduce-overhead"/"max-autotune", cudagraph options).
CUDA_GRAPHS_REFUSED = (
    "kvtopo graphs cannot run as CUDA graphs: every kvtopo attention call finds the active session and "
    "reads and appends to its KV store on the host, and a replayed CUDA graph runs only the recorded "
    "kernels, so the store would stop receiving tokens and attention would see a stale history. "
    "Compile without them: torch.compile(model, backend='kvtopo'), no CUDA-graph mode or option"
)


def _cuda_graph_request(mode: str | None, inductor: bool) -> str | None:
    """Why this compile would use CUDA graphs, if it would (None when it would not)."""
    from torch._inductor import config as inductor_config, list_mode_options

    if mode is not None:
        try:
            graphs = list_mode_options(mode).get("triton.cudagraphs", False)
        except Exception:  # not a mode Inductor knows
            graphs = False
        if graphs:
            return f"mode={mode!r} turns on CUDA graphs"
    if inductor and inductor_config.triton.cudagraphs:  # compile_fx would honour the global flag
        return "torch._inductor.config.triton.cudagraphs is True"
    return None


@dataclass(frozen=True)
class BackendOptions:
    """inductor: hand the rewritten graph to Inductor (True) or run it eagerly (False, for debugging)."""

    inductor: bool = True

    @classmethod
    def from_dict(cls, options: dict | None, mode: str | None = None) -> "BackendOptions":
        """`mode` is torch.compile's, which torch passes to backends other than Inductor."""
        options = dict(options or {})
        if graphs := [k for k in options if "cudagraph" in str(k)]:
            raise ValueError(f"kvtopo backend option(s) {graphs} refused: {CUDA_GRAPHS_REFUSED}")
        if reason := _cuda_graph_request(mode, options.get("inductor", True) is not False):
            raise ValueError(f"kvtopo refuses this compile ({reason}): {CUDA_GRAPHS_REFUSED}")
        if mode is not None and mode != "default":
            raise ValueError(f"the kvtopo backend takes no mode (got mode={mode!r}): its graphs go to Inductor "
                             "with Inductor's defaults; options={'inductor': bool} is all it accepts")
        unknown = set(options) - {"inductor"}
        if unknown:
            raise ValueError(f"unknown kvtopo backend option(s) {sorted(unknown)}; allowed: ['inductor']")
        if not isinstance(options.get("inductor", True), bool):
            raise ValueError(f"backend option inductor={options['inductor']!r} must be a bool")
        return cls(**options)


def _compiled_module(example_inputs) -> torch.nn.Module | None:
    """The module whose forward Dynamo is compiling: among the locals of the frame it traces (`self`,
    or a wrapper's arguments, as transformers' decorators take them), the one holding most of the
    graph's parameters; None when there is none (a plain function) or Dynamo's frame cannot be read."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        frame = InstructionTranslator.current_tx()
    except Exception as error:  # Dynamo's internals moved
        log.warning("kvtopo cannot read the frame Dynamo compiles (%s): what the model's config declares is "
                    "registered only by kvtopo.compile / kvtopo.generate / kvtopo.hf_cache.generate", error)
        return None
    if frame is None:
        return None
    inputs = {id(t) for t in example_inputs if isinstance(t, torch.Tensor)}
    best, most = None, 0
    for value in frame.f_locals.values():
        for candidate in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(candidate, torch.nn.Module):
                held = sum(id(p) in inputs for p in candidate.parameters())
                best, most = (candidate, held) if held > most else (best, most)
    return best


def _check_inference(gm: torch.fx.GraphModule) -> None:
    """Inductor builds a backward for a graph whose outputs need one (autograd on, the model's
    parameters requiring grad: a call outside `torch.no_grad`), and kvtopo's ops have none: say
    so and what to do, rather than AOTAutograd's "no autograd formula" from inside Inductor. Only
    a kvtopo op fed a tensor that requires grad counts (a model fine-tuning a head behind frozen
    attention still compiles)."""
    if not torch.is_grad_enabled():
        return
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", None) == "kvtopo"
           and any(getattr(a.meta.get("example_value"), "requires_grad", False) for a in n.all_input_nodes)]
    if ops:
        raise RuntimeError(
            f"kvtopo rewrote attention for inference, and this call runs with autograd on over tensors that require "
            f"grad ({len(ops)} kvtopo op(s) fed them, e.g. {ops[0].name}): kvtopo's ops have no backward. Call the "
            "model under torch.no_grad() or torch.inference_mode() (kvtopo.generate and HF generate do), or compile "
            "with inductor=False to run the forward with autograd on (a backward through its attention raises)")


def _check_forwards_attend(module: torch.nn.Module) -> None:
    """A module compiled in place (`Module.compile(backend="kvtopo")`) gets the check
    `kvtopo.compile` puts on its call, from its next forward on: one that runs no kvtopo attention
    inside a session raises (`api.attends_through_the_session`)."""
    call = getattr(module, "_compiled_call_impl", None)
    if call is not None and not getattr(call, "kvtopo_session_check", False):
        module._compiled_call_impl = attends_through_the_session(call, type(module).__name__)


def kvtopo_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode: str | None = None):
    opts = BackendOptions.from_dict(options, mode)
    if (module := _compiled_module(example_inputs)) is not None:
        declared_attention.declare(module)
        _check_forwards_attend(module)
    report = run_passes(gm)
    REPORTS.append(report)
    log.info("%s", report.format())
    for refusal in report.refusals:
        log.warning("kvtopo left attention unchanged: %s", refusal.describe())
    if opts.inductor:
        _check_inference(gm)
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs)
    else:
        compiled = gm.forward
    return _refuse_in_session(compiled, report) if report.refusals else compiled


def _refuse_in_session(compiled, report: PassReport):
    """The graph as compiled, except that inside a session it raises before computing anything."""

    def run(*args):
        if active_session() is not None:
            raise RefusedAttention(report)
        return compiled(*args)

    return run
