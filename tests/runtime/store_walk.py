"""Bytes of every tensor a LayerCache holds, found by walking its objects, independently of
LayerCache.nbytes (what the accounting tests compare stats() against)."""

import torch

from kvtopo.runtime.codecs import GrowingRows


def held_tensor_bytes(cache) -> int:
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, GrowingRows):  # the rows held; the spare capacity is not counted (see its docstring)
            add(t.tensor)
        elif isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.nbytes
        elif hasattr(t, "__dataclass_fields__"):
            for name in t.__dataclass_fields__:
                add(getattr(t, name))
        elif isinstance(t, (list, tuple)):
            for x in t:
                add(x)
        elif t is not None and hasattr(t, "__dict__") and not isinstance(t, (type, torch.dtype)):
            add(list(vars(t).values()))

    add(cache.pool.keys), add(cache.pool.values)
    for entry in cache.sequences.values():  # pages, block table, observation, every Mid epoch
        add(entry)
    return total
