"""SnapKV-like (Li et al., 2024): keep the Mid tokens the observation window attends to most.

Score: the softmax attention mass each token receives from the latest `observation_window`
queries (`kernels.scoring.softmax_mass`, summed over the window and the kv-head's query group),
max-pooled over a neighbourhood of `POOL_KERNEL` tokens (SnapKV's clustering step: a kept token
brings its neighbours, which keeps local context around a hit intact). The kernel is clipped to
the page. Unlike SnapKV, the softmax is taken over the tokens being ranked only (a page at a
decode step, a prompt's Mid group in the joint plan), not the whole context: attention a query
gives the sink, Recent or window tokens does not lower its votes (docs/measurements.md, "How
close the in-house baselines are"). kvpress's SnapKVPress also differs (window 64, average
pooling of 5, pooled per query head). Kept tokens are stored exactly (no projection, no
bits); Recent is exact. Eviction happens whenever a budget (`target_ratio` /
`layer_budget_bytes`) is set.
"""

import torch
import torch.nn.functional as F

from kvtopo.kernels.scoring import softmax_mass

from .base import ExactEviction, ScoreInputs

# SnapKV's pooling kernel (its reference code uses 5-7); not a Config field.
POOL_KERNEL = 7


def max_pool_tokens(score: torch.Tensor, kernel: int = POOL_KERNEL) -> torch.Tensor:
    """Max over a centred window of `kernel` tokens, clipped at the page's ends. [H, n] -> [H, n]."""
    n = score.shape[-1]
    kernel = min(kernel, n if n % 2 else n - 1)
    if kernel <= 1:
        return score
    return F.max_pool1d(score[:, None], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0]


class SnapKV(ExactEviction):
    name = "snapkv"

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        if inputs.queries is None:
            return inputs.keys.new_zeros(inputs.keys.shape[:2], dtype=torch.float32)
        return max_pool_tokens(softmax_mass(inputs.queries, inputs.keys, inputs.scale, inputs.softcap))
