"""What an HF model's config says each attention layer sees, for calls whose graph cannot show it.

HF builds no attention mask (SDPA's `is_causal` instead) for a chunk without padding that is no
longer than the layer's sliding window or block: a short prompt, and every decode step through
`hf_cache.SessionCache`. Such a graph holds no window for the passes to read, and a session would
attend over the whole history. A one-token graph cannot show that a layer attends both ways
either. And RoPE that HF rescales from the longest position of a call (`dynamic_rope_update`)
rotates keys already stored otherwise than one forward of the whole sequence does: LongRoPE
(Phi-3) switches to its long factor once positions pass `original_max_position_embeddings`, and
dynamic NTK scales its frequencies for the call's length past `max_position_embeddings`;
Llama-4's NoPE layers scale their queries by a factor of a position they count from 0 without a cache.
A hybrid model (Mamba-2 in Bamba, LFM2's short convolutions, Qwen3-Next's gated delta rule) keeps
state outside attention that HF's cache carries and a session does not.
`kvtopo.compile`, `kvtopo.generate`, `hf_cache.generate` and the backend (for the module whose
forward Dynamo compiles, so a bare `torch.compile` too) register the model here; the session
looks up the attention module it is called for (`Session.attend`; by the graph's first parameter
when a graph break made Dynamo compile a block or the attention module as a graph of its own, which
names its site relative to that module): a declared sliding window is applied (exactly what the
model does; a mask passed in is checked against it), one the config declares without saying
whether the model applies it bounds how far a session goes, a block layer (Llama-4's `attention_chunk_size`) and a
bidirectional layer are refused when the graph shows no mask, a chunk that carries a stored
history across LongRoPE's switch or past dynamic NTK's limit is refused (`check_rescaled`), and so
is any call that continues a hybrid model.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import weakref
from typing import NamedTuple

import torch


class Rescaled(NamedTuple):
    """RoPE whose frequencies HF picks, at each forward, from the call's longest position
    (`dynamic_rope_update`): the keys a session stored were rotated for the calls they came in."""

    rope_type: str  # "longrope" or "dynamic"
    after: int  # positions up to this many tokens rotate as the model was trained


class Declared(NamedTuple):
    window: int | None = None  # sliding window (tokens, the query's own included)
    # `config.sliding_window` without `layer_types` where the model's code builds no window mask
    # kvtopo knows (`_applies_config_window`): the model may or may not attend within it
    window_unknown: int | None = None
    blocks: int | None = None  # attends within blocks of this many tokens (attention_chunk_size)
    bidirectional: bool = False  # the module says it is not causal (`is_causal = False`)
    rescaled: Rescaled | None = None  # LongRoPE's or dynamic NTK's rescaling (`check_rescaled`)
    temperature_from: int | None = None  # Llama-4's NoPE layers scale queries from this position on (floor_scale)
    state_elsewhere: str | None = None  # what else in the model carries tokens forward (a hybrid's other layers)


class _Registered(NamedTuple):
    parameter: weakref.ref
    layers: dict[str, Declared]  # every attention module's name -> what its config declares
    owner: str  # the parameter's module ("model.layers.0.mlp"): where a graph that passes it was compiled
    state_elsewhere: str | None  # the model's state outside attention, whatever layer a graph names


# id(parameter) of a registered model -> its entry. Keyed by id: tensors compare by value, so they
# cannot be dictionary keys themselves.
_DECLARED: dict[int, _Registered] = {}


def _rope_parameters(config, kind: str) -> list[dict]:
    """The RoPE parameters that may rotate a layer of type `kind`: v5 `rope_parameters` (or the
    older `rope_scaling`), one dict for the model or, Gemma3-style, one per layer type. The
    declaration is per layer: a nested dict gives the layer's own type's entry; nested under labels
    that are not layer types (`_rope_type_labels`: DeepSeek-V4, LFM3), which this cannot map to a
    layer, every entry counts, so a rescaling any of them uses is declared for every layer."""
    for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if not isinstance(rope, dict) or not rope:
            continue
        if "rope_type" in rope or "type" in rope:
            return [rope]
        if isinstance(rope.get(kind), dict):
            return [rope[kind]]
        nested = [entry for entry in rope.values() if isinstance(entry, dict)]
        if nested:
            return nested
    return []


def _rescaled(config, kind: str) -> Rescaled | None:
    """What HF's `dynamic_rope_update` rescales for a layer of type `kind`: LongRoPE's switch to its
    long factor past `original_max_position_embeddings` (the rope dict's, as HF reads it; Phi-3
    keeps it on the config too), or dynamic NTK's scaling past `max_position_embeddings` (the
    rotary embedding's `original_max_seq_len`, what `_compute_dynamic_ntk_parameters` divides by);
    None for a rope that does not depend on the call's length."""
    for rope in _rope_parameters(config, kind):
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type == "longrope":
            after = rope.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings",
                                                                         getattr(config, "max_position_embeddings", None)))
        elif isinstance(rope_type, str) and "dynamic" in rope_type:  # the test `dynamic_rope_update` makes
            rope_type, after = "dynamic", getattr(config, "max_position_embeddings", None)
        else:
            continue
        if isinstance(after, int):
            return Rescaled(rope_type, after)
    return None


