"""Key-norm eviction (Devoto et al., 2024, "A simple and effective L2 norm-based strategy for
KV cache compression"): keys with a LOW L2 norm draw the most attention, so each kv-head keeps
the Mid tokens with the lowest key norm. Query-free: needs no observation window or attention
mass. Kept tokens are stored exactly; Recent is exact.
"""

import torch

from .base import MidEncoding, Policy, ScoreInputs


class KNorm(Policy):
    name = "knorm"

    def recent_bits(self):
        return None

    def mid_encoding(self) -> MidEncoding:
        c = self.config
        return MidEncoding(evict=c.target_ratio is not None or c.layer_budget_bytes is not None)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return -inputs.keys.float().norm(dim=-1)
