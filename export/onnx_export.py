"""ONNX export of the decode step and the page compressor (`torch.onnx.export(..., dynamo=True)`).

kvtopo's attention op never reaches the exporter: DecodeStep replaces it by
`export.attention.cached_attention`, plain torch ops that the exporter translates to standard
ONNX (MatMul, Softmax-free exp/log-sum-exp, Where, Gather...), so the files need no custom domain.
Both files pass `onnx.checker.check_model(..., full_check=True)` and are written with their
weights inside (these models are small); `layout.json` next to them says how to feed the cache.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import torch

from .compressor import PageCompressor, compressor_class
from .decode_step import DecodeStep, capture, empty_cache, layer_tensor_names, layout_for, mid_axes, profiled
from .executors import graph_signature
from .layout import NPU_TOKENS

DECODE_FILE, COMPRESSOR_FILE, LAYOUT_FILE = "decode_step.onnx", "compressor.onnx", "layout.json"


def export_graphs(model, config, max_context: int, tokens: int | None = None, profile: str | None = None,
                  mid_valid_only: bool = False):
    """(layout, {graph: (module, example args, torch.export dynamic_shapes or None)}) of both graphs.

    `tokens`: new tokens per decode-step call, or None for a dynamic token count. The "npu"
    profile fixes it to NPU_TOKENS and puts float16 at both graphs' boundaries (Float16Boundary);
    the layout records both, and a fixed token count is the config's prefill chunk (the host
    runner feeds a prompt in calls of exactly that many tokens). `mid_valid_only` (with a dynamic
    token count): the decode step's Mid axes are dynamic too (see export/layout.py).
    """
    if profile == "npu":
        tokens = NPU_TOKENS
    if tokens is not None:
        config = config.replace(prefill_chunk_size=tokens)
    captured = capture(model, max(tokens or 8, 2))
    layout = layout_for(model, captured, config, max_context)
    layout.profile, layout.tokens = profile, tokens
    layout.mid_valid_only = mid_valid_only and tokens is None
    step = DecodeStep(captured, layout).eval()
    decode_args = example_decode_args(layout, tokens or min(8, max_context))
    dynamic = None if tokens else decode_dynamic_shapes(layout)
    graphs = {"decode_step": (*profiled(step, decode_args, profile), dynamic),
              "compressor": (*profiled(compressor_module(layout), example_compressor_args(layout), profile), None)}
    return layout, graphs


def decode_dynamic_shapes(layout):
    """torch.export dynamic_shapes of the decode step's args: the token count of ids and
    positions and, when `layout.mid_valid_only`, the Mid tensors' rows and pages axes."""
    auto = torch.export.Dim.AUTO
    axes = mid_axes(layout) if layout.mid_valid_only else {}
    cache = [{axes[n][0]: auto} if n in axes else None for n in layer_tensor_names(layout)]
    return ({1: auto}, {1: auto}, None, tuple(cache * layout.num_layers))