def check_rescaled(layer: str, rescaled: Rescaled | None, stored: int, chunk: int) -> None:
    """Raises for a chunk of `chunk` tokens after `stored` ones whose rotation would differ from one
    forward of the whole sequence, HF's generate prefill. LongRoPE: a chunk that takes the stored
    keys, rotated with the short factor, past the switch (HF's generate re-prefills there). Dynamic
    NTK: a chunk of more than one token ending past the limit, whose frequencies HF scales for its
    end while the stored keys were scaled for theirs (unscaled below the limit); a decode step
    scales its one token as HF's cached decode does, so it stays exact."""
    if rescaled is None or not stored:
        return
    after, end = rescaled.after, stored + chunk
    if rescaled.rope_type == "longrope" and stored <= after < end:
        raise ValueError(f"attention site {layer!r}: LongRoPE switches to its long factor after {after} tokens "
                         f"(original_max_position_embeddings), and this chunk takes the {stored} stored tokens, "
                         f"rotated with the short factor, to {end}; prefill a prompt longer than "
                         f"{after} tokens in one chunk, or start a new session")
    if rescaled.rope_type == "dynamic" and chunk > 1 and end > after:
        raise ValueError(f"attention site {layer!r}: dynamic NTK RoPE scales its frequencies for the length of the "
                         f"call once it passes {after} tokens (max_position_embeddings), and this chunk of {chunk} "
                         f"tokens takes the {stored} stored tokens, rotated for the calls they came in, to {end}; "
                         "prefill the whole prompt in one chunk (prefill_chunk_size >= the prompt's length; decode "
                         "steps of one token are exact), or start a new session")


def _state_layer_types() -> frozenset[str]:
    """The layer types HF's cache gives a recurrent state ("conv", "linear_attention", "hybrid"...):
    those its `DYNAMIC_LAYER_TYPE_MAPPING` maps to a linear-attention layer."""
    try:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING
    except ImportError:
        return frozenset({"conv", "linear_attention", "hybrid", "hybrid_sliding"})
    return frozenset(kind for kind, layer in DYNAMIC_LAYER_TYPE_MAPPING.items() if "LinearAttention" in layer.__name__)


_STATE_LAYER_TYPES = _state_layer_types()
# Token mixers that carry a state forward: Mamba's (MambaMixer, BambaMixer, NemotronHMamba2Mixer...),
# Qwen3-Next's gated delta rule, LFM2's short convolutions, RecurrentGemma's, RWKV's, xLSTM's.
_STATEFUL_MODULES = re.compile(r"Mixer|GatedDeltaNet|ShortConv|LinearAttention|RecurrentBlock|Rglru|RwkvSelfAttention|"
                               r"LSTM")


def state_outside_attention(model: torch.nn.Module) -> str | None:
    """What in `model` carries tokens forward besides attention, which a session does not store:
    `config.layer_types` HF's cache keeps a state for, the decoder's state-space / recurrent /
    linear-attention mixers, its depthwise convolutions over the tokens (Mamba's and LFM2's short
    convolutions); None if nothing."""
    model = getattr(model, "_orig_mod", model)
    found = set()
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found |= {f"{kind} layers" for kind in getattr(text_config, "layer_types", None) or () if kind in _STATE_LAYER_TYPES}
    # The decoder only: a multimodal model's audio or vision tower runs once over its input.
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else model
    for module in (decoder if isinstance(decoder, torch.nn.Module) else model).modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Conv1d) and module.groups == module.in_channels > 1:
            found.add("depthwise Conv1d over tokens")
        elif _STATEFUL_MODULES.search(name):
            found.add(name)
    return ", ".join(sorted(found)) or None


def _temperature_tuning(module: torch.nn.Module) -> int | None:
    """Llama-4's attention temperature tuning: a NoPE layer multiplies its queries by
    `log1p(floor((position + 1) / floor_scale)) * attn_scale + 1`, with positions it counts from its
    cache's length, 0 without one; the factor is 1 below `floor_scale`."""
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        floor_scale = getattr(module, "floor_scale", None)
        return int(floor_scale) if isinstance(floor_scale, (int, float)) else None
    return None


