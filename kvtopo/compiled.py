"""Which `torch.compile` backend, if any, a model object was compiled with.

Two ways to compile a module, and where each leaves its Dynamo context (torch 2.13):
  - `model.compile(backend=...)` (what `kvtopo.compile(model)` does, in place) sets
    `model._compiled_call_impl` to the function `torch.compile(model._call_impl, ...)` returns;
    the `_TorchDynamoContext` that built it is a free variable of that function's closure.
  - `torch.compile(model, backend=...)` returns an `OptimizedModule` whose `dynamo_ctx` is it.
A context's `callback` wraps the backend in layers (CatchErrorsWrapper -> ConvertFrame ->
WrapBackendDebug -> the `_TorchCompileWrapper` that `torch.compile` built), each pointing at the
next through `_torchdynamo_orig_backend`; the innermost one is the backend, which names itself
through `compiler_name` (the string given to `torch.compile`, or the callable's `__name__`).
"""

from __future__ import annotations

import functools

import torch

KVTOPO = "kvtopo"


def compiled_backend(model) -> str | None:
    """The backend `model` was compiled with ("kvtopo", "inductor", "eager", ...), or None.

    "kvtopo" also when the kvtopo backend function was passed itself (or through
    functools.partial) instead of its registered name. A model compiled through a Dynamo
    context whose backend cannot be named gives "<unknown backend>".
    """
    ctx = _dynamo_context(model)
    if ctx is None:
        return None
    from torch._dynamo.eval_frame import innermost_backend

    try:
        backend = innermost_backend(getattr(ctx, "callback", None))
    except AssertionError:
        return "<unknown backend>"
    if _is_kvtopo_backend(getattr(backend, "compiler_fn", backend)):
        return KVTOPO
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return name if isinstance(name, str) else "<unknown backend>"


def _dynamo_context(model):
    from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

    if isinstance(model, OptimizedModule):
        return model.dynamo_ctx
    if isinstance(model, torch.nn.Module):
        fn = getattr(model, "_compiled_call_impl", None)  # set by nn.Module.compile
    else:
        fn = model  # a function returned by torch.compile(fn)
    if getattr(fn, "kvtopo_session_check", False):  # kvtopo.compile's wrapper (kvtopo/api.py)
        fn = fn.__wrapped__
    if fn is None or not hasattr(fn, "_torchdynamo_orig_callable"):
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, _TorchDynamoContext):
            return value
    return None


def _is_kvtopo_backend(fn) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if getattr(fn, "compiler_name", None) == KVTOPO:
        return True
    from kvtopo.backend import kvtopo_backend

    return fn is kvtopo_backend
