"""Decode steps of one batch of sequences in one layer without Python per sequence.

Most decode steps move no page: each sequence's token lands in its Terminal page (31 steps in 32
at page size 32), so its kernel arguments stay what they were, but for one more exact row.
``DecodeBatch`` keeps the batch's kernel arguments between steps (``BatchArguments``) and the
steps' queries for the observation windows in one ring; in a step where no sequence is due, one
kernel call writes the batch's tokens into the pool, advances the exact counts, scales the
queries and keeps them in the ring (``BatchArguments.step``), then the batch is attended. Each
sequence's counters (its Terminal page's tokens, its length, its window's queries) are deferred
until the sequence moves a page or something else reads the store (``LayerCache.write_back``,
called by every other reader and writer).

A sequence whose token cannot land in place (its Terminal page is full, or the token starts a
Mid epoch) is due at a step known when its arguments are built. At that step it is attended
with its new token as a segment of its own, as ``attend_cache_batch`` does; then its counters
are written back, the token is appended through the lifecycle (its pages move) and its
arguments are rebuilt. So a step costs Python for its due sequences only; the others cost tensor
ops over the whole batch. The outputs and the store are ``Session._decode_batch``'s, bit for bit
(tests/runtime/test_decode_batch.py).

Taken when the C kernel reads every segment of every sequence in place (CPU, float32 or bfloat16
pool, exact pages, Recent codes and an unprojected Mid; no window, no shared values, no policy
that tracks attention mass, no sinks); otherwise, and on CUDA, ``Session`` runs its
per-sequence path."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvtopo.kernels import cpu_decode
from kvtopo.kernels.cpu_decode import BatchArguments

from .decode_view import entry_segments
from .layer_cache import LayerCache, SequenceKV
from .lifecycle import observed_positions


class DecodeBatch:
    """The decode steps of sequences ``seqs`` (batch row b = ``seqs[b]``) in one layer."""

    def __init__(self, cache: LayerCache, seqs: tuple[int, ...], entries: list[SequenceKV], args: BatchArguments,
                 key: tuple, window: int | None):
        self.cache, self.seqs, self.entries, self.args, self.key = cache, seqs, entries, args, key
        self.rows = {seq: b for b, seq in enumerate(seqs)}
        self.pool_keys = cache.pool.keys  # a pool that grows is a new tensor: the arguments point at the old
        self.inference = torch.is_inference_mode_enabled()
        batch, q_heads, head_dim = key[3][0], key[3][1], key[3][3]
        self.step_index = 0
        self.synced_at = [0] * batch  # the step up to which each sequence's counters are written back
        self.due: dict[int, list[int]] = {}  # step -> the sequences whose token cannot land in place then
        # Where each sequence's next token goes in the pool's rows ([slots * Hkv * P, d]), per kv-head.
        self.pool_rows = (cache.pool.keys.view(-1, cache.pool.keys.shape[-1]),
                          cache.pool.values.view(-1, cache.pool.values.shape[-1]))
        self.next_rows = torch.zeros(batch, cache.pool.keys.shape[1], dtype=torch.long)
        self.every_row = torch.ones(batch, dtype=torch.bool)
        # The steps' queries, [window, B, Hq, d] float16 (as a window holds them), step s at s % window.
        self.ring = None if window is None else torch.empty(window, batch, q_heads, head_dim, dtype=torch.float16)
        self.longest = max(entry.length for entry in entries)

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def build(cls, cache: LayerCache, seqs: tuple[int, ...], key: tuple, q: Tensor, k: Tensor, v: Tensor,
              scale: float, softcap: float | None) -> "DecodeBatch | None":
        """The batch, or None when a sequence's history is not read in place by the kernel."""
        pool = cache.pool
        if (cache.window is not None or cache.shared_value_dim or cache.policy.tracks_attention_mass
                or pool is None or pool.keys.device.type != "cpu" or q.device.type != "cpu"
                or pool.keys.dtype not in (torch.float32, torch.bfloat16)
                or not (pool.keys.is_contiguous() and pool.values.is_contiguous())
                or (k.shape[1], k.shape[-1], v.shape[-1], k.dtype) != (pool.keys.shape[1], pool.keys.shape[-1],
                                                                       pool.values.shape[-1], pool.keys.dtype)
                or len(set(seqs)) != len(seqs) or not cpu_decode.c_kernel_available()):
            return None
        entries = [cache.stored_state(seq) for seq in seqs]
        if any(entry is None or not entry.length or not entry.pages for entry in entries):
            return None
        batch, q_heads, _, head_dim = q.shape
        window = None
        if cache.observes:  # the windows take each query in place (see Lifecycle.observe)
            window = observed_positions(cache.config.observation_window, q_heads, k.shape[1])
            if any(e.observation is None or e.observation.shape[1] != window
                   or (e.observation.is_inference() and not torch.is_inference_mode_enabled()) for e in entries):
                return None
        args = BatchArguments(batch, k.shape[1], q_heads // k.shape[1], head_dim, v.shape[-1], scale, softcap)
        made = cls(cache, seqs, entries, args, key, window)
        if not all(made._set_row(b) for b in range(batch)):
            return None
        args.flatten()
        if window is not None:
            for entry in entries:
                entry.chunk_queries = None  # as every decode step's observe does
        return made

    def _set_row(self, b: int) -> bool:
        """Sequence b's arguments, Terminal page and due step, from its written-back state."""
        entry = self.entries[b]
        if not self.args.set_row(b, entry_segments(self.cache, entry)):
            return False
        page, size, head_dim = entry.pages[-1], self.cache.config.page_size, self.cache.pool.keys.shape[-1]
        room = size - page.tokens if page.slot is not None else 0
        # In-place steps before the token that cannot land in place (LayerCache.write_in_place). The
        # k-th token starts an epoch iff appending k tokens at once would, and that only grows with k.
        steps = room
        if room and self.cache.starts_epoch(entry, room, head_dim):
            steps = next(k for k in range(room) if self.cache.starts_epoch(entry, k + 1, head_dim))
        heads = self.next_rows.shape[1]
        self.next_rows[b] = ((page.slot or 0) * heads + torch.arange(heads)) * size + page.tokens
        self.due.setdefault(self.step_index + steps, []).append(b)
        return True

    # -- stepping ------------------------------------------------------------------------------
    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One decode step: q [B, Hq, 1, d], k/v [B, Hkv, 1, d] -> [B, Hq, 1, dv] in q's dtype."""
        index = self.step_index
        due = self.due.pop(index, [])
        ring = None if self.ring is None else self.ring[index % self.ring.shape[0]]
        if not due and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:  # the writes in the kernel's call
            out = self.args.step(q, k, v, self.pool_rows, self.next_rows, ring)
        else:
            rows = None
            if due:
                keep = self.every_row.clone()
                keep[due] = False
                rows = keep.nonzero().squeeze(1)
            if rows is None:
                self._write(self.next_rows, k, v)
                self.next_rows += 1
                self.args.advance()
            elif rows.numel():
                self._write(self.next_rows[rows], k[rows], v[rows])
                self.next_rows[rows] += 1
                self.args.advance(rows)
            out = self.args.attend(q[:, :, 0], [(b, k[b], v[b]) for b in due])
            if ring is not None:
                ring.copy_(q[:, :, 0])
        self.step_index = index + 1
        for b in due:  # written back first, so that an append that raises leaves every count right
            self._write_back(b, written_until=index, observed_until=index + 1)
        for b in due:
            self.cache.append_entry(self.entries[b], k[b], v[b])
        self.longest += 1
        self.cache.reached(self.longest)
        if due:
            if self.cache.pool.keys is not self.pool_keys or not all(self._set_row(b) for b in due):
                self.cache.write_back()  # the pool grew, or a sequence's history is no longer read in place
            else:
                self.args.flatten()
        return out[:, :, None].to(q.dtype)

    def _write(self, next_rows: Tensor, k: Tensor, v: Tensor) -> None:
        """Each sequence's token (k/v [n, Hkv, 1, d]) into its Terminal page's next row."""
        at = next_rows.reshape(-1)
        self.pool_rows[0].index_copy_(0, at, k.reshape(at.numel(), -1))
        self.pool_rows[1].index_copy_(0, at, v.reshape(at.numel(), -1))

    # -- writing back ----------------------------------------------------------------------------
    def deferred(self, seq: int) -> int:
        """Tokens of `seq` written in place and not yet counted in its state."""
        b = self.rows.get(seq)
        return 0 if b is None else self.step_index - self.synced_at[b]

    def write_back(self) -> None:
        """Write every sequence's deferred counters and queries back (the batch ends)."""
        for b in range(len(self.seqs)):
            self._write_back(b, written_until=self.step_index, observed_until=self.step_index)

    def _write_back(self, b: int, written_until: int, observed_until: int) -> None:
        """Sequence b's tokens written in place in steps synced_at[b] .. written_until - 1, and its
        queries of steps synced_at[b] .. observed_until - 1, into its state: what
        ``LayerCache.write_in_place`` and ``Lifecycle.observe`` would have done step by step."""
        entry, start = self.entries[b], self.synced_at[b]
        with torch.inference_mode(self.inference):
            if written_until > start:
                self.cache.count_written(entry, written_until - start)
            if self.ring is not None and observed_until > start:
                window = self.ring.shape[0]
                kept = torch.arange(max(start, observed_until - window), observed_until) % window
                self.cache.observe_steps(entry, self.ring[kept, b].transpose(0, 1), observed_until - start)
        self.synced_at[b] = max(written_until, observed_until)


def decode_step(cache: LayerCache, seqs: Sequence[int], q: Tensor, k: Tensor, v: Tensor, scale: float,
                softcap: float | None) -> Tensor | None:
    """The decode step (q [B, Hq, 1, d], k/v [B, Hkv, 1, d]) of ``seqs`` by the layer's
    ``DecodeBatch``, or None when it cannot take it (the caller runs ``Session._decode_batch``).
    A batch is made at the second step in a row of the same sequences: a caller that steps its
    sequences one call each (``Session.attend_sequence`` in turns) would make one per call."""
    key = (tuple(seqs), scale, softcap, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype)
    batch = cache.decode_batch
    if batch is None or batch.key != key or batch.inference != torch.is_inference_mode_enabled() \
            or cache.pool.keys is not batch.pool_keys:
        cache.write_back()
        if cache.decode_batch_refused > 0:
            cache.decode_batch_refused -= 1
            return None
        if cache.decode_batch_candidate != key:
            cache.decode_batch_candidate = key
            return None
        batch = DecodeBatch.build(cache, key[0], key, q, k, v, scale, softcap)
        if batch is None:  # tried again once its pages have moved
            cache.decode_batch_refused = cache.config.page_size
            return None
        cache.decode_batch = batch
    try:
        return batch.step(q, k, v)
    except BaseException:
        cache.write_back()
        raise
