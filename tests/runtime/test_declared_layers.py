"""What `declare` registers per layer from an HF config: a window for sliding layers only, blocks
for chunked layers only, temperature tuning for NoPE layers only. A window or block declared for
a layer that attends over the whole history would hide keys the model reads; one missing from a
layer that needs it would show keys the model hides."""

import torch
import transformers

from kvtopo.runtime import declared_attention


def _layers(model):
    """Layer index -> what was declared for `model.layers.{i}.self_attn` (None: nothing)."""
    declared_attention.declare(model)
    key = next(model.parameters())
    return [declared_attention.declared(key, f"model.layers.{i}.self_attn") for i in range(2)]


def test_a_window_is_declared_for_the_sliding_layers_only():
    config = transformers.Gemma3TextConfig(
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, head_dim=16, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128, vocab_size=256)
    sliding, full = _layers(transformers.Gemma3ForCausalLM(config).eval())
    assert sliding.window == 6 and full is None


def test_a_window_without_layer_types_is_declared_for_every_layer():
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, sliding_window=6)
    assert [d.window for d in _layers(transformers.MistralForCausalLM(config).eval())] == [6, 6]


def test_blocks_and_temperature_tuning_are_declared_for_their_own_layers():
    """Llama-4: layer 0 attends in blocks of 8 with RoPE, layer 1 (NoPE) over the whole sequence
    with its queries' temperature tuned from floor_scale on."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, attention_chunk_size=8, num_local_experts=1,
        no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=16)
    torch.manual_seed(0)
    chunked, nope = _layers(transformers.Llama4ForCausalLM(config).eval())
    assert (chunked.blocks, chunked.window, chunked.temperature_from) == (8, None, None)
    assert (nope.blocks, nope.window, nope.temperature_from) == (None, None, 16)


def test_layer_types_with_a_recurrent_state_are_state_outside_attention():
    """Read from the config alone, whatever the mixer modules are called (LFM2's `conv` layers,
    Qwen3-Next's `linear_attention` ones): HF's cache carries a state for them."""
    model = torch.nn.Linear(4, 4)
    model.config = transformers.PretrainedConfig(layer_types=["full_attention", "conv", "linear_attention"])
    assert declared_attention.state_outside_attention(model) == "conv layers, linear_attention layers"
