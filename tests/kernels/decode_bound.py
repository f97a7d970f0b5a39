"""The float32 error bound both decode-kernel tests (C and Triton) check against float64; its
derivation is in tests/kernels/test_triton_decode.py's docstring."""

from kvtopo.kernels.decode_reference import explicit_kv

U = 2.0**-24  # float32 unit roundoff


def error_bound(q, segs, scale: float) -> float:
    """4 u ((2d + 8) L + N + 64) V over the decoded segments (L: largest absolute logit mass)."""
    k, v = explicit_kv(segs)
    hkv, n, d = k.shape
    qg = q.double().abs().reshape(hkv, -1, d)
    logit_mass = (scale * qg @ k.abs().transpose(1, 2)).max().item()
    return 4 * U * ((2 * d + 8) * logit_mass + n + 64) * v.abs().max().item()


def capped_bound(q, segs, scale: float, softcap: float | None) -> float:
    """``error_bound`` plus what the softcap's tanh adds (a few ulps of ``softcap`` per logit)."""
    v_max = explicit_kv(segs)[1].abs().max().item()
    return error_bound(q, segs, scale) + 4 * U * 8 * (softcap or 0.0) * v_max
