"""Continuous batching of full-attention models whose attention has a logit softcap (Gemma-2) or
per-head sinks (gpt-oss): the engine passes them to kvtopo's attention function (the softcap as a
keyword, the sinks on the module), and the tokens equal the uncompiled model's own generate.
(The zoo builds of both have sliding layers, which continuous batching refuses; here every layer
is full attention. The zoo Gemma-2's scores are small (its softcap of 50 changes its logits by
~1e-4): the queries and keys are scaled up and the softcap lowered, and gpt-oss's sinks set large,
so that dropping either changes the tokens.)"""

import pytest
import torch

from kvtopo.config import Config
from kvtopo.models import zoo
from kvtopo.serving.continuous_batching import generate_batch

from test_continuous_batching import GREEDY, _engine, _prompts, _reference


def _build(name):
    layers = zoo.build(name, "eager").config.num_hidden_layers
    overrides = dict(layer_types=["full_attention"] * layers)
    if name == "gemma2":
        overrides["attn_logit_softcapping"] = 2.0
    model = zoo.build(name, "eager", **overrides)
    if name == "gemma2":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(5.0)
                layer.self_attn.k_proj.weight.mul_(5.0)
    if name == "gpt-oss":
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                layer.self_attn.sinks.copy_(torch.linspace(1.0, 4.0, layer.self_attn.sinks.numel()) + i)
    return model


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_full_attention_softcap_and_sink_models_batch_as_hf_generates(name):
    model, reference = _build(name), _build(name)
    prompts = _prompts((24, 41, 9), seed=13)
    result = generate_batch(model, prompts, Config.lossless(page_size=16), max_new_tokens=8, generation_config=GREEDY,
                            continuous_batching_config=_engine(num_blocks=64, page_size=16))
    for prompt, out in zip(prompts, result.outputs.values()):
        assert list(out.generated_tokens) == _reference(reference, prompt, 8)
