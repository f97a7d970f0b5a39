"""What an HF model's config says each attention layer sees, for calls whose graph cannot show it.

HF builds no attention mask (SDPA's `is_causal` instead) for a chunk without padding that is no
longer than the layer's sliding window or block: a short prompt, and every decode step through
`hf_cache.SessionCache`. Such a graph holds no window for the passes to read, and a session would
attend over the whole history. `kvtopo.compile`, `kvtopo.generate` and `hf_cache.generate`
register the model here; the session looks up the attention module it is called for
(`Session.attend`): a declared sliding window is applied (exactly what the model does), a block
layer (Llama-4's `attention_chunk_size`) is refused.
"""

from __future__ import annotations

import weakref

import torch

# id(parameter) of a registered model -> (the parameter, weakly; {attention module name: ("window" | "blocks",
# tokens)}). Keyed by id: tensors compare by value, so they cannot be dictionary keys themselves.
_DECLARED: dict[int, tuple[weakref.ref, dict[str, tuple[str, int]]]] = {}


def declare(model: torch.nn.Module) -> None:
    """Register the windows and blocks `model`'s config gives its attention modules (HF modules
    with a `layer_idx`: `config.layer_types`, else `config.sliding_window` for every layer)."""
    model = getattr(model, "_orig_mod", model)  # what torch.compile wraps: its names are the graph's
    declared = {}
    for name, module in model.named_modules():
        config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
        if config is None or not isinstance(index, int) or "Attention" not in type(module).__name__:
            continue
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        kind = layer_types[index] if layer_types and index < len(layer_types) else (
            "sliding_attention" if window else "full_attention")
        if kind == "sliding_attention" and isinstance(window, int):
            declared[name] = ("window", window)
        elif kind == "chunked_attention" and isinstance(getattr(config, "attention_chunk_size", None), int):
            declared[name] = ("blocks", config.attention_chunk_size)
    for parameter in model.parameters() if declared else ():
        if id(parameter) not in _DECLARED:
            weakref.finalize(parameter, _DECLARED.pop, id(parameter), None)
        _DECLARED[id(parameter)] = (weakref.ref(parameter), declared)


def declared(model_key: torch.Tensor | None, layer: str) -> tuple[str, int] | None:
    """("window" | "blocks", tokens) registered for `layer` ('#k' call suffix ignored) of the model
    `model_key` belongs to; None if it declared nothing."""
    entry = _DECLARED.get(id(model_key)) if model_key is not None else None
    if entry is None or entry[0]() is not model_key:
        return None
    return entry[1].get(layer.split("#")[0])
