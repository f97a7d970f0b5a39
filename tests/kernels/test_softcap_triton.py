"""Logit softcapping in the Triton decode kernels (run by the Triton interpreter on CPU).

With ``softcap`` the kernels equal the torch reference (``cpu_decode_attention`` with the C
kernel disabled: ``partial_dense``/``partial_lowrank`` with the cap) and float64 attention with
capped logits over the explicitly decoded segments, on segments with large logits where the cap
changes the output by far more than the tolerance. The interpreter set up by
tests/kernels/triton_interpreter.py (a fresh subprocess when triton was imported without it).
"""

from __future__ import annotations

from triton_interpreter import fresh_interpreter_run, in_process  # before anything imports triton

import pytest
import torch

from kvtopo.kernels import cpu_decode, triton_decode

from segments import synthetic_segments
from decode_bound import capped_bound
from test_softcap_decode import CAPS, SEGMENTS, capped_attention_f64

test_in_fresh_interpreter_process = fresh_interpreter_run(__file__)


CASES = {  # interpreter-sized versions of the C tests' segments
    "mid-only": dict(SEGMENTS["mid-only"], mid_page_rows=(8, 3, 0, 5) * 3),
    "all-phases": dict(SEGMENTS["all-phases"], mid_page_rows=(8, 1, 7) * 2),
    "mid-only-unprojected": dict(SEGMENTS["mid-only"], mid_page_rows=(8, 3, 0, 5, 1) * 2, projected=False),
}


@in_process
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("splits", [None, 3])
def test_triton_softcap_equals_torch_reference(name, softcap, splits, monkeypatch):
    monkeypatch.setattr(triton_decode, "POISON_SCRATCH", True)
    monkeypatch.setattr(triton_decode, "FORCE_SPLITS", splits)
    segs = synthetic_segments(**CASES[name], seed=13)
    q = 10.0 * torch.randn(CASES[name]["kv_heads"] * CASES[name]["group"], 64,
                           generator=torch.Generator().manual_seed(14))
    scale = 64**-0.5
    out = torch.full((q.shape[0], 64), float("nan"))
    triton_decode.triton_decode_attention(q, segs, scale, out=out, softcap=softcap)
    assert torch.isfinite(out).all()
    monkeypatch.setattr(cpu_decode, "mid_kernel", lambda: None)
    torch_ref = cpu_decode.cpu_decode_attention(q, segs, scale, softcap=softcap)
    torch.testing.assert_close(out, torch_ref, rtol=1e-5, atol=1e-5 * torch_ref.abs().max().item())
    ref = capped_attention_f64(q, segs, scale, softcap)
    bound = capped_bound(q, segs, scale, softcap)
    assert (out.double() - ref).abs().max().item() <= bound
    uncapped = capped_attention_f64(q, segs, scale, None)
    assert (uncapped - ref).abs().max().item() > max(1e-2, 2 * bound)


@in_process
def test_triton_softcap_none_is_uncapped():
    segs = synthetic_segments(**CASES["all-phases"], seed=2)
    q = 10.0 * torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    plain = triton_decode.triton_decode_attention(q, segs, 0.125)
    assert torch.equal(triton_decode.triton_decode_attention(q, segs, 0.125, softcap=None), plain)
    capped = triton_decode.triton_decode_attention(q, segs, 0.125, softcap=50.0)
    assert (capped - plain).abs().max().item() > 1e-2
