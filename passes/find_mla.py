"""Find DeepSeek-V2/V3 multi-head latent attention (MLA) and rewrite it into `kvtopo::mla_attention`.

HF's MLA builds per-head keys/values from one shared latent per token:

    latent  = kv_a_layernorm(split(kv_a_proj_with_mqa(x))[0]).view(B, 1, T, r)
    kv      = kv_b_proj(latent).view(B, T, H, nope + v).transpose(1, 2)
    k_nope, value = split(kv, [nope, v], dim=-1)
    key     = kv.new_empty(B, H, T, nope + rope)
    key[..., :nope].copy_(k_nope); key[..., nope:].copy_(k_rope.expand(-1, H, -1, -1))
    attention(query, key, value)

Caching those per-head keys/values would grow the cache by an order of magnitude; the op
instead receives the latent, the RoPE key and kv_b_proj's weight, caches [latent ; rope key]
and attends in the latent space. Any deviation from this structure is refused with the reason
(the plain-attention finders may still rewrite the site, caching per-head K/V exactly).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from .find_eager import is_attention_softmax
from .find_eager import _match as match_eager
from .find_sdpa import _match as match_sdpa
from .graph_utils import ActivationSources, arg, is_call, layer_name, meta_tensor, static_int
from .site import AttentionSite, NotAttention, Refusal, format_scale


@dataclass(frozen=True)
class MLASite:
    """An attention site proven to be MLA, with what `kvtopo::mla_attention` needs."""

    layer: str
    site: AttentionSite
    latent: fx.Node
    rope_key: fx.Node
    weight: fx.Node
    nope_dim: int
    fills: tuple[fx.Node, ...]  # the in-place copy_ nodes that built the per-head key

    @property
    def latent_dim(self) -> int:
        return static_int(meta_tensor(self.latent).shape[-1])

    @property
    def rope_dim(self) -> int:
        return static_int(meta_tensor(self.rope_key).shape[-1])

    def describe(self) -> str:
        r, rope = self.latent_dim, self.rope_dim
        return (f"{self.layer}: MLA ({self.site.pattern}), heads={self.site.heads} latent={r} rope={rope} "
                f"nope={self.nope_dim} v_head_dim={self.site.value_head_dim} scale={format_scale(self.site.scale)}")


def find_mla_sites(gm: fx.GraphModule) -> tuple[list[MLASite], list[Refusal]]:
    sources = ActivationSources(gm.graph)
    sites, refusals = [], []
    for node in gm.graph.nodes:
        if is_call(node, F.scaled_dot_product_attention):
            matcher, pattern = match_sdpa, "sdpa"
        elif is_attention_softmax(node):
            matcher, pattern = match_eager, "eager"
        else:
            continue
        layer = layer_name(node, node.name)
        try:
            site = matcher(node, layer, sources)
        except NotAttention:
            continue  # not attention at all: the plain finders report it
        if not _looks_like_mla(site.key):
            continue
        try:
            sites.append(_prove_mla(site))
        except NotAttention as why:
            refusals.append(Refusal(layer, f"mla-{pattern}", node.name, str(why)))
    return sites, refusals


def _looks_like_mla(key: fx.Node) -> bool:
    return is_call(key, methods=("new_empty",))


def _prove_mla(site: AttentionSite) -> MLASite:
    key, value = site.key, site.value
    kv = key.args[0]
    if site.window or site.softcap:
        raise NotAttention(f"MLA with a sliding window ({site.window}) or logit softcap ({site.softcap}) is not supported")
    if site.kv_heads != site.heads:
        raise NotAttention("MLA keys must have one head per query head")
    # value = split(kv, [nope, v], dim=-1)[1]
    split, nope_part = _split_of(value, kv, index=1)
    nope_dim, value_dim = nope_part
    if value_dim != site.value_head_dim:
        raise NotAttention(f"value split size {value_dim} != value head dim {site.value_head_dim}")
    # key[..., :nope] <- split[0]; key[..., nope:] <- rope_key.expand(-1, H, -1, -1)
    fills = {}
    readers = [u for u in key.users if not is_call(u, operator.getitem)]
    if len(readers) != 1:
        raise NotAttention(f"the per-head key is read by {[u.name for u in readers]}, not only by the attention")
    for user in key.users:
        if user is readers[0]:
            continue
        if len(user.users) != 1:
            raise NotAttention(f"the per-head key slice {user.name} is used elsewhere")
        copy = next(iter(user.users))
        if not is_call(copy, methods=("copy_",)) or copy.args[0] is not user:
            raise NotAttention(f"{user.name} of the per-head key is not filled by copy_")
        fills[_slice_of(user.args[1])] = copy
    if set(fills) != {(None, nope_dim), (nope_dim, None)}:
        raise NotAttention(f"the per-head key is filled at slices {sorted(fills, key=str)}, "
                           f"not [:{nope_dim}] and [{nope_dim}:]")
    k_nope = fills[(None, nope_dim)].args[1]
    if not (is_call(k_nope, operator.getitem) and k_nope.args == (split, 0)):
        raise NotAttention("the key's no-RoPE part is not the first split of the up-projection")
    rope_expand = fills[(nope_dim, None)].args[1]
    if not is_call(rope_expand, methods=("expand",)):
        raise NotAttention("the key's RoPE part is not one shared key expanded over heads")
    rope_key = rope_expand.args[0]
    if static_int(meta_tensor(rope_key).shape[1]) != 1:
        raise NotAttention("the RoPE key is not shared across heads (one head)")
    latent, weight = _up_projection(kv, site.heads, nope_dim + value_dim)
    if static_int(meta_tensor(latent).shape[1]) != 1:
        raise NotAttention("the latent is not one shared [B, 1, T, r] tensor")
    q_dim, rope_dim = site.head_dim, static_int(meta_tensor(rope_key).shape[-1])
    if q_dim != nope_dim + rope_dim:
        raise NotAttention(f"query head dim {q_dim} != nope {nope_dim} + rope {rope_dim}")
    return MLASite(site.layer, site, latent, rope_key, weight, nope_dim, tuple(fills.values()))


def _split_of(part: fx.Node, kv: fx.Node, index: int):
    if not is_call(part, operator.getitem) or part.args[1] != index:
        raise NotAttention("values are not a split of the up-projected latent")
    split = part.args[0]
    if not (is_call(split, torch.functional.split, torch.split, methods=("split",)) and split.args[0] is kv):
        raise NotAttention("values are not split from the same tensor the per-head key is allocated from")
    sizes, dim = arg(split, 1, "split_size_or_sections"), arg(split, 2, "dim", 0)
    if dim not in (-1, 3) or not isinstance(sizes, (list, tuple)) or len(sizes) != 2:
        raise NotAttention(f"the up-projection is split as {sizes} on dim {dim}, not [nope, v] on the last dim")
    return split, tuple(sizes)


def _slice_of(index) -> tuple | None:
    """(start, stop) of an `x[..., start:stop]` index, else None."""
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice) \
            and index[1].step is None:
        return index[1].start, index[1].stop
    return None


def _up_projection(kv: fx.Node, heads: int, width: int) -> tuple[fx.Node, fx.Node]:
    """kv = linear(latent, W).view(B, T, H, width).transpose(1, 2) -> (latent, W)."""
    if not (is_call(kv, torch.transpose, methods=("transpose",)) and {arg(kv, 1, "dim0"), arg(kv, 2, "dim1")} == {1, 2}):
        raise NotAttention("the up-projected keys/values are not transposed from [B, T, H, d]")
    view = kv.args[0]
    if not is_call(view, methods=("view", "reshape")):
        raise NotAttention("the up-projection is not viewed as [B, T, H, d]")
    linear = view.args[0]
    if not is_call(linear, F.linear, torch._C._nn.linear) or arg(linear, 2, "bias") is not None:
        raise NotAttention("the up-projection is not a bias-free linear of the latent")
    latent, weight = linear.args[0], linear.args[1]
    w = meta_tensor(weight)
    if tuple(w.shape) != (heads * width, meta_tensor(latent).shape[-1]):
        raise NotAttention(f"up-projection weight {tuple(w.shape)} != [heads * (nope + v), latent]")
    return latent, weight
