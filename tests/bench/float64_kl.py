"""The reference the bench accounting tests score KL against: written out term by term in Python floats."""

import math


def kl64(p_logits, q_logits):
    """KL(p || q) of one row of logits, summed term by term in float64."""
    lp = [x - math.log(sum(math.exp(y) for y in p_logits)) for x in p_logits]
    lq = [x - math.log(sum(math.exp(y) for y in q_logits)) for x in q_logits]
    return sum(math.exp(a) * (a - b) for a, b in zip(lp, lq))