def example_decode_args(layout, tokens: int = 8):
    ids = torch.randint(0, layout.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(tokens)[None]
    lengths = torch.zeros(layout.num_layers, 3, dtype=torch.long)
    return ids, pos, lengths, tuple(empty_cache(layout))


def compressor_module(layout) -> PageCompressor:
    return compressor_class(layout)(layout.mid_code_bits, layout.score_margin).eval()


def example_compressor_args(layout, seed: int = 0):
    """Example inputs in `compressor_module(layout).INPUTS` order."""
    g = torch.Generator().manual_seed(seed)
    h, hq, dk, dv, P, W, R = (layout.kv_heads, layout.heads, layout.head_dim, layout.value_head_dim,
                              layout.page_size, layout.observation_window, layout.rank_capacity)
    kv = torch.linalg.qr(torch.randn(h, dk, dk, generator=g))[0][..., :R] if R <= dk else None
    key_vectors = torch.zeros(h, dk, R)
    key_vectors[..., : min(R, dk)] = kv if kv is not None else torch.linalg.qr(torch.randn(h, dk, dk, generator=g))[0]
    value_vectors = torch.zeros(h, dv, R)
    value_vectors[..., : min(R, dv)] = torch.linalg.qr(torch.randn(h, dv, dv, generator=g))[0][..., : min(R, dv)]
    args = dict(keys=torch.randn(h, P, dk, generator=g), values=torch.randn(h, P, dv, generator=g),
                queries=torch.randn(hq, W, dk, generator=g), num_queries=torch.tensor(W),
                keep=torch.tensor(max(1, P // 2)), scale=torch.tensor(layout.scales[0]), key_vectors=key_vectors,
                key_mean=torch.randn(h, dk, generator=g) * 0.1, value_vectors=value_vectors,
                value_mean=torch.randn(h, dv, generator=g) * 0.1)
    return tuple(args[name] for name in compressor_class(layout).INPUTS)


def compressor_program(layout):
    module = compressor_module(layout)
    args = example_compressor_args(layout)
    with torch.no_grad():
        ep = torch.export.export(module, args, strict=False)
    return module, args, ep


def _simplify(model) -> None:
    """Constant folding, common subexpressions and dead nodes, in place on the exporter's IR model.

    torch.onnx.export(optimize=True) also runs onnxscript's pattern rewriter, whose time grows
    with the square of the node count: over 25 minutes on SmolLM2's 30 layers on a 2-core machine,
    for 20 fewer nodes of 574 on the 2-layer zoo Llama. These passes do the rest of its work.
    """
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript.optimizer import fold_constants

    common.InlinePass()(model)
    fold_constants(model)
    ir.passes.Sequential(common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(),
                         common.RemoveUnusedOpsetsPass(),
                         common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
                         common.DeduplicateInitializersPass(), common.CommonSubexpressionEliminationPass(),
                         common.RemoveUnusedNodesPass())(model)


def _to_onnx(ep, args, path: Path, names_in, names_out) -> onnx.ModelProto:
    program = torch.onnx.export(ep, args, dynamo=True, input_names=names_in, output_names=names_out,
                                external_data=False, optimize=False)
    _simplify(program.model)
    program.save(str(path))
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    return model


def export_onnx_files(model, out_dir, config, max_context: int = 4096, profile: str | None = None) -> dict[str, str]:
    """Write decode_step.onnx, compressor.onnx and layout.json to out_dir; return their paths.
    Under the "npu" profile every input and output dimension of both files is a number
    (`dynamic_dims` finds none; raises otherwise)."""
    layout, graphs = export_graphs(model, config, max_context, profile=profile, mid_valid_only=True)
    out = Path(out_dir)  # created once the model is accepted: a refused one leaves no empty directory
    out.mkdir(parents=True, exist_ok=True)
    paths = {"decode_step": str(out / DECODE_FILE), "compressor": str(out / COMPRESSOR_FILE)}
    for graph, (module, args, dynamic) in graphs.items():
        with torch.no_grad():
            ep = torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
        model_proto = _to_onnx(ep, args, Path(paths[graph]), *graph_signature(layout, graph))
        if profile == "npu" and dynamic_dims(model_proto):
            raise ValueError(f"the npu profile's {graph} graph has dynamic dimensions: {dynamic_dims(model_proto)}")
    (out / LAYOUT_FILE).write_text(layout.to_json())
    return {**paths, "layout": str(out / LAYOUT_FILE)}


def dynamic_dims(model: onnx.ModelProto) -> list[str]:
    """`name[axis]` of every graph input or output dimension that is not a number (a symbol or
    unknown): none in a fully static graph."""
    found = []
    for value in [*model.graph.input, *model.graph.output]:
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            found.append(f"{value.name}[*]")
            continue
        found += [f"{value.name}[{axis}]" for axis, dim in enumerate(tensor.shape.dim) if not dim.HasField("dim_value")]
    return found
