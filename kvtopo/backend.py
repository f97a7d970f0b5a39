"""The `torch.compile` backend: `torch.compile(model, backend="kvtopo")`.

Registered through the `torch_dynamo_backends` entry point, so the name works in a fresh process
without importing kvtopo first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtopo.passes.manager import PassReport, run_passes

log = logging.getLogger("kvtopo")

# Reports of every graph compiled by this backend in this process, oldest first.
REPORTS: list[PassReport] = []


@dataclass(frozen=True)
class BackendOptions:
    """inductor: hand the rewritten graph to Inductor (True) or run it eagerly (False, for debugging)."""

    inductor: bool = True

    @classmethod
    def from_dict(cls, options: dict | None) -> "BackendOptions":
        options = dict(options or {})
        unknown = set(options) - {"inductor"}
        if unknown:
            raise ValueError(f"unknown kvtopo backend option(s) {sorted(unknown)}; allowed: ['inductor']")
        if not isinstance(options.get("inductor", True), bool):
            raise ValueError(f"backend option inductor={options['inductor']!r} must be a bool")
        return cls(**options)


def kvtopo_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    opts = BackendOptions.from_dict(options)
    report = run_passes(gm)
    REPORTS.append(report)
    log.info("%s", report.format())
    for refusal in report.refusals:
        log.warning("kvtopo left attention unchanged: %s", refusal.describe())
    if opts.inductor:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    return gm.forward
