"""The decode step as a module with the compressed cache as explicit tensor inputs.

`capture` traces a model with Dynamo exactly as `kvtopo.generate` calls it
(`model(input_ids=..., position_ids=..., use_cache=False)`, the token dimension marked dynamic),
runs kvtopo's passes on the FX graph (`passes.manager.run_passes`, as the `kvtopo` backend does)
and keeps the rewritten GraphModule. A model with refused attention sites is rejected: a site
left as plain attention would silently ignore the cache. So is one the graphs would run wrong: a
hybrid's state outside attention, a forward that writes module state (a graph output besides
the logits), floating weights other than float32.

`DecodeStep` then points every `torch.ops.kvtopo.attention` node at `export.attention.
cached_attention` over that layer's cache tensors (so the exported graphs contain only standard
ops, no kvtopo domain) and returns, besides the logits, each layer's new keys/values and queries
for the host to append and to keep as the observation window:

    forward(input_ids [1, T], position_ids [1, T], lengths [L, 3], cache: tuple of L * 19 tensors
            (15 without bases when Mid is not projected))
      -> (logits [1, T, V], new_k: L x [Hkv, T, dk], new_v: L x [Hkv, T, dv], queries: L x [Hq, T, d])

`torch.ops.kvtopo.mla_attention` nodes (DeepSeek-V2/V3) become the same cached attention as the
op does it in a session: the query absorbs the up-projection, the layer caches one kv-head of
[latent ; RoPE key] whose value is the latent (no value tensors: 10 cache tensors per layer, no
new_v outputs), and the attended latent is up-projected once. queries are the absorbed queries
[H, T, r + rope], what the session keeps as the observation window.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from kvtopo.kernels.ops import absorbed_mla_inputs, latent_to_heads  # (and registers torch.ops.kvtopo.attention)
from kvtopo.config import Config
from kvtopo.passes.find_mla import MLASite
from kvtopo.passes.manager import run_passes
from kvtopo.runtime.declared_attention import state_outside_attention

from .attention import LayerCacheTensors, cached_attention
from .compressor import descending_ranks
from .layout import CacheLayout


class RefusedAttention(ValueError):
    """The model has attention sites kvtopo could not rewrite; exporting it would be wrong."""


class Captured:
    def __init__(self, gm: fx.GraphModule, example_inputs, sites, report):
        self.gm, self.example_inputs, self.sites, self.report = gm, example_inputs, sites, report


def capture(model: nn.Module, tokens: int = 8) -> Captured:
    """Dynamo-trace `model` as kvtopo.generate calls it and rewrite its attention sites."""
    _check_exportable_model(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs), run_passes(gm)))
        return gm.forward

    vocab = getattr(getattr(model, "config", None), "vocab_size", 32)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens)[None]
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(pos, 1)
    torch._dynamo.reset()
    restore = _static_experts(model)
    try:
        # Python floats (scales, eps) stay constants: a symbolic scale is refused by the passes.
        with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
            torch.compile(model, backend=backend, fullgraph=False)(input_ids=ids, position_ids=pos, use_cache=False)
    finally:
        torch._dynamo.reset()
        restore()
    refusals = [r for _, _, rep in graphs for r in rep.refusals]
    if refusals:
        raise RefusedAttention("cannot export: kvtopo refused these attention site(s):\n  "
                               + "\n  ".join(r.describe() for r in refusals))
    if len(graphs) != 1:
        raise ValueError(f"cannot export: Dynamo split the model into {len(graphs)} graphs (graph breaks); "
                         "export needs one graph")
    gm, example_inputs, report = graphs[0]
    if not report.sites:
        raise ValueError("cannot export: kvtopo found no attention site in the model")
    outputs = _graph_outputs(gm)
    if len(outputs) != 1:
        # Dynamo returns a tensor the forward stores on a module (Phi-3's LongRoPE `long_inv_freq`)
        # as one more graph output; DecodeStep returns only the logits, so that write would be lost.
        raise NotImplementedError(
            f"cannot export: the captured graph returns {len(outputs)} outputs ({', '.join(outputs)}), not the "
            "logits alone: the forward writes module state (the outputs besides the logits) that the exported "
            "decode step would not carry between calls")
    return Captured(gm, example_inputs, report.sites, report)


def _check_exportable_model(model: nn.Module) -> None:
    """Refuse, before tracing, what the exported graphs cannot hold: state carried outside
    attention (a hybrid's convolutions or recurrences: the decode step keeps only the KV cache),
    and floating weights other than float32 (the graphs' and the layout's precision)."""
    state = state_outside_attention(model)
    if state is not None:
        raise NotImplementedError(f"cannot export: this model keeps state outside attention ({state}), which the "
                                  "exported decode step does not carry between calls")
    other = sorted({str(t.dtype).removeprefix("torch.") for t in [*model.parameters(), *model.buffers()]
                    if t.is_floating_point() and t.dtype != torch.float32})
    if other:
        raise ValueError(f"cannot export: the model has {', '.join(other)} parameters or buffers; the exported "
                         "graphs are float32: pass a float32 model (e.g. `model.float()`)")


def _graph_outputs(gm: fx.GraphModule) -> list[str]:
    """Names of the values the graph returns."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return [str(v) for v in torch.utils._pytree.tree_leaves(output.args[0])]


def _static_experts(model: nn.Module):
    """Switch HF mixture-of-experts layers to the `batched_mm` implementation for the capture.

    The default `grouped_mm` path sorts tokens by expert and runs an opaque
    `transformers::grouped_mm_fallback` op on data-dependent groups, which has no ONNX/MLIR
    form; `batched_mm` computes the same expert mixture with static shapes (every routed
    (token, expert) pair as one batched GEMM). Returns a function restoring the old setting.
    """
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_experts_implementation")}
    old = {k: c._experts_implementation for k, c in configs.items()}
    for c in configs.values():
        if c._experts_implementation not in (None, "eager"):
            c._experts_implementation = "batched_mm"

    def restore():
        for k, c in configs.items():
            c._experts_implementation = old[k]
    return restore


# -- the hook that stands in for torch.ops.kvtopo.attention while DecodeStep runs ----------------
_BINDINGS: list["_Binding"] = []


class _Binding:
    def __init__(self, step: "DecodeStep", lengths, cache):
        self.step, self.lengths, self.cache = step, lengths, cache
        self.new_k, self.new_v, self.queries = {}, {}, {}

    def attend(self, layer: str, query, key, value, scale):
        """Record the layer's new keys, values (unless they are the keys' leading dims) and queries;
        attend over the layer's cache tensors."""
        i = self.step.layer_index[layer]
        lay = self.step.layout
        self.new_k[i], self.queries[i] = key[0], query[0]
        if not lay.shared_value_dim:
            self.new_v[i] = value[0]
        return cached_attention(query, key, value, scale, self.cache[i], self.lengths[i], lay.page_size,
                                lay.recent_code_bits, lay.mid_code_bits, lay.shared_value_dim)


def kvtopo_cached_attention(query, key, value, attn_mask, scale, is_causal, layer, window=None, softcap=None,
                            model_key=None, sinks=None):
    """Replacement target of `kvtopo.attention` nodes inside DecodeStep (the mask is the model's
    own causal mask for the chunk; the cache's causal structure is rebuilt from lengths)."""
    if sinks is not None:
        raise NotImplementedError(f"export does not carry attention sinks yet; layer {layer!r} has them")
    return _BINDINGS[-1].attend(layer, query, key, value, scale)


def kvtopo_cached_mla_attention(query, latent, rope_key, kv_up_weight, attn_mask, scale, is_causal, layer, nope_dim,
                                model_key=None):
    """Replacement target of `kvtopo.mla_attention` nodes: the op's latent-space attention, with
    the latent + RoPE key cached as one kv-head whose value is the latent."""
    q_latent, keys, w_value = absorbed_mla_inputs(query, latent, rope_key, kv_up_weight, nope_dim)
    return latent_to_heads(_BINDINGS[-1].attend(layer, q_latent, keys, latent, scale), w_value)


def host_positions(positions, model_key):
    """Replacement target of `kvtopo.given_positions` nodes: the host runner passes the positions
    and keeps the lengths, so there is no session to check them against."""
    return positions


_REPLACEMENTS = {torch.ops.kvtopo.attention.default: kvtopo_cached_attention,
                 torch.ops.kvtopo.mla_attention.default: kvtopo_cached_mla_attention,
                 torch.ops.kvtopo.given_positions.default: host_positions}


class DecodeStep(nn.Module):
    def __init__(self, captured: Captured, layout: CacheLayout):
        super().__init__()
        gm = captured.gm
        self.layout = layout
        self.layer_index = {name: i for i, name in enumerate(layout.layer_names)}
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in _REPLACEMENTS:
                node.target = _REPLACEMENTS[node.target]
        _rewrite_routers(gm)
        gm.recompile()
        self.gm = gm
        # Placeholders: the token count (SymInt), input_ids, position_ids, or a model constant.
        self.arg_kinds: list[str | int] = []
        for i, (node, example) in enumerate(zip([n for n in gm.graph.nodes if n.op == "placeholder"],
                                                captured.example_inputs)):
            if isinstance(example, torch.SymInt):
                self.arg_kinds.append("tokens")
            elif "input_ids" in node.name:
                self.arg_kinds.append("input_ids")
            elif "position_ids" in node.name:
                self.arg_kinds.append("position_ids")
            elif isinstance(example, torch.Tensor):
                self.register_buffer(f"const{i}", example.detach())
                self.arg_kinds.append(f"const{i}")
            else:
                raise ValueError(f"cannot export: graph input {node.name!r} is a {type(example).__name__}")

    def forward(self, input_ids, position_ids, lengths, cache):
        flags = (bool(self.layout.shared_value_dim), self.layout.mid_projected)
        per = len(LayerCacheTensors.names(*flags))
        layers = [LayerCacheTensors.from_flat(cache[i * per:(i + 1) * per], *flags)
                  for i in range(self.layout.num_layers)]
        binding = _Binding(self, lengths, layers)
        args = []
        for kind in self.arg_kinds:
            if kind == "tokens":
                args.append(input_ids.shape[1])
            elif kind in ("input_ids", "position_ids"):
                args.append(input_ids if kind == "input_ids" else position_ids)
            else:
                args.append(getattr(self, kind))
        _BINDINGS.append(binding)
        try:
            out = self.gm(*args)
        finally:
            _BINDINGS.pop()
        logits = out[0] if isinstance(out, (tuple, list)) else out
        n = self.layout.num_layers
        new_v = () if self.layout.shared_value_dim else tuple(binding.new_v[i] for i in range(n))
        return (logits, tuple(binding.new_k[i] for i in range(n)), new_v,
                tuple(binding.queries[i] for i in range(n)))


def _cached_shape(site) -> dict:
    """What one layer caches: heads, kv-heads, key/value dims, and for MLA the value dims shared with the key."""
    if isinstance(site, MLASite):
        r = site.latent_dim
        return dict(heads=site.site.heads, kv_heads=1, head_dim=r + site.rope_dim, value_head_dim=r,
                    shared_value_dim=r)
    return dict(heads=site.heads, kv_heads=site.kv_heads, head_dim=site.head_dim, value_head_dim=site.value_head_dim,
                shared_value_dim=None)


def topk_by_rank(input, k, dim=-1, largest=True, sorted=True):
    """`torch.topk` (same signature) from `descending_ranks`: values in descending order, ties
    to the lower index (one of the orders torch.topk allows; `sorted=False` allows any).

    Expert routers' topk becomes comparisons and sums. torch-mlir lowers topk to a sort, which
    NPU toolchains often lack, and IREE 3.13 returned wrong indices for the second of
    Qwen3-MoE's two router sorts (right values, wrong experts) in the decode step.
    """
    x = input.movedim(dim, -1)
    x_ranked = x if largest else -x
    slots = torch.arange(k, device=x.device)
    at_slot = descending_ranks(x_ranked)[..., None, :] == slots[:, None]  # [..., k, N]
    indices = (at_slot.long() * torch.arange(x.shape[-1], device=x.device)).sum(-1)
    return x.gather(-1, indices).movedim(-1, dim), indices.movedim(-1, dim)


def scatter_by_compare(input, dim, index, value, inplace=False):
    """`input.scatter(dim, index, value)` (`scatter_` if `inplace`) for a scalar `value`, as a
    comparison with every position along `dim` and a masked fill.

    IREE 3.13 miscompiled DeepSeek-V3's group-mask scatter in the one-token decode step (all
    operands [1, 1], the index computed by `topk_by_rank`): it wrote nothing, every expert was
    masked out and the router picked experts 0 and 1. The masked fill lowers correctly. An index
    narrower than `input` outside `dim` (scatter writes only its part) keeps torch's scatter."""
    dim = dim % input.dim()
    if any(index.shape[d] != input.shape[d] for d in range(input.dim()) if d != dim):
        return input.scatter_(dim, index, value) if inplace else input.scatter(dim, index, value)
    positions = torch.arange(input.shape[dim], device=input.device)
    hit = (index.movedim(dim, -1)[..., :, None] == positions).any(-2).movedim(-1, dim)
    return input.masked_fill_(hit, value) if inplace else input.masked_fill(hit, value)


def _rewrite_routers(gm: fx.GraphModule) -> None:
    """Route the graph's `topk` calls (DeepSeek-V3's and Qwen3-MoE's expert routers) through
    `topk_by_rank` and its scalar scatters (DeepSeek-V3's group mask) through
    `scatter_by_compare`: the model's function is unchanged, and no sort reaches the exported
    graphs (torch-mlir could not lower DeepSeek-V3's unsorted topk either)."""
    scatters = {("call_method", "scatter"): False, ("call_method", "scatter_"): True,
                ("call_function", torch.scatter): False}
    for node in gm.graph.nodes:
        if (node.op, node.target) in (("call_function", torch.topk), ("call_method", "topk")):
            node.op, node.target = "call_function", topk_by_rank
        elif ((node.op, node.target) in scatters and len(node.args) == 4 and not node.kwargs
              and isinstance(node.args[3], (int, float)) and isinstance(node.args[1], int)):
            node.kwargs = {"inplace": scatters[node.op, node.target]}
            node.op, node.target = "call_function", scatter_by_compare


class Float16Boundary(nn.Module):
    """`module` with float16 tensors at its boundary and float32 compute inside (the "npu" profile).

    Every float32 input of one or more dimensions is taken as float16 and upcast once on entry;
    every float32 output is rounded to float16. Integer tensors (ids, lengths, uint8 codes, row
    maps) and 0-d float scalars (the compressor's softmax scale) pass unchanged. Arguments are
    positional and may nest in tuples, as DecodeStep's cache does."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module

    @staticmethod
    def narrowed(tensor):
        """What the boundary expects for an example float32 input: its float16 copy."""
        return tensor.to(torch.float16) if _crosses_boundary(tensor, torch.float32) else tensor

    def forward(self, *args):
        from torch.utils._pytree import tree_map

        widened = tree_map(lambda t: t.float() if _crosses_boundary(t, torch.float16) else t, args)
        out = self.inner(*widened)
        return tree_map(lambda t: t.to(torch.float16) if _crosses_boundary(t, torch.float32) else t, out)


def _crosses_boundary(value, dtype: torch.dtype) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == dtype and value.dim() >= 1


def profiled(module: nn.Module, args: tuple, profile: str | None):
    """(module, example args) as the profile exports them: "npu" wraps them in Float16Boundary."""
    if profile != "npu":
        return module, args
    from torch.utils._pytree import tree_map

    return Float16Boundary(module).eval(), tree_map(Float16Boundary.narrowed, args)


def layout_for(model: nn.Module, captured: Captured, config: Config, max_context: int) -> CacheLayout:
    sites = captured.sites
    special = [s for s in sites if not isinstance(s, MLASite) and (s.window or s.softcap or s.sinks is not None)]
    if special:
        raise NotImplementedError(
            "export does not carry sliding windows, logit softcapping or attention sinks yet; these layers have "
            "them: " + "; ".join(f"{s.layer} (window={s.window}, softcap={s.softcap}, sinks={s.sinks is not None})"
                                 for s in special))
    shapes = [_cached_shape(s) for s in sites]
    if any(shape != shapes[0] for shape in shapes):
        raise NotImplementedError("export needs every attention layer to cache the same shapes (and either all or "
                                  "no layers MLA); got " + "; ".join(f"{s.layer}: {shape}" for s, shape in zip(sites, shapes)))
    scales = [s.site.scale if isinstance(s, MLASite) else s.scale for s in sites]
    return CacheLayout.build(config, max_context, layer_names=[s.layer for s in sites], scales=scales,
                             vocab_size=model.config.vocab_size, **shapes[0])


def layer_tensor_names(layout: CacheLayout) -> list[str]:
    """One layer's cache tensors in graph-input order (MLA: no value tensors; unprojected Mid: no bases)."""
    return LayerCacheTensors.names(bool(layout.shared_value_dim), layout.mid_projected)


def cache_shapes(layout: CacheLayout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each per-layer cache tensor (`layer_tensor_names` order)."""
    h, dk, dv, P = layout.kv_heads, layout.head_dim, layout.value_head_dim, layout.page_size
    rpb, mpb = 8 // layout.recent_code_bits, 8 // layout.mid_code_bits
    C, M, Mp, R = layout.recent_capacity, layout.mid_capacity, layout.mid_page_capacity, layout.rank_capacity
    f, u8 = torch.float32, torch.uint8
    shapes = {
        "exact_k": ((h, layout.exact_capacity, dk), f), "exact_v": ((h, layout.exact_capacity, dv), f),
        "recent_k_codes": ((h, C, -(-dk // rpb)), u8), "recent_k_scale": ((h, C // P, dk), f),
        "recent_k_offset": ((h, C // P, dk), f),
        "recent_v_codes": ((h, C, -(-dv // rpb)), u8), "recent_v_scale": ((h, C), f), "recent_v_offset": ((h, C), f),
        "mid_k_codes": ((h, M, R // mpb), u8), "mid_k_scale": ((h, Mp, R), f), "mid_k_offset": ((h, Mp, R), f),
        "mid_v_codes": ((h, M, R // mpb), u8), "mid_v_scale": ((h, Mp, R), f), "mid_v_offset": ((h, Mp, R), f),
        "mid_row_page": ((M,), torch.int64),
        "key_vectors": ((h, dk, R), f), "key_mean": ((h, dk), f),
        "value_vectors": ((h, dv, R), f), "value_mean": ((h, dv), f),
    }
    if not layout.mid_projected:  # codes of the tokens' channels: keys per page and channel, values per row
        shapes.update({"mid_k_codes": ((h, M, -(-dk // mpb)), u8), "mid_k_scale": ((h, Mp, dk), f),
                       "mid_k_offset": ((h, Mp, dk), f), "mid_v_codes": ((h, M, -(-dv // mpb)), u8),
                       "mid_v_scale": ((h, M), f), "mid_v_offset": ((h, M), f)})
    return {name: shapes[name] for name in layer_tensor_names(layout)}


def mid_axes(layout: CacheLayout) -> dict[str, tuple[int, str]]:
    """The axis of each Mid tensor that counts Mid rows ("rows", capacity M) or Mid pages
    ("pages", capacity Mp): the axes a `layout.mid_valid_only` decode step takes at the length held."""
    axes = {"mid_k_codes": (1, "rows"), "mid_v_codes": (1, "rows"), "mid_row_page": (0, "rows"),
            "mid_k_scale": (1, "pages"), "mid_k_offset": (1, "pages")}
    value_stats = "pages" if layout.mid_projected else "rows"  # unprojected values: statistics per row
    axes.update({"mid_v_scale": (1, value_stats), "mid_v_offset": (1, value_stats)})
    names = layer_tensor_names(layout)
    return {name: axis for name, axis in axes.items() if name in names}


def empty_cache(layout: CacheLayout) -> list[torch.Tensor]:
    """Zero-filled cache tensors for every layer, flattened in graph-input order."""
    shapes = cache_shapes(layout)
    out = []
    for _ in range(layout.num_layers):
        out += [torch.zeros(shape, dtype=dtype) for shape, dtype in shapes.values()]
    return out


def input_names(layout: CacheLayout) -> list[str]:
    names = ["input_ids", "position_ids", "lengths"]
    for i in range(layout.num_layers):
        names += [f"{n}_{i}" for n in layer_tensor_names(layout)]
    return names


def output_names(layout: CacheLayout) -> list[str]:
    n = layout.num_layers
    new_v = [] if layout.shared_value_dim else [f"new_v_{i}" for i in range(n)]
    return ["logits"] + [f"new_k_{i}" for i in range(n)] + new_v + [f"queries_{i}" for i in range(n)]
