"""What the attention-finding passes report: a site they understood, or one they refused."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class AttentionSite:
    """One attention computation, proven equivalent to `kvtopo::attention(query, key, value, ...)`.

    `key`/`value` are kv-head tensors [B, Hkv, S, d] (GQA repeats already walked back), `output`
    is the node whose value the op replaces.
    """

    layer: str
    pattern: str  # "sdpa" or "eager"
    query: fx.Node
    key: fx.Node
    value: fx.Node
    # Each mask with its kind: "bool" (True = attend), "bool_inverted" (True = masked out, as in
    # masked_fill) or "additive". The rewrite folds them into one SDPA-style attn_mask.
    masks: tuple[tuple[fx.Node, str], ...]
    scale: float | fx.Node  # a node: a Python float Dynamo made an input (graph_utils.symbolic_float)
    is_causal: bool
    heads: int
    kv_heads: int
    head_dim: int
    value_head_dim: int
    output: fx.Node
    # Keys a query sees: itself and the `window - 1` before it (HF `sliding_window`); None: all.
    window: int | None = None
    # Logits are `softcap * tanh(logits / softcap)` before the mask and softmax (Gemma-2); None: not capped.
    softcap: float | None = None
    # The parameter [Hq] of per-head attention sinks (gpt-oss): one more logit in every row's
    # softmax whose column is dropped before the value matmul; None: no sinks.
    sinks: fx.Node | None = None

    def describe(self) -> str:
        kinds = "+".join(kind for _, kind in self.masks)
        mask = "causal" if self.is_causal else (f"{kinds} mask" if self.masks else "no mask")
        extras = (f" window={self.window}" if self.window else "") + (f" softcap={self.softcap:g}" if self.softcap else "")
        extras += " sinks" if self.sinks is not None else ""
        return (f"{self.layer}: {self.pattern}, heads={self.heads} kv_heads={self.kv_heads} "
                f"head_dim={self.head_dim} v_head_dim={self.value_head_dim} scale={format_scale(self.scale)} {mask}{extras}")


def format_scale(scale) -> str:
    """A site's scale for its report: a number, or the graph input Dynamo made of it (a second
    model whose scale differs)."""
    return str(scale) if isinstance(scale, fx.Node) else format(scale, ".4g")


@dataclass(frozen=True)
class Refusal:
    """An attention-like pattern left untouched, and why."""

    layer: str
    pattern: str
    node: str
    reason: str

    def describe(self) -> str:
        return f"{self.layer}: {self.pattern} at node {self.node!r} refused: {self.reason}"


class NotAttention(Exception):
    """Raised inside a matcher when a candidate cannot be proven to be plain attention."""
