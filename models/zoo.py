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


def build(name: str, attn_implementation: str = "sdpa", seed: int = 0, **config_overrides) -> torch.nn.Module:
    """Build zoo model `name` with deterministic random weights (eval mode, float32)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(ZOO_MODELS)}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} is not supported; choose one of {ATTN_IMPLEMENTATIONS}"
        )
    make_config, model_cls = _BUILDERS[name]
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
