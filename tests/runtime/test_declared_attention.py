"""What a model's config declares and a graph cannot show: a module that is not causal, called one
token at a time, and RoPE that HF rescales from a call's length (LongRoPE's switch of factors,
dynamic NTK), which a stored history cannot cross."""

import copy

import pytest
import torch
import transformers

import kvtopo
from kvtopo.models import zoo


def _compiled(model, how: str):
    """`model` compiled by `kvtopo.compile`, by `Module.compile(backend="kvtopo")` (in place) or by
    `torch.compile(model, backend="kvtopo")` (a wrapper); the backend alone registers what the
    config declares in the last two."""
    options = {"inductor": False}
    if how == "kvtopo.compile":
        return kvtopo.compile(model, inductor=False)
    if how == "Module.compile":
        model.compile(backend="kvtopo", options=options)
        return model
    return torch.compile(model, backend="kvtopo", options=options)


COMPILES = ["kvtopo.compile", "Module.compile", "torch.compile"]


@pytest.mark.parametrize("how", COMPILES)
def test_a_bidirectional_encoder_called_one_token_at_a_time_raises(how):
    """A one-token graph has no later token to hide, so neither the passes nor the chunk check can
    tell BERT from a decoder; its modules say `is_causal = False`, and the session refuses."""
    config = transformers.BertConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = _compiled(transformers.BertModel(config, add_pooling_layer=False).eval(), how)
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


LIMIT = 32
CHUNKED, ONE_CHUNK = (kvtopo.Config.lossless(page_size=8, prefill_chunk_size=size) for size in (16, 64))


def _dynamic_ntk(spelling):
    """Llama with dynamic NTK RoPE: HF scales its frequencies for max(position_ids) + 1 once that
    passes max_position_embeddings, so a one-forward prefill of 40 tokens rotates every key for 40."""
    rope = ({"rope_parameters": dict(rope_type="dynamic", factor=4.0, rope_theta=100.0)} if spelling == "rope_parameters"
            else {"rope_scaling": dict(type="dynamic", factor=4.0), "rope_theta": 100.0})
    config = transformers.LlamaConfig(**rope, max_position_embeddings=LIMIT, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128, vocab_size=256,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_dynamic_ntk_chunked_prefill_past_the_limit_raises():
    """A 36-token prompt (past LIMIT) prefilled in one chunk and a 30-token prompt decoded past it
    give HF generate's tokens: decode steps scale their one token as HF's cached decode does. The
    36-token prompt in chunks of 16 raises: its last chunk would rotate for 36 while the 32 stored
    keys were not rescaled (before, tokens other than HF's, silently). HF's rotary embedding keeps
    the length it last scaled for until a call stays below the limit, as each case here starts."""
    model = _dynamic_ntk("rope_parameters")
    reference, long, short = copy.deepcopy(model), _prompt(36, 7), _prompt(30, 8)
    kvtopo.compile(model, inductor=False)
    for ids, config, new in [(long, ONE_CHUNK, 3), (short, CHUNKED, 4)]:
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=new, do_sample=False)
        assert torch.equal(kvtopo.generate(model, ids, new, config=config), expected)
    with pytest.raises(ValueError, match=r"dynamic NTK RoPE .* passes 32 tokens .* chunk of 4 tokens takes the 32 "
                                         r"stored tokens.* prefill the whole prompt in one chunk"):
        kvtopo.generate(model, long, 3, config=CHUNKED)


def _gemma3(full_attention_rope):
    """Gemma3 with its RoPE set per layer type: the sliding layer's default, the full-attention
    layer's `full_attention_rope`."""
    rope = {"sliding_attention": dict(rope_type="default", rope_theta=10.0), "full_attention": full_attention_rope}
    config = transformers.Gemma3TextConfig(
        rope_parameters=rope, layer_types=["sliding_attention", "full_attention"], sliding_window=64,
        max_position_embeddings=LIMIT if full_attention_rope["rope_type"] == "dynamic" else 256, head_dim=16,
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128,
        vocab_size=256, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).eval()


