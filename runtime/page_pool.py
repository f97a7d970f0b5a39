"""A pool of exact KV pages for one layer: fixed-size slots, a free list, bounded growth.

Pages are slots of one pair of big tensors (keys [capacity, Hkv, P, dk], values
[capacity, Hkv, P, dv]), as in paged attention. A freed slot goes back on the free list and is
reused before the pool grows, so pages released by compression really make room. The pool never
hands out a slot that is in use: when it is full and may not grow, `allocate` raises. A caller
holding the pool to a byte budget bounds its growth steps (`spare`) and grows it before a batch
by exactly the slots the batch was admitted for (`reserve`).
"""

from __future__ import annotations

import torch


def updatable():
    """The mode a store buffer that is written in place is allocated in: outside inference mode.
    A session may be stepped under `torch.inference_mode()` and then `torch.no_grad()` (or the
    other way): inference mode may update normal tensors in place, but no other mode may update
    an inference tensor."""
    return torch.inference_mode(False)


class PoolExhausted(RuntimeError):
    """The pool is at its page limit and every page is live."""


def growth_step(capacity: int, need: int, grow_by: int = 1) -> int:
    """Slots a pool of `capacity` adds when it needs `need` more: small steps keep free slots
    (which count as held bytes) few; an eighth of the capacity keeps copies amortised."""
    return max(grow_by, capacity // 8, need)


class PagePool:
    def __init__(
        self,
        kv_heads: int,
        page_size: int,
        key_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_pages: int | None = None,
        grow_by: int = 1,
    ):
        self.page_size = page_size
        self.max_pages = max_pages
        self.grow_by = grow_by
        with updatable():
            self.keys = torch.empty(0, kv_heads, page_size, key_dim, dtype=dtype, device=device)
            self.values = torch.empty(0, kv_heads, page_size, value_dim, dtype=dtype, device=device)
        # One slot's bytes, from the shapes (right before the first slot exists too); a plain
        # attribute, as the store's accounting reads it for every exact page.
        self.page_nbytes = kv_heads * page_size * (key_dim + value_dim) * dtype.itemsize
        self._free: list[int] = []
        self._live: set[int] = set()
        # Pages a growth may add beyond those it needs (None: the step rule alone). A caller that
        # counts free slots against a byte budget sets it to what the budget leaves.
        self.spare: int | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[0]

    @property
    def live_pages(self) -> int:
        return len(self._live)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def allocate(self) -> int:
        if not self._free:
            self._grow(1)
        page = self._free.pop()
        self._live.add(page)
        return page

    def reserve(self, slots: int) -> None:
        """Make at least `slots` slots free, growing now (once) rather than page by page later."""
        if slots > len(self._free):
            self._grow(slots - len(self._free))

    def release(self, page: int) -> None:
        if page not in self._live:
            raise ValueError(f"page {page} is not live in this pool (double free?)")
        self._live.remove(page)
        self._free.append(page)

    def _grow(self, need: int) -> None:
        old = self.capacity
        step = growth_step(old, need, self.grow_by)
        if self.spare is not None:
            step = max(need, min(step, self.spare))
        new = old + step
        if self.max_pages is not None:
            new = min(new, self.max_pages)
        if new - old < need:
            raise PoolExhausted(
                f"KV page pool is full: {old} pages of {self.page_size} tokens, {old - self.live_pages} free, "
                f"{need} needed (max_pages={self.max_pages}); raise max_pages or use a compressing policy"
            )
        grow = new - old
        if self.spare is not None:
            self.spare -= grow - need
        with updatable():
            self.keys = torch.cat([self.keys, self.keys.new_empty(grow, *self.keys.shape[1:])])
            self.values = torch.cat([self.values, self.values.new_empty(grow, *self.values.shape[1:])])
        # Pop order: lowest free slot first.
        self._free.extend(reversed(range(old, new)))
