"""The paged KV history of one attention layer, for every sequence of a session.

Each sequence owns a block table (page ids into the layer's PagePool, an int32 tensor) and a
token count. Sequences only ever read pages through their own block table, so one sequence can
never see another's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .page_pool import PagePool


@dataclass
class SequencePages:
    pages: list[int] = field(default_factory=list)
    block_table: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    length: int = 0


class LayerCache:
    def __init__(self, page_size: int, max_pages: int | None):
        self.page_size = page_size
        self.max_pages = max_pages
        self.pool: PagePool | None = None
        self.sequences: dict[int, SequencePages] = {}

    def _pool_for(self, key: torch.Tensor, value: torch.Tensor) -> PagePool:
        if self.pool is None:
            self.pool = PagePool(
                kv_heads=key.shape[0], page_size=self.page_size, key_dim=key.shape[-1],
                value_dim=value.shape[-1], dtype=key.dtype, device=key.device, max_pages=self.max_pages,
            )
        pool = self.pool
        expected = (pool.keys.shape[1], pool.keys.shape[-1], pool.values.shape[-1], pool.keys.dtype)
        got = (key.shape[0], key.shape[-1], value.shape[-1], key.dtype)
        if got != expected:
            raise ValueError(
                f"k/v of (kv_heads, key_dim, value_dim, dtype)={got} do not match this layer's cache {expected}"
            )
        return pool

    def length(self, seq: int) -> int:
        entry = self.sequences.get(seq)
        return entry.length if entry else 0

    def append(self, seq: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append key [Hkv, n, dk] / value [Hkv, n, dv] to sequence `seq`."""
        n = key.shape[1]
        if n == 0:
            return
        pool = self._pool_for(key, value)
        entry = self.sequences.setdefault(seq, SequencePages())
        P = self.page_size
        written = 0
        while written < n:
            offset = entry.length % P
            if offset == 0:
                entry.pages.append(pool.allocate())
                entry.block_table = torch.tensor(entry.pages, dtype=torch.int32)
            page = entry.pages[-1]
            take = min(P - offset, n - written)
            pool.keys[page, :, offset : offset + take] = key[:, written : written + take]
            pool.values[page, :, offset : offset + take] = value[:, written : written + take]
            entry.length += take
            written += take

    def history(self, seq: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """All stored k [Hkv, L, dk] and v [Hkv, L, dv] of `seq`, or None if it holds nothing."""
        entry = self.sequences.get(seq)
        if entry is None or entry.length == 0:
            return None
        pool = self.pool
        idx = entry.block_table.long()
        keys = pool.keys[idx].transpose(0, 1).flatten(1, 2)[:, : entry.length]
        values = pool.values[idx].transpose(0, 1).flatten(1, 2)[:, : entry.length]
        return keys, values

    def release(self, seq: int) -> None:
        entry = self.sequences.pop(seq, None)
        if entry is not None and self.pool is not None:
            for page in entry.pages:
                self.pool.release(page)

    def nbytes(self) -> dict[str, int]:
        """Bytes held, split into live exact pages, free pool slots and block tables."""
        if self.pool is None:
            return {"exact": 0, "free": 0, "metadata": 0}
        live = self.pool.live_pages * self.pool.page_nbytes
        tables = sum(e.block_table.nbytes for e in self.sequences.values())
        return {"exact": live, "free": self.pool.nbytes - live, "metadata": tables}