def test_longrope_set_per_layer_type_is_declared_for_its_layers():
    """Gemma3-style `rope_parameters` nested by layer type: before, only a top-level rope_type was
    read, nothing was declared, and a chunk crossing the switch was silently wrong. The switch is
    declared for the full-attention layer alone; exact on either side of it."""
    from kvtopo.runtime import declared_attention

    longrope = dict(rope_type="longrope", rope_theta=1000.0, original_max_position_embeddings=LIMIT,
                    short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.5 * i for i in range(8)])
    model = _gemma3(longrope)
    short, long = _prompt(20, 9), _prompt(40, 10)  # 20 + 8 stays short; 40 is long from its one-chunk prefill on
    with torch.no_grad():
        expected = [copy.deepcopy(model).generate(ids, max_new_tokens=8, do_sample=False) for ids in (short, long)]
    kvtopo.compile(model, inductor=False)
    for ids, want in zip((short, long), expected):
        assert torch.equal(kvtopo.generate(model, ids, 8, config=ONE_CHUNK), want)
    with pytest.raises(ValueError, match=f"attention site .*layers.1.self_attn.*LongRoPE switches to its long factor "
                                         f"after {LIMIT} tokens"):
        kvtopo.generate(model, long, 8, config=CHUNKED)
    key = next(model.parameters())
    assert declared_attention.declared(key, "model.layers.0.self_attn").rescaled is None  # the sliding layer's
    assert declared_attention.declared(key, "model.layers.1.self_attn").rescaled == ("longrope", LIMIT)


def test_dynamic_ntk_is_declared_for_its_layers_in_either_spelling():
    """The older `rope_scaling={"type": "dynamic"}`, and dynamic NTK set per layer type."""
    from kvtopo.runtime import declared_attention

    found = []
    for model in (_dynamic_ntk("rope_scaling"), _gemma3(dict(rope_type="dynamic", factor=4.0, rope_theta=100.0))):
        declared_attention.declare(model)
        found.append([declared_attention.declared(next(model.parameters()), f"model.layers.{i}.self_attn").rescaled
                      for i in range(2)])
    assert found == [[("dynamic", LIMIT)] * 2, [None, ("dynamic", LIMIT)]]  # Gemma3's sliding layer: default rope


@pytest.mark.parametrize("how", COMPILES)
def test_a_hybrid_model_is_not_continued_in_a_session(how):
    """LFM2's short convolutions carry the last tokens into the next call through HF's cache; a
    session stores only attention, so a second call would start them from zeros."""
    model = _compiled(zoo.lfm2_hybrid(), how)
    ids = _prompt(24, 3)
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        whole = model(input_ids=ids).logits  # one forward of the whole sequence is exact
        torch.testing.assert_close(whole, expected, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match=r"hybrid model whose state outside attention \(.*Lfm2ShortConv"):
            model(input_ids=ids[:, :4])


def test_a_session_cache_for_a_hybrid_model_is_refused():
    """HF's hybrid layers read their state from the cache generate passes (before, a SessionCache
    failed deep in HF with an IndexError)."""
    model = kvtopo.compile(zoo.lfm2_hybrid(), inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as session:
        with pytest.raises(ValueError, match=r"Lfm2ForCausalLM keeps state outside attention \(.*Lfm2ShortConv"):
            kvtopo.hf_cache.generate(model, _prompt(20, 4), max_new_tokens=4, do_sample=False)
        with pytest.raises(ValueError, match="keeps state outside attention"):
            kvtopo.hf_cache.SessionCache(session, model=model)


def test_generate_runs_a_hybrid_model_on_its_own_cache():
    model = zoo.lfm2_hybrid()
    ids = _prompt(20, 4)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with pytest.warns(UserWarning, match="keeps state outside attention"):
        assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=6), expected)


