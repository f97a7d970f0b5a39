"""What an HF model's config says each attention layer sees, for calls whose graph cannot show it.

HF builds no attention mask (SDPA's `is_causal` instead) for a chunk without padding that is no
longer than the layer's sliding window or block: a short prompt, and every decode step through
`hf_cache.SessionCache`. Such a graph holds no window for the passes to read, and a session would
attend over the whole history. A one-token graph cannot show that a layer attends both ways
either. And a LongRoPE model (Phi-3) rotates with another factor once its positions pass
`original_max_position_embeddings`, which keys already stored at the short factor do not follow.
`kvtopo.compile`, `kvtopo.generate` and `hf_cache.generate` register the model here; the session
looks up the attention module it is called for (`Session.attend`): a declared sliding window is
applied (exactly what the model does), a block layer (Llama-4's `attention_chunk_size`) and a
bidirectional layer are refused when the graph shows no mask, and a chunk that carries a stored
history across LongRoPE's switch is refused.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch


class Declared(NamedTuple):
    window: int | None = None  # sliding window (tokens, the query's own included)
    blocks: int | None = None  # attends within blocks of this many tokens (attention_chunk_size)
    bidirectional: bool = False  # the module says it is not causal (`is_causal = False`)
    rescaled_after: int | None = None  # LongRoPE's original_max_position_embeddings


# id(parameter) of a registered model -> (the parameter, weakly; {attention module name: Declared}).
# Keyed by id: tensors compare by value, so they cannot be dictionary keys themselves.
_DECLARED: dict[int, tuple[weakref.ref, dict[str, Declared]]] = {}


def _longrope_switch(config) -> int | None:
    """`original_max_position_embeddings` of a LongRoPE config (v5 `rope_parameters`, or the older
    `rope_scaling`), else None."""
    for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "longrope":
            switch = rope.get("original_max_position_embeddings",
                              getattr(config, "original_max_position_embeddings", None))
            return switch if isinstance(switch, int) else None
    return None


def _declared_for(module: torch.nn.Module, config, index: int) -> Declared:
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    kind = layer_types[index] if layer_types and index < len(layer_types) else (
        "sliding_attention" if window else "full_attention")
    blocks = getattr(config, "attention_chunk_size", None)
    return Declared(
        window=window if kind == "sliding_attention" and isinstance(window, int) else None,
        blocks=blocks if kind == "chunked_attention" and isinstance(blocks, int) else None,
        bidirectional=getattr(module, "is_causal", True) is False,
        rescaled_after=_longrope_switch(config),
    )


def declare(model: torch.nn.Module) -> None:
    """Register what `model`'s config says of its attention modules (HF modules with a
    `layer_idx`): windows and blocks (`config.layer_types`, else `config.sliding_window` for every
    layer), modules that are not causal, LongRoPE's switch."""
    model = getattr(model, "_orig_mod", model)  # what torch.compile wraps: its names are the graph's
    declared = {}
    for name, module in model.named_modules():
        config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
        if config is None or not isinstance(index, int) or "Attention" not in type(module).__name__:
            continue
        if (found := _declared_for(module, config, index)) != Declared():
            declared[name] = found
    for parameter in model.parameters() if declared else ():
        if id(parameter) not in _DECLARED:
            weakref.finalize(parameter, _DECLARED.pop, id(parameter), None)
        _DECLARED[id(parameter)] = (weakref.ref(parameter), declared)


def declared(model_key: torch.Tensor | None, layer: str) -> Declared | None:
    """What was registered for `layer` ('#k' call suffix ignored) of the model `model_key` belongs
    to; None if it declared nothing."""
    entry = _DECLARED.get(id(model_key)) if model_key is not None else None
    if entry is None or entry[0]() is not model_key:
        return None
    return entry[1].get(layer.split("#")[0])
