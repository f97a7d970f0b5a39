"""`kernels.positions.restart_at_zero`, the check `kvtopo::given_positions` raises on inside a
session: positions that number *every* row 0..T-1 again (a forward recomputing the sequence, a new
prompt), or a rotary cos/sin whose every row's first token is at position 0 -- and nothing else.

tests/passes/test_positions.py reaches it through whole models, where every row restarts or none
does; here the rows disagree (one row restarting in a batch whose others continue, a left-padded
row whose padding positions match 0..T-1 at some index), which a check of *some* row or *some*
position would flag and a forward continuing the batch would then wrongly raise on."""

from __future__ import annotations

import pytest
import torch

from kvtopo.kernels.positions import restart_at_zero


def _rotary(positions: torch.Tensor, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., T, dim] of a rotary embedding (frequencies 1, 1/10000**(2i/dim)), as HF builds them."""
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[..., None] * inv
    emb = torch.cat([angles, angles], -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("positions, restarts", [
    (torch.arange(6), True),
    (torch.arange(6)[None].expand(3, 6), True),  # every row of a batch restarts
    (torch.arange(6) + 4, False),  # a continuation
    (torch.stack([torch.arange(6), torch.arange(6) + 9]), False),  # one row restarts, the other continues
    (torch.stack([torch.tensor([1, 1, 1, 1, 0, 1]), torch.arange(6) + 9]), False),  # padding positions (1) equal 0..T-1 at index 1
    (torch.tensor([[0, 1, 2, 3, 4, 7]]), False),  # all but the last
    (torch.arange(6)[None, None].expand(3, 2, 6), True),  # mrope [3, B, T]
    (torch.tensor([0]), True),  # one token at 0
    (torch.tensor([5]), False),  # a decode step
])
def test_integer_positions(positions, restarts):
    assert restart_at_zero(positions) is restarts


@pytest.mark.parametrize("positions, restarts", [
    (torch.arange(5)[None], True),
    (torch.arange(5)[None] + 3, False),
    (torch.stack([torch.arange(5), torch.arange(5) + 3]), False),  # one row's first token at 0, the other's not
    (torch.stack([torch.arange(5), torch.arange(5)]), True),
    (torch.tensor([[7]]), False),  # a decode step's single row
])
def test_rotary_cos_and_sin(positions, restarts):
    cos, sin = _rotary(positions)
    assert restart_at_zero(cos) is restarts
    assert restart_at_zero(sin) is restarts
