"""H2O-like (Zhang et al., 2023): keep the heavy hitters, the tokens that received the most
attention so far.

Score: the softmax attention mass a token accumulated while its page was Terminal/Recent
(`tracks_attention_mass = True` makes the session add every step's mass to `page.mass`).
A page that reached Mid without mass for all its tokens (a long prefill chunk writes pages
that go straight to Mid before any later query attended to them) falls back to the softmax
mass of the observation window, for the whole page so that one scale ranks it. A chunk's
attention to its own tokens is never accumulated, so a prompt prefilled in one chunk is ranked
entirely by that fallback: there H2O ranks as SnapKV without pooling; H2O proper sums every
prefill query's attention. Kept tokens are stored exactly; Recent is exact.
"""

import torch

from kvtopo.kernels.scoring import softmax_mass

from .base import ExactEviction, ScoreInputs


class H2O(ExactEviction):
    name = "h2o"
    tracks_attention_mass = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        mass = inputs.attention_mass
        n = inputs.keys.shape[1]
        if mass is not None and mass.shape[1] >= n:
            return mass[:, :n].float()
        if inputs.queries is None:
            return inputs.keys.new_zeros(inputs.keys.shape[:2], dtype=torch.float32)
        return softmax_mass(inputs.queries, inputs.keys, inputs.scale, inputs.softcap)
