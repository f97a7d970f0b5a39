"""Logit softcapping (Gemma-2: logits -> cap * tanh(logits / cap)) in the CPU decode fast path.

Kernel level: ``decode_attention(..., softcap=cap)`` (fused C kernel over the Mid codes, torch
for exact/Recent) equals float64 attention with capped logits over the explicitly decoded K/V of
the same segments (``explicit_kv``), within the bound of tests/kernels/decode_bound.py plus a
few float32 ulps of ``cap`` per logit for tanhf (cap * tanh(x / cap) is 1-Lipschitz, so it does
not amplify the logit's own rounding error). The queries are scaled up so the logits are large
and the cap changes the output by far more than that bound (checked per case).

End to end: the zoo's tiny Gemma-2 (attn_logit_softcapping=50, sliding windows; as built, and
with its query projections scaled by 30 so that the cap changes the logits) compiled and
decoded in a session: the global layers' decode steps go through ``attend_cache_batch`` with the
cap, and the logits equal those of the same session whose decode steps take the torch
reference partials (``_history_partials`` + ``partial_dense`` with the cap, what
``Session._attend_one`` computes off the fast path); lossless decoding equals the uncompiled
model's greedy recomputation.
"""

from __future__ import annotations

import pytest
import torch

import kvtopo
from kvtopo.kernels import cpu_decode, fast_decode
from kvtopo.kernels.compressed_attention import merge_partials, partial_dense
from kvtopo.kernels.decode_reference import explicit_kv
from kvtopo.models import zoo
from kvtopo.runtime import decode_view
from kvtopo.runtime import session as session_mod
from kvtopo.runtime.session import _history_partials

from decode_bound import capped_bound, error_bound
from segments import decode_on_threads, synthetic_segments

CAPS = (5.0, 20.0, 50.0)
Q_GAIN = 10.0  # logits up to ~40 on these segments: even cap=50 moves the output by ~0.1


def capped_attention_f64(q, segs, scale, softcap):
    """float64 softmax(cap * tanh(scale q k^T / cap)) v over every segment decoded explicitly."""
    k, v = explicit_kv(segs)
    hkv, _, d = k.shape
    logits = scale * q.double().reshape(hkv, -1, d) @ k.transpose(1, 2)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return (torch.softmax(logits, -1) @ v).reshape(q.shape[0], -1)


SEGMENTS = {
    # Mid only: every logit comes from the C kernel
    "mid-only": dict(kv_heads=2, group=4, exact=0, recent_pages=0, mid_page_rows=(8, 3, 0, 5) * 10),
    # several splits of 1024 rows (each split keeps its own max / lse)
    "mid-splits": dict(kv_heads=1, group=8, exact=0, recent_pages=0, mid_page_rows=(8,) * 300, mid_bits=2),
    # every phase: exact (+ new token), Recent codes, Mid codes
    "all-phases": dict(kv_heads=2, group=4, exact=5, recent_pages=2, mid_page_rows=(8, 1, 7) * 6, mid_bits=8),
}


def _case(name, seed):
    segs = synthetic_segments(**SEGMENTS[name], seed=seed)
    hq = SEGMENTS[name]["kv_heads"] * SEGMENTS[name]["group"]
    q = Q_GAIN * torch.randn(hq, 64, generator=torch.Generator().manual_seed(seed + 1))
    return segs, q, 64**-0.5


def test_c_kernel_is_used():
    assert cpu_decode.c_kernel_available(), "no C compiler: these tests would only check the torch fallback"


@pytest.mark.parametrize("name", SEGMENTS)
@pytest.mark.parametrize("softcap", CAPS)
@pytest.mark.parametrize("threads", [1, 2])
def test_c_kernel_softcap_matches_float64(name, softcap, threads):
    segs, q, scale = _case(name, seed=7)
    out = decode_on_threads(q, segs, scale, threads, softcap=softcap)
    assert torch.isfinite(out).all()
    ref = capped_attention_f64(q, segs, scale, softcap)
    bound = capped_bound(q, segs, scale, softcap)
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, (err, bound)
    # the cap matters here, by far more than the bound: ignoring it could not pass
    uncapped = capped_attention_f64(q, segs, scale, None)
    effect = (uncapped - ref).abs().max().item()
    assert effect > 1e-2 and effect > 2 * bound, (effect, bound)


@pytest.mark.parametrize("name", SEGMENTS)
def test_softcap_none_is_uncapped(name):
    segs, q, scale = _case(name, seed=11)
    out = fast_decode.decode_attention(q, segs, scale, softcap=None)
    assert torch.equal(out, fast_decode.decode_attention(q, segs, scale))
    ref = capped_attention_f64(q, segs, scale, None)
    assert (out.double() - ref).abs().max().item() <= error_bound(q, segs, scale)
    capped = fast_decode.decode_attention(q, segs, scale, softcap=50.0)
    assert (capped - out).abs().max().item() > 1e-2


@pytest.mark.parametrize("softcap", CAPS)
def test_torch_fallback_softcap_equals_c_kernel(softcap, monkeypatch):
    segs, q, scale = _case("mid-only", seed=3)
    fast = cpu_decode.cpu_decode_attention(q, segs, scale, softcap=softcap)
    monkeypatch.setattr(cpu_decode, "mid_kernel", lambda: None)
    slow = cpu_decode.cpu_decode_attention(q, segs, scale, softcap=softcap)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5 * slow.abs().max().item())


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_nonpositive_softcap_refused(bad):
    segs, q, scale = _case("mid-only", seed=0)
    with pytest.raises(ValueError, match="softcap"):
        fast_decode.decode_attention(q, segs, scale, softcap=bad)


