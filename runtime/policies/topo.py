"""kvtopo's own policy: exp-free eviction, directional pruning and low-bit codes in Mid; int8 Recent.

Which Mid tokens survive is decided by `kernels.scoring.expfree_scores` (matmul, max, subtract,
relu, sums: no exponential), so the same scoring graph runs on NPU matrix units; surviving
keys/values are projected onto each head's retained principal directions and the coefficients
stored in `mid_bits` bits.
"""

import torch

from kvtopo.kernels.scoring import expfree_scores

from .base import MidEncoding, Policy, ScoreInputs


class Topo(Policy):
    name = "topo"

    def recent_bits(self):
        return self.config.recent_bits

    def mid_encoding(self) -> MidEncoding:
        c = self.config
        project = c.key_energy is not None
        return MidEncoding(evict=self.has_budget(), project=project, key_bits=c.mid_bits, value_bits=c.mid_bits,
                           refit=project and c.refit_after is not None)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        if inputs.queries is None:
            return inputs.keys.new_zeros(inputs.keys.shape[:2])
        return expfree_scores(inputs.queries, inputs.keys, inputs.scale, margin=self.config.score_margin)
