"""Key-norm eviction (Devoto et al., 2024, "A simple and effective L2 norm-based strategy for
KV cache compression"): keys with a LOW L2 norm draw the most attention, so each kv-head keeps
the Mid tokens with the lowest key norm. Query-free: needs no observation window or attention
mass. Kept tokens are stored exactly; Recent is exact.
"""

import torch

from .base import ExactEviction, ScoreInputs


class KNorm(ExactEviction):
    name = "knorm"
    reads_queries = False

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return -inputs.keys.float().norm(dim=-1)
