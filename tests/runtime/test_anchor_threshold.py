"""An anchor is a token whose credit is AT LEAST `strength` times its head's mean credit
(`anchor_reach`): a token exactly at the threshold is an anchor and carries its credit forward;
one just below it carries nothing. Values are exact in binary floating point, so the threshold
comparison is not at the mercy of rounding."""

import torch

from kvtopo.runtime.policies.topo import anchor_reach


def test_a_token_exactly_at_the_threshold_is_an_anchor():
    credit = torch.zeros(1, 8)
    credit[0, 1] = 4.0
    credit[0, 5] = 4.0  # mean 1.0: both exactly 4 x the mean
    reached = anchor_reach(credit, strength=4.0, reach=2)
    assert reached.tolist() == [[0.0, 4.0, 4.0, 4.0, 0.0, 4.0, 4.0, 4.0]]


def test_a_token_just_below_the_threshold_passes_on_nothing():
    credit = torch.zeros(1, 8)
    credit[0, 1] = 8.0
    credit[0, 5] = 3.5  # mean 1.4375: 8.0 >= 5.75 is an anchor, 3.5 is not
    reached = anchor_reach(credit, strength=4.0, reach=2)
    assert reached.tolist() == [[0.0, 8.0, 8.0, 8.0, 0.0, 0.0, 0.0, 0.0]]


def test_heads_are_thresholded_by_their_own_mean():
    credit = torch.tensor([[2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # mean 0.25: 2.0 = 8 x mean
                           [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])  # mean 2.0: nothing stands out
    reached = anchor_reach(credit, strength=8.0, reach=3)
    assert reached[0].tolist() == [2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    assert reached[1].tolist() == [0.0] * 8
