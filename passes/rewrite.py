"""Replace each found attention site with one `torch.ops.kvtopo.attention` call.

The op receives kv-head k/v (no GQA repeat) and one SDPA-style mask; the nodes that computed the
old attention become dead and are removed.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import kvtopo.kernels.ops  # noqa: F401  (registers torch.ops.kvtopo.*)

from .graph_utils import model_key
from .site import AttentionSite


_KEPT_META = ("example_value", "nn_module_stack", "stack_trace", "source_fn_stack")


def _fold_masks(graph: fx.Graph, masks) -> fx.Node | None:
    """One attn_mask node equivalent to applying every mask of the site."""
    if not masks:
        return None
    bools = [m if kind == "bool" else graph.call_function(torch.logical_not, (m,))
             for m, kind in masks if kind != "additive"]
    additive = [m for m, kind in masks if kind == "additive"]
    if not bools:
        return additive[0]
    keep = bools[0]
    for other in bools[1:]:
        keep = graph.call_function(torch.logical_and, (keep, other))
    if not additive:
        return keep
    return graph.call_function(torch.where, (keep, additive[0], float("-inf")))


def _erase_dead_chain(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and the ancestors that only it used; never an in-place op or a graph input.

    (A whole-graph DCE would be wrong here: Dynamo graphs keep in-place `copy_` calls whose
    results are unused but whose effect is not, e.g. DeepSeek-V3 filling its key tensor.)
    """
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        if n in erased or n.users or n.op not in ("call_function", "call_method") or str(n.target).endswith("_"):
            continue  # (a node reached twice, e.g. the logits a sink site subtracts its row max from)
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)


def rewrite_mla_sites(gm: fx.GraphModule, sites) -> int:
    """Replace each MLA site with `kvtopo::mla_attention`; the per-head K/V it built become dead."""
    graph = gm.graph
    key = model_key(graph)
    for mla in sites:
        site = mla.site
        with graph.inserting_before(site.output):
            mask = _fold_masks(graph, site.masks)
            new = graph.call_function(
                torch.ops.kvtopo.mla_attention.default,
                (site.query, mla.latent, mla.rope_key, mla.weight, mask, site.scale, site.is_causal, mla.layer,
                 mla.nope_dim, key),
            )
        new.meta.update({k: v for k, v in site.output.meta.items() if k in _KEPT_META})
        site.output.replace_all_uses_with(new)
        _erase_dead_chain(graph, site.output)
        for fill in mla.fills:  # proven to only fill the per-head key, now unused
            inputs = fill.all_input_nodes
            graph.erase_node(fill)
            for node in inputs:
                _erase_dead_chain(graph, node)
    graph.lint()
    gm.recompile()
    return len(sites)


def rewrite_sites(gm: fx.GraphModule, sites: list[AttentionSite]) -> int:
    graph = gm.graph
    key = model_key(graph)
    for site in sites:
        with graph.inserting_before(site.output):
            mask = _fold_masks(graph, site.masks)
            args = (site.query, site.key, site.value, mask, site.scale, site.is_causal, site.layer, site.window,
                    site.softcap, key)
            sinks = (site.sinks,) if site.sinks is not None else ()  # the op's last argument, default None
            new = graph.call_function(torch.ops.kvtopo.attention.default, args + sinks)
        new.meta.update({k: v for k, v in site.output.meta.items() if k in _KEPT_META})
        site.output.replace_all_uses_with(new)
        _erase_dead_chain(graph, site.output)
    graph.lint()
    gm.recompile()
    return len(sites)
