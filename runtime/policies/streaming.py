"""StreamingLLM (Xiao et al., 2023): attention sinks + a recent window, exact; the rest dropped.

Initial pages (the first `sink_tokens`, plus protected spans) and the `recent_tokens` window
are kept exactly (`recent_bits` is ignored: StreamingLLM does not quantize); a page that ages
into Mid is dropped whole, whatever the budget, so the cache holds a constant number of tokens
however long the sequence grows. The window size (`recent_tokens`) is the method's only knob.

Dropping a Mid page whole needs the store to cap how many tokens a Mid page keeps
(`MidEncoding.max_tokens`, see below). Until the store has that cap, eviction is budget-driven
only, and the faithful way to run this policy is a budget nothing in Mid fits
(`layer_budget_bytes=1`); the store then reports `budget_missed`, which for this policy means
nothing.
"""

import dataclasses

import torch

from .base import MidEncoding, Policy, ScoreInputs

# The store hook this policy asks for: MidEncoding.max_tokens caps the survivors of a Mid page
# (0 = drop it), independently of the byte budget.
HAS_MAX_TOKENS = "max_tokens" in {f.name for f in dataclasses.fields(MidEncoding)}


class Streaming(Policy):
    name = "streaming"

    def recent_bits(self):
        return None

    def mid_encoding(self) -> MidEncoding:
        if HAS_MAX_TOKENS:
            return MidEncoding(evict=True, max_tokens=0)
        return MidEncoding(evict=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        # Only reached when the store keeps some Mid tokens (no max_tokens hook and a budget
        # with room): then the page's latest tokens, the ones nearest the window, survive.
        n = inputs.keys.shape[1]
        return torch.arange(n, dtype=torch.float32).expand(inputs.keys.shape[0], n).clone()
