"""kvtopo's public entry points besides generate: compile, session, inspect."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvtopo import hf_cache
from kvtopo.config import Config
from kvtopo.passes.manager import PassReport, run_passes
from kvtopo.runtime import context, declared_attention
from kvtopo.runtime.session import Session


def compile(model: torch.nn.Module, *, inductor: bool = True, dynamic: bool | None = None) -> torch.nn.Module:
    """Compile `model` in place with the kvtopo backend and return it.

    In place (`nn.Module.compile`) so that HF `model.generate(...)`, which calls the module
    itself, runs the compiled forward too. Registers the sliding windows and blocks an HF
    model's config declares (`runtime/declared_attention`), which a graph whose mask HF skipped
    cannot show, and makes its `generate` through a `SessionCache` check that a prompt continues
    what the session holds (`hf_cache.check_prompts`).
    Its arguments are checked here: Dynamo reads them only at the first forward, after
    `kvtopo.generate` has cleared the session.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"kvtopo.compile: model is a {type(model).__name__}; allowed: a torch.nn.Module")
    if not isinstance(inductor, bool):
        raise TypeError(f"kvtopo.compile: inductor={inductor!r} is invalid: True or False")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"kvtopo.compile: dynamic={dynamic!r} is invalid: None, True or False")
    declared_attention.declare(model)
    model.compile(backend="kvtopo", options={"inductor": inductor}, dynamic=dynamic)
    model._compiled_call_impl = attends_through_the_session(model._compiled_call_impl, type(model).__name__)
    hf_cache.check_prompts(model)
    return model


def attends_through_the_session(compiled_call, name: str):
    """`compiled_call` as one model forward of the session (`Session.model_forward`), raising
    when a call made inside a session ran no kvtopo attention: Dynamo
    ran the forward uncompiled (its recompile_limit reached, shared by every frame of the process)
    or the model has no attention kvtopo rewrites, so its tokens attended over themselves alone and
    the session's history was dropped."""

    @functools.wraps(compiled_call)
    def call(*args, **kwargs):
        session = context.active_session()
        if session is None:
            return compiled_call(*args, **kwargs)
        calls = session.calls
        with session.model_forward():
            out = compiled_call(*args, **kwargs)
        if session.calls == calls:
            raise RuntimeError(
                f"kvtopo: a forward of {name} inside a session ran no kvtopo attention, so it did not attend over "
                "the session's history: torch._dynamo ran it uncompiled (e.g. torch._dynamo.config.recompile_limit "
                "reached, a limit the frames of every compiled model in the process share), or the model has no "
                "attention kvtopo rewrites (kvtopo.inspect(model, ...) lists its sites)")
        return out

    call.kvtopo_session_check = True  # what kvtopo.compiled unwraps to find the Dynamo context
    return call


def session(config: Config | None = None) -> Session:
    """A KV store shared by kvtopo-compiled calls made inside `with kvtopo.session(config) as s:`."""
    return Session(config)


def current_session() -> Session:
    """The innermost active session; raises outside `with kvtopo.session(...)`."""
    return context.require_active_session("kvtopo.current_session()")


@dataclass
class InspectReport:
    reports: list[PassReport]

    @property
    def sites(self):
        return [s for r in self.reports for s in r.sites]

    @property
    def refusals(self):
        return [x for r in self.reports for x in r.refusals]

    def format(self) -> str:
        return "\n".join(r.format() for r in self.reports) or "kvtopo: Dynamo produced no graph"


def inspect(model: torch.nn.Module, *args, **kwargs) -> InspectReport:
    """Trace `model(*args, **kwargs)` with Dynamo and report every attention site found or refused.

    Runs outside any session (inside one, a kvtopo-compiled model's forward stored the traced
    tokens in its history), and resets Dynamo before and after: every compiled model recompiles
    on its next call."""
    reports: list[PassReport] = []

    def capture(gm, example_inputs):
        reports.append(run_passes(gm))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad(), context.suspended():
        torch.compile(model, backend=capture)(*args, **kwargs)
    torch._dynamo.reset()
    return InspectReport(reports)
