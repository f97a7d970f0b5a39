"""Tiny, deterministic, random-init models of real architectures.

Each builder returns a `transformers` model in eval mode, float32, seeded, with well under 2M
parameters, so pass and runtime tests run on real model graphs without downloading weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def _common(vocab_size: int = 256) -> dict:
    return dict(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _llama_config(**overrides) -> transformers.LlamaConfig:
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rope_theta=10000.0, **_common())
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)


def _qwen2_config(**overrides) -> transformers.Qwen2Config:
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=1, rope_theta=10000.0, **_common())
    cfg.update(overrides)
    return transformers.Qwen2Config(**cfg)


def _qwen3_config(**overrides) -> transformers.Qwen3Config:
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rope_theta=10000.0, **_common())
    cfg.update(overrides)
    return transformers.Qwen3Config(**cfg)


def _qwen3_moe_config(**overrides) -> transformers.Qwen3MoeConfig:
    cfg = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
               num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
               rope_theta=10000.0, **_common())
    cfg.update(overrides)
    return transformers.Qwen3MoeConfig(**cfg)


def _deepseek_v3_config(**overrides) -> transformers.DeepseekV3Config:
    cfg = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
               q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
               v_head_dim=12, rope_theta=10000.0, rope_interleave=True, **_common())
    cfg.update(overrides)
    return transformers.DeepseekV3Config(**cfg)


def _gpt2_config(**overrides) -> transformers.GPT2Config:
    cfg = dict(vocab_size=256, n_positions=4096, n_embd=64, n_layer=2, n_head=4,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               bos_token_id=None, eos_token_id=None)
    cfg.update(overrides)
    return transformers.GPT2Config(**cfg)


_BUILDERS: dict[str, tuple[Callable[..., transformers.PretrainedConfig], type]] = {
    "llama": (_llama_config, transformers.LlamaForCausalLM),
    "llama-8layer": (lambda **o: _llama_config(num_hidden_layers=8, **o), transformers.LlamaForCausalLM),
    "qwen2": (_qwen2_config, transformers.Qwen2ForCausalLM),
    "qwen3": (_qwen3_config, transformers.Qwen3ForCausalLM),
    "qwen3-moe": (_qwen3_moe_config, transformers.Qwen3MoeForCausalLM),
    "deepseek-v3": (_deepseek_v3_config, transformers.DeepseekV3ForCausalLM),
    "deepseek-v3-wide": (
        lambda **o: _deepseek_v3_config(num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=48,
                                        qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=16, **o),
        transformers.DeepseekV3ForCausalLM,
    ),
    "gpt2": (_gpt2_config, transformers.GPT2LMHeadModel),
}

ZOO_MODELS = tuple(_BUILDERS)


# --- Sliding-window / softcapped architectures -------------------------------------------------
#
# Windows are small (16 tokens) so that prompts of a few windows stay fast. In transformers a layer
# with window W lets query position q attend to key positions k with q - W < k <= q (W tokens,
# the query's own included). These models are kept out of ZOO_MODELS (what the CLI, export and the
# tests of every zoo model take), since export does not carry windows or softcaps; sessions do
# (tests/models/test_zoo_windowed.py).

_WINDOW = 16


def _gemma2_config(**overrides) -> transformers.Gemma2Config:
    # 4 layers: sliding, global, sliding, global (Gemma-2's default alternation). The query scale is
    # query_pre_attn_scalar**-0.5 = 32**-0.5, deliberately not head_dim**-0.5.
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=32, sliding_window=_WINDOW,
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
               **_common())
    cfg.update(overrides)
    return transformers.Gemma2Config(**cfg)


def _gemma3_config(**overrides) -> transformers.Gemma3TextConfig:
    # 6 layers with Gemma-3's 5:1 pattern (5 sliding, then 1 global); local RoPE base 1e4, global 1e6;
    # q/k RMS norms; no softcapping (as in the released Gemma-3 models).
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=_WINDOW,
               sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
               **_common())
    cfg.update(overrides)
    return transformers.Gemma3TextConfig(**cfg)


def _mistral_config(**overrides) -> transformers.MistralConfig:
    # Mistral has no layer_types: every layer uses config.sliding_window.
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, sliding_window=_WINDOW, rope_theta=10000.0, **_common())
    cfg.update(overrides)
    return transformers.MistralConfig(**cfg)


def _qwen2_sw_config(**overrides) -> transformers.Qwen2Config:
    # transformers 5.x: with use_sliding_window, layers i >= max_window_layers slide -> 0, 1 full; 2, 3 sliding.
    return _qwen2_config(**{**dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=_WINDOW,
                                   max_window_layers=2), **overrides})


def _gpt_oss_config(**overrides) -> transformers.GptOssConfig:
    # 4 layers alternating sliding/full, 4 experts (2 per token), per-head attention sinks, YaRN RoPE
    # (the config's default parameters).
    common = _common()
    common.pop("rms_norm_eps")
    cfg = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=_WINDOW, rms_norm_eps=1e-5, **common)
    cfg.update(overrides)
    return transformers.GptOssConfig(**cfg)


def _cohere2_config(**overrides) -> transformers.Cohere2Config:
    # 4 layers with pattern 4: 3 sliding (with RoPE) + 1 global (no positional encoding, as in Cohere2).
    common = _common()
    common.pop("rms_norm_eps")
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, sliding_window=_WINDOW, sliding_window_pattern=4,
               layer_norm_eps=1e-5, rope_theta=10000.0, **common)
    cfg.update(overrides)
    return transformers.Cohere2Config(**cfg)


_WINDOWED_BUILDERS: dict[str, tuple[Callable[..., transformers.PretrainedConfig], type]] = {
    "gemma2": (_gemma2_config, transformers.Gemma2ForCausalLM),
    "gemma3": (_gemma3_config, transformers.Gemma3ForCausalLM),
    "mistral-sw": (_mistral_config, transformers.MistralForCausalLM),
    "qwen2-sw": (_qwen2_sw_config, transformers.Qwen2ForCausalLM),
    "gpt-oss": (_gpt_oss_config, transformers.GptOssForCausalLM),
    "cohere2": (_cohere2_config, transformers.Cohere2ForCausalLM),
}

WINDOWED_MODELS = tuple(_WINDOWED_BUILDERS)

# transformers has no sdpa path for these: Gemma-2 (sdpa cannot softcap the scores) and gpt-oss
# (attention sinks); both refuse attn_implementation="sdpa" at construction.
_EAGER_ONLY = frozenset({"gemma2", "gpt-oss"})


def attn_implementations(name: str) -> tuple[str, ...]:
    """The attn_implementation values `build(name, ...)` accepts."""
    if name not in _BUILDERS and name not in _WINDOWED_BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(ZOO_MODELS + WINDOWED_MODELS)}")
    return ("eager",) if name in _EAGER_ONLY else ATTN_IMPLEMENTATIONS


def build(name: str, attn_implementation: str = "sdpa", seed: int = 0, **config_overrides) -> torch.nn.Module:
    """Build zoo model `name` with deterministic random weights (eval mode, float32)."""
    supported = attn_implementations(name)
    if attn_implementation not in supported:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not supported for {name!r}; choose one of {supported}"
        )
    make_config, model_cls = _BUILDERS[name] if name in _BUILDERS else _WINDOWED_BUILDERS[name]
    config = make_config(**config_overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    # Random init gives near-uniform attention; wider weights make the tests sensitive to real errors.
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name_ and "wte" not in name_ and "wpe" not in name_:
                p.mul_(2.0)
    return model.eval()


def num_attention_layers(model: torch.nn.Module) -> int:
    config = model.config
    return getattr(config, "num_hidden_layers", None) or config.n_layer


def sliding_window_layers(model: torch.nn.Module) -> dict[int, int | None]:
    """Per layer index, the sliding window its attention uses (None for global layers).

    Read from the config as transformers 5.x does: `layer_types` ("sliding_attention" layers get
    `config.sliding_window`); a config without `layer_types` (e.g. Mistral) applies
    `config.sliding_window` to every layer. A window W means query q sees keys q - W < k <= q.
    """
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    n_layers = num_attention_layers(model)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return {i: window for i in range(n_layers)}
    if len(layer_types) != n_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {n_layers} layers")
    windows: dict[int, int | None] = {}
    for i, layer_type in enumerate(layer_types):
        if layer_type == "sliding_attention":
            windows[i] = window
        elif layer_type == "full_attention":
            windows[i] = None
        else:
            raise ValueError(f"layer {i}: layer type {layer_type!r} is neither sliding nor full attention")
    return windows


def lfm2_hybrid() -> torch.nn.Module:
    """A tiny LFM2: a short-convolution layer, then an attention layer. A hybrid, whose state outside
    attention HF's cache carries and a kvtopo session (or an exported decode step) does not: what
    the tests of that refusal build."""
    config = transformers.Lfm2Config(layer_types=["conv", "full_attention"], hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128, vocab_size=256,
                                     pad_token_id=0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Lfm2ForCausalLM(config).eval()