def test_attend_cache_softcap_equals_session_reference():
    """A real session's store (topo: int8 Recent, projected 4-bit Mid), large logits."""
    torch.manual_seed(0)
    hkv, hq, d, n, cap = 2, 8, 32, 400, 20.0
    k = torch.randn(hkv, n, d) @ torch.randn(d, d) * 0.3 + 1.0
    v = torch.randn(hkv, n, d) @ torch.randn(d, d) * 0.3
    cfg = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None,
                        key_energy=0.9, value_energy=0.9)
    with kvtopo.session(cfg) as s:
        s.attend("l", torch.randn(1, hq, n, d), k[None], v[None], None, d**-0.5, softcap=cap)
        cache = s.layers["l"]
        assert decode_view.decode_segments(cache, 0).mid is not None
        for _ in range(3):
            q, kn, vn = 8 * torch.randn(hq, 1, d), torch.randn(hkv, 1, d), torch.randn(hkv, 1, d)
            parts = _history_partials(q, cache.segments(0), d**-0.5, cap)
            ref = merge_partials(parts + [partial_dense(q, kn, vn, d**-0.5, softcap=cap)])
            uncapped = merge_partials(_history_partials(q, cache.segments(0), d**-0.5, None)
                                      + [partial_dense(q, kn, vn, d**-0.5)])
            out = decode_view.attend_cache(cache, 0, q, kn, vn, d**-0.5, softcap=cap)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            assert (uncapped - ref).abs().max().item() > 1e-2
            s.attend("l", q[None], kn[None], vn[None], None, d**-0.5, softcap=cap)


# -- end to end: tiny Gemma-2 --------------------------------------------------------------------

PROMPT, STEPS = 96, 12


def _reference_attend_cache(cache, seq, q, k, v, scale, softcap=None):
    """What ``Session._attend_one`` computes off the fast path for a decode step."""
    parts = _history_partials(q, cache.segments(seq), scale, softcap)
    new = [partial_dense(q, k, v, scale, softcap=softcap)] if k is not None else []  # else already stored
    return merge_partials(parts + new).to(q.dtype)


_MODELS: dict = {}


def _gemma2(q_gain: float):
    """The zoo's tiny Gemma-2 (cap 50), its query projections scaled by ``q_gain`` (large logits,
    so that the cap changes the logits), and its compiled form (built once per gain)."""
    if q_gain not in _MODELS:
        model = zoo.build("gemma2", attn_implementation="eager")
        assert model.config.attn_logit_softcapping == 50.0
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(q_gain)
        _MODELS[q_gain] = (model, kvtopo.compile(model, inductor=False))
    return _MODELS[q_gain]


def _decode(compiled, config, ids, attend):
    calls = []

    def spy(cache, seqs, q, k, v, scale, softcap=None, pending=None):  # the session's batched call, row by row
        calls.append(softcap)
        pending = range(len(seqs)) if pending is None else pending  # rows whose token is not stored yet
        return torch.stack([attend(cache, seq, q[i], *((k[i], v[i]) if i in pending else (None, None)), scale, softcap)
                            for i, seq in enumerate(seqs)])

    mp = pytest.MonkeyPatch()
    mp.setattr(session_mod, "attend_cache_batch", spy)
    # Every step by the per-sequence path, whose kernel call the spy replaces (a DecodeBatch's steps
    # are that path's bits: tests/runtime/test_decode_batch.py).
    mp.setattr(session_mod, "decode_step", lambda *args: None)
    try:
        with kvtopo.session(config) as s:
            tokens, logits = kvtopo.generate(compiled, ids, STEPS, return_logits=True)
            coded = sum(decode_view.decode_segments(cache, 0).mid is not None for cache in s.layers.values())
    finally:
        mp.undo()
    return tokens, logits, calls, coded


CONFIGS = {
    "compressed": lambda: kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=16, target_ratio=None),
    "lossless": lambda: kvtopo.Config.lossless(page_size=8),
}


def _fast_path_without_cap(cache, seq, q, k, v, scale, softcap=None):
    return decode_view.attend_cache(cache, seq, q, k, v, scale)


@pytest.mark.parametrize("q_gain", [1.0, 30.0])
@pytest.mark.parametrize("name", CONFIGS)
def test_gemma2_fast_path_equals_reference_path(name, q_gain):
    model, compiled = _gemma2(q_gain)
    config = CONFIGS[name]()
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        tokens, logits, calls, coded = _decode(compiled, config, ids, decode_view.attend_cache)
        ref_tokens, ref_logits, ref_calls, _ = _decode(compiled, config, ids, _reference_attend_cache)
    # the two global layers take the fast path at every decode step, with Gemma-2's cap
    assert set(calls) == {50.0} and len(calls) == 2 * (STEPS - 1), calls
    assert ref_calls == calls
    assert torch.equal(tokens, ref_tokens)
    err = (logits - ref_logits).abs().max().item()
    assert err <= 1e-4, err
    if q_gain > 1 and name == "compressed":  # here the cap matters: a fast path ignoring it fails
        with torch.no_grad():
            _, nocap_logits, _, _ = _decode(compiled, config, ids, _fast_path_without_cap)
        assert (nocap_logits - ref_logits).abs().max().item() > 1e-3
    if name == "lossless":
        assert coded == 0
        expected = ids
        with torch.no_grad():
            for _ in range(STEPS):
                step = model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                expected = torch.cat([expected, step], 1)
        assert torch.equal(tokens, expected)
    else:
        assert coded == 2  # both global layers' fast path read projected, quantized Mid codes
