"""The zoo's sliding-window / softcapped models: their HF behaviour, and `sliding_window_layers`.

These check the uncompiled `transformers` models only (that HF's own cache handles the window, and
that the window changes the output), so a compiler that drops or misreads a window is caught by
comparing against them.
"""

from __future__ import annotations

import pytest
import torch

from kvtopo.models import zoo

WINDOW = 16
PROMPT = 64  # four windows

# What each model is meant to be: per layer, its window (None: global attention).
EXPECTED_WINDOWS = {
    "gemma2": {0: WINDOW, 1: None, 2: WINDOW, 3: None},
    "gemma3": {0: WINDOW, 1: WINDOW, 2: WINDOW, 3: WINDOW, 4: WINDOW, 5: None},
    "mistral-sw": {0: WINDOW, 1: WINDOW},
    "qwen2-sw": {0: None, 1: None, 2: WINDOW, 3: WINDOW},
    "gpt-oss": {0: WINDOW, 1: None, 2: WINDOW, 3: None},
    "cohere2": {0: WINDOW, 1: WINDOW, 2: WINDOW, 3: None},
}

CASES = [(name, impl) for name in zoo.WINDOWED_MODELS for impl in zoo.attn_implementations(name)]


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits[0, -1]


def test_windowed_models_are_listed_apart_from_the_zoo():
    assert set(zoo.WINDOWED_MODELS) == set(EXPECTED_WINDOWS)
    assert not set(zoo.WINDOWED_MODELS) & set(zoo.ZOO_MODELS)


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_eager_only_models_refuse_sdpa(name):
    assert zoo.attn_implementations(name) == ("eager",)
    with pytest.raises(ValueError, match="not supported"):
        zoo.build(name, attn_implementation="sdpa")


def test_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown zoo model"):
        zoo.build("no-such-model")


@pytest.mark.parametrize("name", zoo.WINDOWED_MODELS)
def test_tiny_deterministic_float32(name):
    impl = zoo.attn_implementations(name)[0]
    a, b = zoo.build(name, attn_implementation=impl), zoo.build(name, attn_implementation=impl)
    params = dict(a.named_parameters())
    assert sum(p.numel() for p in params.values()) < 2_000_000
    assert all(p.dtype == torch.float32 for p in params.values())
    assert not a.training
    assert a.config.vocab_size == 256
    assert a.config._attn_implementation == impl
    for key, p in b.named_parameters():
        assert torch.equal(p, params[key]), key


def test_architecture_specific_settings():
    g2 = zoo.build("gemma2", attn_implementation="eager").config
    assert g2.attn_logit_softcapping == 50.0 and g2.final_logit_softcapping == 30.0
    assert g2.query_pre_attn_scalar != g2.head_dim  # the score scale is not head_dim ** -0.5
    g3 = zoo.build("gemma3").config
    assert g3.rope_parameters["sliding_attention"]["rope_theta"] != g3.rope_parameters["full_attention"]["rope_theta"]
    q2 = zoo.build("qwen2-sw").config
    assert q2.use_sliding_window and q2.max_window_layers == 2
    oss = zoo.build("gpt-oss", attn_implementation="eager")
    assert oss.config.num_local_experts == 4
    assert all(layer.self_attn.sinks.abs().sum() > 0 for layer in oss.model.layers)


@pytest.mark.parametrize("name", zoo.WINDOWED_MODELS)
def test_sliding_window_layers_matches_config(name):
    model = zoo.build(name, attn_implementation=zoo.attn_implementations(name)[0])
    windows = zoo.sliding_window_layers(model)
    assert windows == EXPECTED_WINDOWS[name]
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    assert windows == {i: config.sliding_window if t == "sliding_attention" else None
                       for i, t in enumerate(layer_types)}
    for i, layer in enumerate(model.model.layers):  # the window each HF attention module applies
        if hasattr(layer.self_attn, "sliding_window"):
            assert layer.self_attn.sliding_window == windows[i], i


@pytest.mark.parametrize("name", zoo.WINDOWED_MODELS)
def test_sliding_window_layers_matches_attention_probabilities(name):
    """Eager probabilities are exactly zero for keys at or beyond the window, positive inside it."""
    model = zoo.build(name, attn_implementation="eager")
    n = 3 * WINDOW
    with torch.no_grad():
        attentions = model(_ids(n), use_cache=False, output_attentions=True).attentions
    windows = zoo.sliding_window_layers(model)
    assert len(attentions) == len(windows)
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    for i, probs in enumerate(attentions):
        w = windows[i] if windows[i] is not None else n + 1
        visible = (k <= q) & (q - k < w)
        assert probs.shape == (1, model.config.num_attention_heads, n, n)
        assert torch.all(probs[..., ~visible] == 0), i
        assert torch.all(probs[..., visible] > 0), i


def test_sliding_window_layers_of_global_models():
    assert zoo.sliding_window_layers(zoo.build("llama")) == {0: None, 1: None}
    assert zoo.sliding_window_layers(zoo.build("qwen2")) == {0: None, 1: None}  # use_sliding_window=False
    assert zoo.sliding_window_layers(zoo.build("gpt2")) == {0: None, 1: None}


@pytest.mark.parametrize("name,impl", CASES)
def test_generate_matches_full_recomputation(name, impl):
    """HF's cached greedy decoding past several windows equals recomputing the whole sequence."""
    model = zoo.build(name, attn_implementation=impl)
    ids = _ids(PROMPT)
    new = 40
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
        seq = out.sequences
        assert seq.shape == (1, PROMPT + new)
        assert torch.equal(seq[:, :PROMPT], ids)
        full = model(seq, use_cache=False).logits[0, PROMPT - 1:-1]
    cached = torch.stack(out.logits, dim=1)[0]
    torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)
    assert torch.equal(full.argmax(-1), seq[0, PROMPT:])


@pytest.mark.parametrize("name,impl", CASES)
def test_window_changes_the_output(name, impl):
    """A model whose window is widened (same weights) agrees within one window and differs past it."""
    model = zoo.build(name, attn_implementation=impl)
    widened = zoo.build(name, attn_implementation=impl, sliding_window=4096)
    assert set(zoo.sliding_window_layers(widened).values()) <= {4096, None}
    short, long = _ids(WINDOW), _ids(PROMPT)
    torch.testing.assert_close(_last_logits(model, short), _last_logits(widened, short), atol=1e-6, rtol=0)
    windowed, unwindowed = _last_logits(model, long), _last_logits(widened, long)
    assert (windowed - unwindowed).abs().max() > 0.05 * windowed.abs().max()


@pytest.mark.parametrize("name", [n for n in zoo.WINDOWED_MODELS if len(zoo.attn_implementations(n)) == 2])
def test_sdpa_and_eager_agree(name):
    ids = _ids(PROMPT)
    sdpa = _last_logits(zoo.build(name, attn_implementation="sdpa"), ids)
    eager = _last_logits(zoo.build(name, attn_implementation="eager"), ids)
    torch.testing.assert_close(sdpa, eager, atol=1e-4, rtol=1e-4)
