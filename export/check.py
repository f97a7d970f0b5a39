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
    max_logit_error: float  # over the new tokens' logits, up to the first where the runs part (if they do)
    bytes_held: int  # KV bytes the host runner holds
    session_bytes: int  # what the session holds, its free pool slots aside
    runner: object  # the HostRunner, for checks of its pages
    parted_at: int | None = None  # the first new token where the runtime's differs from the session's
    tie_gap: float | None = None  # there: the session's logit of its own token minus that of the runtime's
    error_before_parting: float | None = None  # the logit error over the new tokens before it (None at the first)

    @property
    def same_tokens(self) -> bool:
        return self.tokens == self.session_tokens

    @property
    def parted_at_a_tie(self) -> bool:
        """The runs part where the session's two candidates are closer than twice the float error
        the runtime showed before: summation order decides such a near-tie (each run then
        continues its own text, so later logits are not compared). A parting at the first new
        token has no error before it to judge by (the parting step's own error always covers its
        gap, however wrong the runtime), so it is never excused."""
        return self.error_before_parting is not None and self.tie_gap <= 2 * self.error_before_parting

    def passes(self, max_logit_error: float) -> bool:
        """A smoke run's verdict: the session's tokens (or a parting at a near-tie) and logits within
        `max_logit_error` of the session's. Tokens alone pass a runtime whose logits are far off
        wherever its argmax still agrees over a short run."""
        return (self.same_tokens or self.parted_at_a_tie) and self.max_logit_error <= max_logit_error

    def describe(self, max_logit_error: float | None = None) -> str:
        """One line: the tokens' verdict, the logit error (flagged when above `max_logit_error`), the KV bytes."""
        if self.same_tokens:
            verdict = "same tokens"
        elif self.parted_at_a_tie:
            verdict = (f"same tokens up to new token {self.parted_at}, where the session's top two logits are "
                       f"{self.tie_gap:.1e} apart (a near-tie; later tokens not compared)")
        else:
            verdict = "TOKENS DIFFER"
        logits = f"logits within {self.max_logit_error:.1e}"
        if max_logit_error is not None and self.max_logit_error > max_logit_error:
            logits = f"LOGITS OFF by {self.max_logit_error:.1e}, above the bound {max_logit_error:.1e}"
        return (f"{self.runtime}: {verdict} as the PyTorch session over {self.new_tokens} new tokens, {logits}, "
                f"KV bytes {self.bytes_held} (session {self.session_bytes})")


def agreement(runtime: str, runner, tokens: list[int], logits: np.ndarray, reference) -> Agreement:
    """The runtime's greedy run (`tokens` prompt + new, `logits` [new, V]) next to the session's
    (`reference`, `session_reference`'s result): where the new tokens part, and the logit error
    up to there (and before there: the float error a near-tie is judged by)."""
    ref_tokens, ref_logits, ref_bytes = reference
    new = len(logits)
    ours, theirs = tokens[-new:], ref_tokens[-new:]
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    errors = np.abs(logits - ref_logits).max(-1)  # per new token
    if parted is None:
        return Agreement(runtime, new, tokens, ref_tokens, float(errors.max()), runner.nbytes(), ref_bytes, runner)
    gap = float(ref_logits[parted, theirs[parted]] - ref_logits[parted, ours[parted]])
    before = float(errors[:parted].max()) if parted else None
    return Agreement(runtime, new, tokens, ref_tokens, float(errors[: parted + 1].max()), runner.nbytes(), ref_bytes,
                     runner, parted, gap, before)


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
        tokens, logits = runner.generate(input_ids[0].numpy(), new_tokens, return_logits=True)
        agreements.append(agreement(runtime, runner, tokens.tolist(), logits, reference))
    return agreements


def session_reference(model, input_ids: torch.Tensor, new_tokens: int, config):
    """(tokens [prompt + new], logits [new, V], KV bytes held) of the compiled model in a session."""
    import kvtopo

    kvtopo.compile(model, inductor=False)
    with kvtopo.session(config) as session:
        tokens, logits = kvtopo.generate(model, input_ids, new_tokens, return_logits=True)
        stats = session.stats()
    return tokens[0].tolist(), logits[0].numpy(), stats.total_bytes - stats.per_kind.get("free", 0)
