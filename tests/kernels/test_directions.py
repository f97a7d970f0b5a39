"""Principal basis: orthonormality, exact energy accounting, minimal rank, edge inputs."""

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvtopo.kernels.directions import principal_basis, project, reconstruct

ENERGIES = [0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0]


@st.composite
def structured_rows(draw):
    """Rows with an offset, decaying-energy structure and noise; N may be below d."""
    n = draw(st.integers(1, 40))
    d = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    k = min(n, d)
    structure = torch.randn(n, k, generator=g, dtype=torch.float64) * torch.logspace(1, -2, k, dtype=torch.float64)
    x = structure @ torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))[0].T
    x = x + 3.0 * torch.randn(d, generator=g, dtype=torch.float64)
    return x.float()


def _centred_energies(x):
    x64 = x.double()
    s = torch.linalg.svdvals(x64 - x64.mean(0))
    cumulative = (s * s).cumsum(0)
    return cumulative, cumulative[-1]


@settings(max_examples=60, deadline=None)
@given(structured_rows(), st.sampled_from(ENERGIES))
def test_orthonormal_and_error_equals_discarded_energy(x, energy):
    basis = principal_basis(x, energy)
    v = basis.vectors.double()
    assert basis.vectors.dtype == basis.mean.dtype == torch.float32
    assert v.shape == (x.shape[1], basis.rank)
    torch.testing.assert_close(v.T @ v, torch.eye(basis.rank, dtype=torch.float64), atol=1e-6, rtol=0)

    x64 = x.double()
    mean = basis.mean.double()
    residual = (x64 - mean) - (x64 - mean) @ v @ v.T
    cumulative, total = _centred_energies(x)
    discarded = total - (cumulative[basis.rank - 1] if basis.rank else 0.0)
    tol = 1e-5 * total + 1e-12 * x64.square().sum()
    assert abs(residual.square().sum() - discarded) <= tol


@settings(max_examples=60, deadline=None)
@given(structured_rows(), st.sampled_from(ENERGIES))
def test_rank_is_the_minimal_one_meeting_the_threshold(x, energy):
    cumulative, total = _centred_energies(x)
    assume(total > 0)
    fractions = cumulative / total
    # Skip thresholds that fall within rounding of a cumulative fraction (except the last,
    # which equals 1 exactly by construction).
    assume(bool(((fractions[:-1] - energy).abs() > 1e-9).all()))
    r = principal_basis(x, energy).rank
    assert r >= 1  # fractions[r - 1] below would silently read the last entry for r = 0
    assert fractions[r - 1] >= energy
    assert r == 1 or fractions[r - 2] < energy


@pytest.mark.parametrize(("energy", "expected"), [(0.3, 1), (0.6, 2), (0.8, 3), (0.9, 4), (0.95, 5), (0.99, 6), (1.0, 6)])
def test_ranks_on_known_spectrum(energy, expected):
    # Centred energies 16, 8, 4, 2, 1, 1 (out of 32): cumulative fractions .5 .75 .875 .9375 .96875 1.
    g = torch.Generator().manual_seed(0)
    z = torch.randn(500, 6, generator=g, dtype=torch.float64)
    z = z - z.mean(0)
    z = torch.linalg.qr(z)[0] * torch.tensor([16.0, 8, 4, 2, 1, 1]).sqrt()  # orthogonal columns
    x = torch.cat([z, torch.zeros(500, 4, dtype=torch.float64)], 1) + 7.0
    basis = principal_basis(x, energy)
    assert basis.rank == expected
    torch.testing.assert_close(basis.mean, torch.full((10,), 7.0), atol=1e-6, rtol=0)


def test_max_rank_caps_the_rank():
    x = torch.randn(50, 16)
    assert principal_basis(x, 1.0).rank == 16
    assert principal_basis(x, 1.0, max_rank=5).rank == 5
    assert principal_basis(x, 1.0, max_rank=0).rank == 0


