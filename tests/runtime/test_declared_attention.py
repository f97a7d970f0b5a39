"""What a model's config declares and a graph cannot show: a module that is not causal, called one
token at a time, and LongRoPE's switch of factors, which a stored history cannot cross."""

import pytest
import torch
import transformers

import kvtopo


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_bidirectional_encoder_called_one_token_at_a_time_raises():
    """A one-token graph has no later token to hide, so neither the passes nor the chunk check can
    tell BERT from a decoder; its modules say `is_causal = False`, and the session refuses."""
    config = transformers.BertConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = kvtopo.compile(transformers.BertModel(config, add_pooling_layer=False).eval(), inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match="not causal"):
            model(input_ids=torch.tensor([[5]]))
        assert s.stats().tokens == ()


SWITCH = 32


def _longrope_phi3():
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8,
                original_max_position_embeddings=SWITCH)
    config = transformers.Phi3Config(
        rope_parameters=rope, max_position_embeddings=256, original_max_position_embeddings=SWITCH, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=256,
        pad_token_id=0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config).eval()


def _prompt(length, seed):
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def test_longrope_generation_across_the_switch_raises():
    """Prompt of 28 tokens, 10 new: position 32 would be rotated with the long factor while the
    stored keys keep the short one (HF's generate re-prefills there)."""
    model = kvtopo.compile(_longrope_phi3(), inductor=False)
    with pytest.raises(ValueError, match=f"LongRoPE switches to its long factor after {SWITCH} tokens"):
        kvtopo.generate(model, _prompt(28, 0), max_new_tokens=10)


def test_longrope_within_one_side_of_the_switch_is_exact():
    model = _longrope_phi3()
    short, long = _prompt(20, 1), _prompt(40, 2)  # 20 + 8 stays short; 40 is long from its prefill on
    with torch.no_grad():
        expected = [model.generate(ids, max_new_tokens=8, do_sample=False) for ids in (short, long)]
    kvtopo.compile(model, inductor=False)
    for ids, want in zip((short, long), expected):
        assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=8), want)
