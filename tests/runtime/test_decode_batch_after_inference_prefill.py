"""Prompts stored and a first decode step taken under `torch.inference_mode()` leave observation
windows that are inference tensors; the decode steps then taken under `torch.no_grad()` cannot
update those in place. The layer's batched decode steps (runtime/decode_batch.py) wait until the
per-sequence path has replaced them, and the steps' outputs and the store are the bits of a twin
session whose layer never batches its decode steps."""

from __future__ import annotations

import torch

import kvtopo

HQ, HKV, D = 8, 2, 32
SCALE = D**-0.5
PAGE = 8
LENGTHS = (70, 45, 20)


def _config():
    """An evicting policy: it scores pages with the observation windows."""
    return kvtopo.Config(page_size=PAGE, sink_tokens=8, recent_tokens=16, observation_window=8, target_ratio=4.0)


def _state(cache):
    return [(seq, e.length, e.observed_oldest, [(p.tokens, p.slot, p.phase) for p in e.pages],
             None if e.observation is None else e.observation.clone())
            for seq, e in sorted(cache.sequences.items())]


def test_decode_steps_under_no_grad_after_an_inference_mode_prefill():
    g = torch.Generator().manual_seed(0)
    prompts = [[torch.randn(h, n, D, generator=g) for h in (HQ, HKV, HKV)] for n in LENGTHS]
    steps = [[torch.randn(len(LENGTHS), h, 1, D, generator=g) for h in (HQ, HKV, HKV)] for _ in range(3 * PAGE)]
    with kvtopo.session(_config()) as batched, kvtopo.session(_config()) as twin:
        with torch.inference_mode():
            for s in (batched, twin):
                for b, prompt in enumerate(prompts):
                    s.attend_sequence("l", b, *prompt, SCALE)
        assert batched.layers["l"].stored_state(0).observation.is_inference()
        twin.layers["l"].decode_batch_refused = 10**9
        for i, (q, k, v) in enumerate(steps):
            with torch.inference_mode() if i == 0 else torch.no_grad():  # the first step as the prefill
                out = batched.attend("l", q, k, v, None, SCALE)
                assert torch.equal(out, twin.attend("l", q, k, v, None, SCALE))
        with torch.no_grad():
            assert batched.layers["l"].decode_batch is not None  # batched once the windows were replaced
            for x, y in zip(_state(batched.layers["l"]), _state(twin.layers["l"]), strict=True):
                assert x[:4] == y[:4] and torch.equal(x[4], y[4])
