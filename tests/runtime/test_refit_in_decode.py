"""A decode token that reaches a refit point (`Lifecycle.next_refit`) in the middle of a page starts
the new Mid epoch at that token, as appending it through the lifecycle does, also when the session
writes decode tokens into their Terminal page in place (`LayerCache.write_in_place`, the batched
decode path): the fast path may skip the lifecycle only for tokens that move no page and start no
epoch."""

import pytest
import torch

import kvtopo
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import make_policy

HQ, HKV, D = 4, 2, 4
CONFIG = kvtopo.Config(page_size=8, sink_tokens=8, recent_tokens=8, target_ratio=None, key_energy=0.9,
                       value_energy=0.9, refit_after=16, mid_bits=4, recent_bits=8)
PROMPT, TOKENS = 42, 100


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(HQ, TOKENS, D, generator=g), torch.randn(HKV, TOKENS, D, generator=g),
            torch.randn(HKV, TOKENS, D, generator=g))


def _epoch_starts(step):
    """The lengths at which a Mid epoch started, feeding the prompt then one token per `step` call."""
    q, k, v = _data()
    starts, mid = [], None
    with kvtopo.session(CONFIG) as s:
        s.attend_sequence("l", 0, q[:, :PROMPT], k[:, :PROMPT], v[:, :PROMPT], D**-0.5)
        for t in range(PROMPT, TOKENS + 1):
            entry = s.layers["l"].sequences[0]
            if entry.mid is not mid:
                mid = entry.mid
                starts.append(entry.length)
            if t < TOKENS:
                step(s, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
    return starts


def _one_call(s, q, k, v):  # the session's decode path: the token written in place where it may be
    s.attend_sequence("l", 0, q, k, v, D**-0.5)


def test_decode_tokens_start_each_epoch_at_the_refit_point():
    # The first epoch starts with the prompt (42 tokens reach Mid); the refit at 2 x 42 = 84, a token
    # at row 3 of page 10 (the next, at 168, is past TOKENS).
    assert _epoch_starts(_one_call) == [PROMPT, 2 * PROMPT]


@pytest.mark.parametrize("prompt", [38, 42, 45])
def test_a_refit_point_inside_a_page_is_honoured_by_the_in_place_write(prompt):
    """Against the lifecycle itself: a LayerCache fed each token by `append` (the reference) and
    one fed by `write_in_place` first (`append` for the rest) start their epochs at the same lengths,
    and the refit points fall inside pages (2 x prompt is not a multiple of the page size)."""
    q, k, v = _data(prompt)
    caches = []
    for in_place in (False, True):
        cache = LayerCache(CONFIG, make_policy(CONFIG))
        cache.scale = D**-0.5
        cache.append(0, k[:, :prompt], v[:, :prompt])
        starts, mid = [], cache.sequences[0].mid
        for t in range(prompt, TOKENS):
            kt, vt = k[None, :, t:t + 1], v[None, :, t:t + 1]
            rest = cache.write_in_place([0], kt, vt) if in_place else [0]
            for i in rest:
                cache.append(0, kt[i], vt[i])
            entry = cache.sequences[0]
            if entry.mid is not mid:
                mid = entry.mid
                starts.append(entry.length)
        caches.append((cache, starts))
    (reference, expected), (fast, got) = caches
    assert expected and expected[0] == 2 * prompt and (2 * prompt) % CONFIG.page_size
    assert got == expected
    for a, b in zip(reference.sequences[0].mid.attention_inputs(), fast.sequences[0].mid.attention_inputs()):
        for x, y in ((a.coefficients, b.coefficients), (a.vectors, b.vectors), (a.mean, b.mean)):
            assert torch.equal(x, y)
