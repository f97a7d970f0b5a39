"""A kvtopo session: one KV store shared by every kvtopo attention call made inside it.

Batch row b of every call is sequence b of the session. Each call of `attend` gathers the layer's
stored history for each sequence, attends over [history ; new chunk] (causal within the chunk),
then appends the chunk's new k/v. Tokens marked invalid for the current step (left padding) are
neither attended to nor stored.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvtopo.config import Config
from kvtopo.kernels.reference import chunk_causal_mask, grouped_attention

from . import context
from .layer_cache import LayerCache


@dataclass(frozen=True)
class CacheStats:
    """Bytes held by the session's KV tensors (pool slots, encoded pages, block tables)."""

    total_bytes: int
    per_layer: dict[str, int]
    per_kind: dict[str, int]
    tokens: tuple[int, ...]
    fp16_bytes: int

    @property
    def ratio_vs_fp16(self) -> float:
        """How many times smaller than an fp16 cache of the same tokens (inf when empty)."""
        return self.fp16_bytes / self.total_bytes if self.total_bytes else float("inf")


class Session:
    def __init__(self, config: Config | None = None):
        self.config = config if config is not None else Config()
        self.layers: dict[str, LayerCache] = {}
        self._layer_shapes: dict[str, tuple[int, int, int]] = {}
        self._batch: int | None = None
        self._step_valid: torch.Tensor | None = None
        self._token = None
        self.calls = 0

    # -- lifetime -----------------------------------------------------------------------------
    def __enter__(self) -> "Session":
        if self._token is not None:
            raise RuntimeError("this kvtopo session is already active")
        self._token = context.enter(self)
        return self

    def __exit__(self, *exc) -> None:
        context.leave(self._token)
        self._token = None

    @property
    def active(self) -> bool:
        return self._token is not None

    def clear(self) -> None:
        """Forget every sequence and free all their pages."""
        for cache in self.layers.values():
            for seq in list(cache.sequences):
                cache.release(seq)
        self._batch = None

    @contextmanager
    def step(self, valid: torch.Tensor):
        """Mark which tokens of the next forward's chunk are real ([B, T] bool; False = padding)."""
        if valid.dtype != torch.bool or valid.dim() != 2:
            raise ValueError(f"step validity must be a [batch, tokens] bool tensor, got {valid.dtype} {tuple(valid.shape)}")
        self._step_valid = valid
        try:
            yield
        finally:
            self._step_valid = None

    # -- the op's entry point -------------------------------------------------------------------
    def attend(self, layer: str, query, key, value, attn_mask, scale: float) -> torch.Tensor:
        if not self.active:
            raise RuntimeError("kvtopo session used after it was closed")
        batch, _, chunk, _ = query.shape
        if self._batch is None:
            self._batch = batch
        elif batch != self._batch:
            raise ValueError(
                f"this session holds {self._batch} sequences but the call has batch {batch}; "
                "use one session per batch (or session.clear())"
            )
        valid = self._step_valid
        if valid is not None and tuple(valid.shape) != (batch, chunk):
            raise ValueError(f"step validity has shape {tuple(valid.shape)}, the call has (batch, tokens)=({batch}, {chunk})")
        _check_pure_mask(layer, attn_mask)
        cache = self.layers.get(layer)
        if cache is None:
            cache = self.layers[layer] = LayerCache(self.config.page_size, self.config.max_pages)
        self.calls += 1

        out = query.new_zeros(*query.shape[:-1], value.shape[-1])
        for b in range(batch):
            rows = None if valid is None or bool(valid[b].all()) else valid[b].nonzero().squeeze(1)
            q, k, v = query[b], key[b], value[b]
            if rows is not None:
                q, k, v = q[:, rows], k[:, rows], v[:, rows]
            out_b = self._attend_one(cache, b, q, k, v, scale)
            if rows is None:
                out[b] = out_b
            else:
                out[b, :, rows] = out_b
        return out

    def _attend_one(self, cache: LayerCache, seq: int, q, k, v, scale: float) -> torch.Tensor:
        history = cache.history(seq)
        if history is None:
            keys, values, past = k, v, 0
        else:
            keys = torch.cat([history[0], k], dim=1)
            values = torch.cat([history[1], v], dim=1)
            past = history[0].shape[1]
        mask = chunk_causal_mask(past, q.shape[1], device=q.device)
        out = grouped_attention(q[None], keys[None], values[None], mask, scale)[0]
        cache.append(seq, k, v)
        return out

    # -- accounting ------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        per_layer, per_kind, fp16 = {}, {}, 0
        tokens: list[int] = []
        for name, cache in self.layers.items():
            kinds = cache.nbytes()
            per_layer[name] = sum(kinds.values())
            for kind, n in kinds.items():
                per_kind[kind] = per_kind.get(kind, 0) + n
            if cache.pool is not None:
                heads, kd, vd = cache.pool.keys.shape[1], cache.pool.keys.shape[-1], cache.pool.values.shape[-1]
                fp16 += sum(e.length for e in cache.sequences.values()) * heads * (kd + vd) * 2
        if self.layers:
            first = next(iter(self.layers.values()))
            tokens = [first.length(s) for s in range(self._batch or 0)]
        return CacheStats(sum(per_layer.values()), per_layer, per_kind, tuple(tokens), fp16)


def _check_pure_mask(layer: str, attn_mask: torch.Tensor | None) -> None:
    """Inside a session the graph's mask is replaced by the session's own causal/padding mask.

    That is only sound when the mask is a pure mask (bool, or additive 0 / very negative), not an
    additive positional bias, so a bias is refused here rather than silently dropped.
    """
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return
    if not bool(((attn_mask == 0) | (attn_mask <= -1e4)).all()):
        raise ValueError(
            f"attention site {layer!r} adds a float tensor that is not a 0/-inf mask (a positional bias?); "
            "a kvtopo session cannot carry it into the cached history"
        )