def test_fewer_rows_than_dimensions():
    x = torch.randn(3, 32)
    basis = principal_basis(x, 1.0)
    assert basis.rank == 2  # three centred rows span a plane
    torch.testing.assert_close(reconstruct(project(x, basis), basis), x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x",
    [torch.zeros(10, 8), torch.full((10, 8), 2.5), torch.randn(1, 8)],
    ids=["all-zero", "constant-rows", "single-row"],
)
def test_no_variation_gives_rank_zero_and_exact_mean(x):
    basis = principal_basis(x, 0.9)
    assert basis.rank == 0 and basis.vectors.shape == (8, 0)
    coefficients = project(x, basis)
    assert coefficients.shape == (x.shape[0], 0)
    torch.testing.assert_close(reconstruct(coefficients, basis), x)


@pytest.mark.parametrize("energy", [0.0, -0.1, 1.0001, float("nan")])
def test_energy_outside_unit_interval_raises(energy):
    with pytest.raises(ValueError, match="energy"):
        principal_basis(torch.randn(10, 4), energy)


def test_invalid_shapes_and_max_rank_raise():
    with pytest.raises(ValueError, match="max_rank"):
        principal_basis(torch.randn(10, 4), 0.9, max_rank=-1)
    with pytest.raises(ValueError, match="N >= 1"):
        principal_basis(torch.zeros(0, 4), 0.9)
    with pytest.raises(ValueError, match="N >= 1"):
        principal_basis(torch.zeros(4), 0.9)


def test_low_precision_input_returns_float32():
    basis = principal_basis(torch.randn(20, 8, dtype=torch.bfloat16), 0.9)
    assert basis.vectors.dtype == basis.mean.dtype == torch.float32
    assert project(torch.randn(3, 8, dtype=torch.float16), basis).dtype == torch.float32


def _attention(q, k, v):
    return torch.softmax(q @ k.T / math.sqrt(k.shape[1]), -1) @ v


def test_centring_beats_uncentred_at_equal_rank_on_offset_keys():
    """The design decision of directions.py, on a smaller instance of its measurement."""
    d, n_mid, n_exact, rank = 64, 512, 32, 6
    errors = {True: 0.0, False: 0.0}
    for trial in range(4):
        g = torch.Generator().manual_seed(trial)
        offset = torch.zeros(d, dtype=torch.float64)
        offset[torch.randperm(d, generator=g)[:6]] = 9.0 * torch.rand(6, generator=g, dtype=torch.float64)
        mixing = torch.randn(12, d, generator=g, dtype=torch.float64) * torch.logspace(0.5, -1, 12, dtype=torch.float64)[:, None]

        def rows(n):
            return offset + torch.randn(n, 12, generator=g, dtype=torch.float64) @ mixing + 0.03 * torch.randn(n, d, generator=g, dtype=torch.float64)

        k, v = rows(n_mid + n_exact), rows(n_mid + n_exact)
        q = 2.0 * torch.randn(8, 12, generator=g, dtype=torch.float64) @ mixing + 0.3 * offset
        ref = _attention(q, k, v)
        for centred in (True, False):
            approx = []
            for x in (k[:n_mid], v[:n_mid]):
                if centred:
                    basis = principal_basis(x, 1.0, max_rank=rank)
                    vectors, mean = basis.vectors.double(), basis.mean.double()
                else:
                    vectors, mean = torch.linalg.svd(x, full_matrices=False)[2][:rank].T, 0.0
                approx.append((x - mean) @ vectors @ vectors.T + mean)
            out = _attention(q, torch.cat([approx[0], k[n_mid:]]), torch.cat([approx[1], v[n_mid:]]))
            errors[centred] += ((out - ref).norm() / ref.norm()).item() / 4
    print(f"attention rel. error at rank {rank}: centred {errors[True]:.3f}, uncentred {errors[False]:.3f}")
    assert errors[True] < 0.85 * errors[False]