@pytest.mark.parametrize("chunk", [None, 7])
def test_generate_runs_a_mamba_model_on_its_own_cache_with_the_inputs_hf_gives_it(chunk):
    """HF's Mamba takes no attention mask after the prompt (its `prepare_inputs_for_generation`
    drops it); given the whole mask at each step it mixed a step's token with the mask's length
    of copies, wrong from the second step on, silently."""
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2,
                                      initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).eval()
    ids = torch.randint(3, 64, (1, 15), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hf = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    kvtopo.compile(model, inductor=False)
    with pytest.warns(UserWarning, match=r"keeps state outside attention \(MambaMixer"):
        out, logits = kvtopo.generate(model, ids, 6, return_logits=True, prefill_chunk_size=chunk)
    assert torch.equal(out, hf.sequences)
    torch.testing.assert_close(logits, torch.stack(hf.scores, 1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3-moe", "deepseek-v3", "gpt2", "gemma3", "gpt-oss"])
def test_attention_only_models_are_not_taken_for_hybrids(name):
    from kvtopo.models import zoo
    from kvtopo.runtime.declared_attention import state_outside_attention

    assert state_outside_attention(zoo.build(name, zoo.attn_implementations(name)[-1])) is None


def test_llama4_temperature_tuning_cannot_be_continued_past_floor_scale():
    """Llama-4's NoPE layers scale queries by `log1p(floor((pos + 1) / floor_scale))`, positions
    counted from the cache's length (0 without one, even when position_ids are passed): exact
    below floor_scale, raised on once a stored sequence reaches it."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, num_local_experts=1, no_rope_layers=[0, 0],
        layer_types=["full_attention", "full_attention"], attn_temperature_tuning=True, floor_scale=16, attn_scale=2.0,
        pad_token_id=0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    ids = _prompt(12, 5)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=3, do_sample=False)  # 14 positions: all below 15
    kvtopo.compile(model, inductor=False)
    assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=3), expected)
    with pytest.raises(ValueError, match="attn_temperature_tuning"):
        kvtopo.generate(model, ids, max_new_tokens=6)


@pytest.mark.parametrize("how", ["kvtopo.compile", "Module.compile"])
def test_a_model_without_state_or_attention_forward_raises_in_a_session(how):
    """Mamba: nothing kvtopo rewrites, so a forward in a session would drop the history without a
    word; kvtopo.compile's forward raises (a model compiled in place by the backend alone: from its
    second forward, the first having compiled it), and kvtopo.generate runs it on its own cache
    (passed back as `cache=`, the keyword its forward takes)."""
    config = transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=256, state_size=8,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(config).eval()
    ids = _prompt(6, 6)  # short: Dynamo unrolls the scan over the tokens (HF's path without CUDA kernels)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=2, do_sample=False)
    _compiled(model, how)
    with torch.no_grad():
        model(input_ids=ids[:, :3])
        with kvtopo.session(kvtopo.Config.lossless()), pytest.raises(RuntimeError, match="ran no kvtopo attention"):
            model(input_ids=ids)
    with pytest.warns(UserWarning, match="keeps state outside attention"):
        assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=2), expected)


@pytest.mark.parametrize("frame,prompt", [("attention", 8), ("decoder layer", 20)])
def test_a_window_declared_for_a_module_compiled_in_a_graph_of_its_own_is_applied(frame, prompt, monkeypatch):
    """After a graph break inside a decoder layer (DBRX's experts, a hybrid's mixer) Dynamo compiles
    the layer's forward, or the attention module's, as a graph of its own, whose site is named
    relative to it (`self_attn`, or its node name) and which one compiled graph serves for every
    layer. Mistral's declared window is still found, through the graph's first parameter, and
    applied: to decode steps HF gives no mask (before, with the attention's own frame, they attended
    the whole history silently), and to a longer prompt's mask, passed into the layer's graph."""
    from transformers.models.mistral import modeling_mistral

    module = {"attention": modeling_mistral.MistralAttention, "decoder layer": modeling_mistral.MistralDecoderLayer}[frame]
    forward = module.forward

    def breaking_forward(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(module, "forward", breaking_forward)
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        sliding_window=8, max_position_embeddings=256)
    model = transformers.MistralForCausalLM(config).eval()
    ids = torch.randint(3, 250, (1, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=10, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as session:
        out = kvtopo.generate(model, ids, max_new_tokens=10)
        names = [name.split("/")[1] for name in session.layers]
    assert names == (["attn_output"] * 2 if frame == "attention" else ["self_attn"] * 2)  # relative names
    assert torch.equal(out, expected)


@pytest.mark.parametrize("rope_type,stored,chunk,raises", [
    ("dynamic", 28, 5, True),  # ends one past the limit: rotated for 33, the stored keys for 28
    ("dynamic", 28, 4, False),  # ends at the limit: nothing is rescaled yet
    ("dynamic", 40, 1, False),  # a decode step past it scales its one token as HF's cached decode does
    ("longrope", 28, 5, True),  # the short-factor keys taken one past the switch
    ("longrope", 28, 4, False),  # up to the switch: short factor throughout
    ("longrope", 32, 1, True),  # the first token past the switch, after exactly `after` stored
    ("longrope", 33, 2, False)])  # stored past the switch: already rotated with the long factor
def test_rescaled_rope_is_refused_from_the_first_token_past_its_limit(rope_type, stored, chunk, raises):
    from kvtopo.runtime.declared_attention import Rescaled, check_rescaled

    def check():
        check_rescaled("model.layers.0.self_attn", Rescaled(rope_type, LIMIT), stored, chunk)

    if raises:
        with pytest.raises(ValueError, match=f"after {LIMIT} tokens|passes {LIMIT} tokens"):
            check()
    else:
        check()


class _ConvThenAttention(torch.nn.Module):
    """A causal depthwise convolution over the last 3 tokens (the short convolution of LFM2 or
    Mamba, in a plain module), then causal attention: the convolution carries tokens into the next
    call, which a session does not store."""

    def __init__(self):
        super().__init__()
        from kvtopo.models.blocks import SDPACausal

        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.conv = torch.nn.Conv1d(32, 32, 3, groups=32, padding=2)
        self.attn = SDPACausal()
        self.head = torch.nn.Linear(32, 64)

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.conv(self.embed(input_ids).transpose(1, 2))[..., :input_ids.shape[1]].transpose(1, 2)
        return (self.head(self.attn(x)),)


def test_a_depthwise_convolution_over_tokens_is_state_outside_attention():
    """kvtopo.generate runs such a model without the session (recomputing the whole sequence, a
    module without an HF cache), giving the uncompiled model's greedy tokens."""
    from kvtopo.runtime.declared_attention import state_outside_attention

    model = _ConvThenAttention().eval()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = ids
    with torch.no_grad():
        for _ in range(5):
            expected = torch.cat([expected, model(expected)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert state_outside_attention(model) == "depthwise Conv1d over tokens"
    kvtopo.compile(model, inductor=False)
    with pytest.warns(UserWarning, match=r"keeps state outside attention \(depthwise Conv1d over tokens\)"):
        assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=5), expected)


def test_a_plain_module_with_state_outside_attention_is_not_continued_in_a_session():
    """Called chunk by chunk in a session, such a module's convolution would restart at every call
    while its attention continued: the second call raises, naming the state. Before, only HF
    attention modules (a `config` and a `layer_idx`) carried the state, and a plain module's
    second chunk ran on, silently wrong; one call of the whole sequence stays exact."""
    model = _ConvThenAttention().eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)[0]
        kvtopo.compile(model, inductor=False)
        with kvtopo.session(kvtopo.Config.lossless()):
            torch.testing.assert_close(model(ids)[0], expected, atol=1e-5, rtol=0)
        with kvtopo.session(kvtopo.Config.lossless()):
            model(ids[:, :6])
            with pytest.raises(ValueError, match=r"state outside attention \(depthwise Conv1d over tokens\)"):
                model(ids[:, 6:])


class _WindowedAttention(torch.nn.Module):
    """An HF-like attention module (`config`, `layer_idx`) whose config declares a window."""

    def __init__(self, window, index):
        super().__init__()
        declared = {"sliding_window": window, "layer_types": ["sliding_attention"] * (index + 1)}
        self.config, self.layer_idx = type("Config", (), declared)(), index
        self.proj = torch.nn.Linear(4, 4)


def test_a_name_relative_to_a_submodule_that_two_layers_match_declares_nothing():
    """A graph compiled from a submodule's frame names its site relative to it; when the graph's
    first parameter lies under two attention modules ending in that name, neither is meant more
    than the other: no window is applied rather than the wrong layer's."""
    from kvtopo.runtime import declared_attention

    inner = torch.nn.ModuleDict({"attn": _WindowedAttention(8, 1), "mlp": torch.nn.Linear(4, 4)})
    model = torch.nn.ModuleDict({"block": torch.nn.ModuleDict({"attn": _WindowedAttention(4, 0), "sub": inner})})
    declared_attention.declare(model)
    in_sub, in_attn = model.block.sub.mlp.weight, model.block.attn.proj.weight

    def window(key, name):
        return getattr(declared_attention.declared(key, name), "window", None)

    assert window(in_sub, "attn") is None  # block.attn and block.sub.attn both hold block.sub.mlp
    assert window(in_sub, "sub.attn") == 8
    assert window(in_attn, "attn") == 4


WINDOW = 6


def _moshi_text_decoder(**config_overrides):
    """Moshi's text decoder: its config declares `sliding_window` (no `layer_types`), and its mask
    never applies it (HF's `create_causal_mask`): every token sees the whole history."""
    config = transformers.MoshiConfig(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, head_dim=16, ffn_dim=128, sliding_window=WINDOW,
                                      max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2, **config_overrides)
    torch.manual_seed(0)
    return transformers.MoshiForCausalLM(config).eval()


def test_a_config_window_the_model_never_applies_is_refused_past_it_not_applied():
    """Taken as every layer's window, Moshi's declared window made chunks no longer than it attend
    within it: wrong, no error. A config window without `layer_types` now counts only where the
    model's code builds HF's sliding-window masks (Mistral's does); elsewhere a session goes up to
    the window, where either reading gives the same tokens, and refuses to continue past it."""
    model = _moshi_text_decoder()
    ids = torch.randint(3, 150, (1, 2 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as session:
        got = torch.cat([model(ids[:, :4]).logits, model(ids[:, 4:WINDOW]).logits], 1)
        torch.testing.assert_close(got, expected[:, :WINDOW], rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match=f"sliding_window={WINDOW} without layer_types.*config.layer_types"):
            model(ids[:, WINDOW:WINDOW + 1])
        assert set(session.stats().tokens) == {WINDOW}  # the refused step stored nothing


@pytest.mark.parametrize("layer_types", [None, ["full_attention"] * 2])
def test_layer_types_set_on_such_a_config_say_what_the_model_does(layer_types):
    """kvtopo.generate past the window: refused as it stands (before, the declared window cut the
    history, other tokens than HF's generate, no error); with the way out the refusal names,
    `layer_types` of full attention, it equals HF's generate."""
    model = _moshi_text_decoder(layer_types=layer_types)
    ids = torch.randint(3, 150, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=3 * WINDOW, do_sample=False, eos_token_id=None)
        kvtopo.compile(model, inductor=False)
        if layer_types is None:
            with pytest.raises(ValueError, match="without layer_types"):
                kvtopo.generate(model, ids, 3 * WINDOW, config=kvtopo.Config.lossless(), eos_token_id=None)
            return
        got = kvtopo.generate(model, ids, 3 * WINDOW, config=kvtopo.Config.lossless(), eos_token_id=None)
    assert torch.equal(got, expected)
