"""``principal_basis(x, energy, max_rank)``: ``max_rank`` caps the energy rank, it never raises it.

A basis whose energy target is met by r directions keeps r even when ``max_rank`` allows more:
the extra directions would carry only noise energy, and every extra direction costs a Mid row
one more coefficient code per token (and the rank decides the bytes the store reports). The
existing rank tests pass ``max_rank`` only below the energy rank, where a cap and a fixed rank
give the same answer; here the cap is above it, and above what the data can span.
"""

from __future__ import annotations

import torch

from kvtopo.kernels.directions import principal_basis, project, reconstruct


def _known_spectrum(seed: int = 0) -> torch.Tensor:
    """[200, 24] centred rows with singular values 10, 5, 1 on three orthonormal directions and
    nothing else: energy fractions 100/126, 125/126, 1."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.linalg.qr(torch.randn(24, 24, generator=g, dtype=torch.float64))[0][:, :3]
    coefficients = torch.linalg.qr(torch.randn(200, 3, generator=g, dtype=torch.float64))[0]
    coefficients -= coefficients.mean(0)  # centred, so the mean takes nothing away
    coefficients = torch.linalg.qr(coefficients)[0]
    return (coefficients * torch.tensor([10.0, 5.0, 1.0], dtype=torch.float64)) @ directions.T + 3.0


def test_max_rank_above_the_energy_rank_keeps_the_energy_rank():
    x = _known_spectrum()
    for energy, rank in ((0.5, 1), (0.9, 2), (0.999, 3)):
        assert principal_basis(x.float(), energy).rank == rank
        for cap in (rank, rank + 1, 10, 24):
            basis = principal_basis(x.float(), energy, max_rank=cap)
            assert basis.rank == rank, (energy, cap, basis.rank)
            assert basis.vectors.shape == (24, rank)
    # Below the energy rank the cap decides.
    assert principal_basis(x.float(), 0.999, max_rank=2).rank == 2


def test_max_rank_beyond_what_the_rows_span():
    """Three rows span at most a plane once centred: a cap of 10 leaves rank 2, and the basis
    still reconstructs the rows exactly."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    basis = principal_basis(x, 1.0, max_rank=10)
    assert basis.rank == 2
    torch.testing.assert_close(reconstruct(project(x, basis), basis), x, atol=1e-5, rtol=1e-5)
    constant = torch.ones(5, 8)
    assert principal_basis(constant, 0.9, max_rank=4).rank == 0  # no variation: the mean alone