# HF's mask builders that apply `config.sliding_window` to a model whose config has no `layer_types`.
_CONFIG_WINDOW_MASKS = re.compile(r"\b(create_sliding_window_causal_mask|create_masks_for_generate|"
                                  r"sliding_window_causal_mask_function|sliding_window_overlay)\b")


@functools.cache
def _builds_config_window_mask(module_name: str) -> bool:
    source_module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(source_module) if source_module is not None else ""
    except (OSError, TypeError):  # no source to read (a REPL, a frozen module)
        source = ""
    return bool(_CONFIG_WINDOW_MASKS.search(source))


def _applies_config_window(model: torch.nn.Module) -> bool:
    """Whether the code of `model`'s modules builds its masks with HF's window builders, which read
    `config.sliding_window` (Mistral's does). A config may declare a window its model never applies
    (Moshi's text decoder keeps `sliding_window` and masks causally): without `layer_types` the
    config alone cannot say which."""
    return any(_builds_config_window_mask(name) for name in {type(m).__module__ for m in model.modules()})


def _declared_for(module: torch.nn.Module, config, index: int, applies_config_window: bool) -> Declared:
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types and index < len(layer_types):
        kind = layer_types[index]
    else:
        kind = "full_attention" if not window else "sliding_attention" if applies_config_window else "unknown"
    blocks = getattr(config, "attention_chunk_size", None)
    return Declared(
        window=window if kind == "sliding_attention" and isinstance(window, int) else None,
        window_unknown=window if kind == "unknown" and isinstance(window, int) else None,
        blocks=blocks if kind == "chunked_attention" and isinstance(blocks, int) else None,
        bidirectional=getattr(module, "is_causal", True) is False,
        rescaled=_rescaled(config, kind),
        temperature_from=_temperature_tuning(module),
    )


def declare(model: torch.nn.Module) -> str | None:
    """Register what `model`'s config says of its attention modules (HF modules with a
    `layer_idx`): windows and blocks (`config.layer_types`, else `config.sliding_window` for every
    layer where the model's code applies it, `_applies_config_window`), modules that are not
    causal, LongRoPE's and dynamic NTK's rescaling, state a hybrid keeps elsewhere.
    Returns that state outside attention (`state_outside_attention`), None if there is none."""
    model = getattr(model, "_orig_mod", model)  # what torch.compile wraps: its names are the graph's
    layers, state_elsewhere = {}, state_outside_attention(model)
    applies_config_window = _applies_config_window(model)
    for name, module in model.named_modules():
        config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
        if config is not None and isinstance(index, int) and "Attention" in type(module).__name__:
            layers[name] = _declared_for(module, config, index, applies_config_window)
    if state_elsewhere is not None or any(found != Declared() for found in layers.values()):
        for name, parameter in model.named_parameters():
            owner, held = name.rpartition(".")[0], _DECLARED.get(id(parameter))
            if held is None:
                weakref.finalize(parameter, _DECLARED.pop, id(parameter), None)
            elif held.parameter() is parameter and len(held.owner) > len(owner):
                continue  # registered from a module around this one (the backend declares each frame's)
            _DECLARED[id(parameter)] = _Registered(weakref.ref(parameter), layers, owner, state_elsewhere)
    return state_elsewhere


def declared(model_key: torch.Tensor | None, layer: str) -> Declared | None:
    """What was registered for `layer` ('#k' call suffix ignored) of the model `model_key` belongs
    to; None if it declared nothing."""
    entry = _DECLARED.get(id(model_key)) if model_key is not None else None
    if entry is None or entry.parameter() is not model_key:
        return None
    name = layer.split("#")[0]
    if name not in entry.layers:
        name = _compiled_within(entry, name)
    # The model's state outside attention holds for every site, HF attention module or not.
    found = entry.layers.get(name, Declared())._replace(state_elsewhere=entry.state_elsewhere)
    return found if found != Declared() else None


def _compiled_within(entry: _Registered, name: str) -> str | None:
    """The attention module a graph compiled from a submodule's own frame names `name`. After a
    graph break inside a block (DBRX's experts, a hybrid's mixer) Dynamo compiles the block's
    forward, or the attention module's, as a graph of its own, which one compiled graph serves for
    every instance: its layer names are relative to that submodule (`norm_attn_norm.attn`), or the
    op's node name when the frame is the attention module's. The graph's model key, its first
    parameter, lies inside the submodule: the one attention module that matches under it is meant."""
    within = [full for full in entry.layers
              if full.endswith("." + name) and entry.owner.startswith(full[: -len(name)])]
    if not within and "." not in name:
        within = [full for full in entry.layers if entry.owner.startswith(full + ".")]
    return within[0] if len(within) == 1 else None
