"""An export run on a runtime next to the PyTorch session it was exported from: the reference.

Greedy decoding of the same prompt through `HostRunner` (any runtime of export/executors.py)
and through the model compiled with kvtopo in a session of the config the graphs implement.
`kvtopo export --target` smoke-runs with it; the export tests assert on what it measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Agreement:
    runtime: str
    new_tokens: int
    tokens: list[int]  # prompt + new, from the runtime
    session_tokens: list[int]
    max_logit_error: float  # over the new tokens' logits
    bytes_held: int  # KV bytes the host runner holds
    session_bytes: int  # what the session holds, its free pool slots aside
    runner: object  # the HostRunner, for checks of its pages

    @property
    def same_tokens(self) -> bool:
        return self.tokens == self.session_tokens

    def describe(self) -> str:
        verdict = "same tokens" if self.same_tokens else "TOKENS DIFFER"
        return (f"{self.runtime}: {verdict} as the PyTorch session over {self.new_tokens} new tokens, logits within "
                f"{self.max_logit_error:.1e}, KV bytes {self.bytes_held} (session {self.session_bytes})")


def session_reference(model, input_ids: torch.Tensor, new_tokens: int, config):
    """(tokens [prompt + new], logits [new, V], KV bytes held) of the compiled model in a session."""
    import kvtopo

    kvtopo.compile(model, inductor=False)
    with kvtopo.session(config) as session:
        tokens, logits = kvtopo.generate(model, input_ids, new_tokens, return_logits=True)
        stats = session.stats()
    return tokens[0].tolist(), logits[0].numpy(), stats.total_bytes - stats.per_kind.get("free", 0)


def compare_with_session(model, export_dir, runtimes, input_ids: torch.Tensor, new_tokens: int,
                         reference=None) -> list[Agreement]:
    """Run `input_ids` [1, T] + `new_tokens` greedy steps on each runtime over `export_dir` and in
    the session (or against `reference`, a `session_reference` result already computed)."""
    from kvtopo.export.host_runner import HostRunner

    agreements = []
    for runtime in runtimes:
        runner = HostRunner(export_dir, runtime=runtime)
        if reference is None:
            reference = session_reference(model, input_ids, new_tokens, runner.config)
        ref_tokens, ref_logits, ref_bytes = reference
        tokens, logits = runner.generate(input_ids[0].numpy(), new_tokens, return_logits=True)
        agreements.append(Agreement(runtime, new_tokens, tokens.tolist(), ref_tokens, float(np.abs(logits - ref_logits).max()),
                                    runner.nbytes(), ref_bytes, runner))
    return agreements
