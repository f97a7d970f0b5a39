"""Where the kvtopo ops find the KV store they attend through.

Kernels do not import the runtime: the runtime enters its session here (runtime/context.py) and
the ops call it through the two methods they need, ``attend`` and ``model_length``. Like vLLM's
forward context, this keeps cache tensors out of the graphs, so a compiled graph is the same
inside and outside a session.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Protocol

import torch


class AttentionStore(Protocol):
    def attend(self, layer: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None, scale: float, **site) -> torch.Tensor: ...

    def model_length(self, model_key: torch.Tensor) -> int: ...


_active: ContextVar[AttentionStore | None] = ContextVar("kvtopo_active_store", default=None)


def active_store() -> AttentionStore | None:
    return _active.get()


def set_active_store(store: AttentionStore | None) -> Token:
    return _active.set(store)


def reset_active_store(token: Token) -> None:
    _active.reset(token)
