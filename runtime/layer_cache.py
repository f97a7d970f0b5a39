"""The paged, phased KV history of one attention layer, for every sequence of a session.

Each sequence is a list of pages of `page_size` tokens. A page is exact in the layer's PagePool
while it is Initial or Terminal (and Recent/Mid when the policy leaves them exact); when the
lifecycle (runtime/lifecycle.py decides, runtime/phases.py plans) moves it to Recent or Mid it
is re-encoded once (runtime/codecs.py) and its pool slot is released for reuse. A sequence only reads its own pages, through its own
block table (int32 pool slots of its exact pages), so sequences never see each other's tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.nn.utils.rnn import pad_sequence

from kvtopo.config import Config
from kvtopo.kernels.decode_inputs import pool_rows

from .codecs import (MidSegment, RecentPage, decode_recent_pages, encode_recent, encode_recent_pages, fit_bases,
                     recent_page_at)
from .lifecycle import Lifecycle, PageState, SequenceState, budget_bytes, check_value_energy, page_room
from .page_pool import PagePool
from .phases import Phase
from .policies import Policy, ScoreInputs


def best_tokens(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Indices [H, keep] of the `keep` highest scores per row [H, n], ascending; equal scores
    go to the lower index (scores carried forward from a hit tie across the tokens after it,
    and the earliest of those is the one read first; the exported compressor does the same)."""
    return scores.argsort(dim=-1, descending=True, stable=True)[:, :keep].sort(dim=-1).values


def _gather(kv: tuple[torch.Tensor, torch.Tensor | None], index: torch.Tensor, dim: int = 1):
    """Tokens `index` (along `dim`, the token dim) of keys and values (None stays None)."""
    return tuple(None if x is None else x.gather(dim, index[..., None].expand(*index.shape, x.shape[-1]))
                 for x in kv)


@dataclass
class Page(PageState):
    slot: int | None = None  # exact pool slot, while the page is stored exactly
    recent: RecentPage | None = None
    mass: torch.Tensor | None = None  # [Hkv, tokens] accumulated attention mass (policies that track it)

    def nbytes(self, slot_nbytes: int) -> int:
        """Bytes the page holds outside Mid: a Terminal page costs a full exact slot, also while
        it is opening and has none yet."""
        if self.slot is not None or self.phase is Phase.TERMINAL:
            return slot_nbytes
        return self.recent.nbytes if self.recent else 0

    def __setattr__(self, name: str, value) -> None:
        """Keep the sequence's `PageBytes` (once the page is counted there) in step with every
        assignment that changes what the page holds, whoever makes it."""
        count = self.__dict__.get("_count") if name in _COUNTED_FIELDS else None
        if count is not None:
            count.remove(self)
        object.__setattr__(self, name, value)
        if count is not None:
            count.add(self)


# The Page fields whose assignment changes the page's bytes (its phase moves them between kinds).
_COUNTED_FIELDS = frozenset({"phase", "slot", "recent", "mass"})


class PageBytes:
    """The bytes one sequence-layer's pages hold outside Mid, by phase, and their attention mass.

    Counted as they change (`Page.__setattr__`: the lifecycle moves phases, this store gives and
    frees slots and Recent codes, the session accumulates mass), so that accounting, read on every
    serving step and for every page entering Mid, never walks a sequence's pages. Pages are
    counted from when they are given storage (`track`); one still opening is Terminal and costs
    a slot (`Page.nbytes`)."""

    def __init__(self):
        self.by_phase = dict.fromkeys(Phase, 0)
        self.mass = 0
        self.pages = 0  # pages counted: the first `pages` of the sequence
        self.slot_nbytes = 0  # the layer pool's, known once it exists

    @property
    def total(self) -> int:
        """Bytes of the counted pages outside Mid (their attention mass is metadata)."""
        return sum(self.by_phase.values())

    def track(self, page: Page, slot_nbytes: int) -> None:
        self.slot_nbytes = slot_nbytes
        object.__setattr__(page, "_count", self)
        self.pages += 1
        self.add(page)

    def add(self, page: Page) -> None:
        self.by_phase[page.phase] += page.nbytes(self.slot_nbytes)
        self.mass += page.mass.nbytes if page.mass is not None else 0

    def remove(self, page: Page) -> None:
        self.by_phase[page.phase] -= page.nbytes(self.slot_nbytes)
        self.mass -= page.mass.nbytes if page.mass is not None else 0


@dataclass
class Moves:
    """The tensor work of the page moves one append makes, done together when it ends
    (`LayerCache._flush`): a long prefill chunk moves hundreds of pages, and page by page their
    encodings cost more in op dispatch than in arithmetic."""

    recent: list = field(default_factory=list)  # (page, keys, values): exact tokens of pages now Recent
    mid: list = field(default_factory=list)  # (source, kept [Hkv, keep]): planned pages entering Mid;
    # source is (keys, values), or the index in `recent` of a page encoded in this append
    _recent_index: dict = field(default_factory=dict)  # id(page) -> its index in `recent`
    decoded: dict = field(default_factory=dict)  # id(page) -> (keys, values) of Recent pages the plan decoded

    def add_recent(self, page: "Page", keys: torch.Tensor, values: torch.Tensor | None) -> None:
        self._recent_index[id(page)] = len(self.recent)
        self.recent.append((page, keys, values))

    def recent_index(self, page: "Page") -> int | None:
        return self._recent_index.get(id(page))


def held_credit_nbytes(kv_heads: int) -> int:
    """Bytes `SequenceKV.held_credit` keeps per waiting token: its int64 position and a float32
    credit per kv-head (what a byte budget must leave room for while a prompt's pages wait)."""
    return 8 + 4 * kv_heads


@dataclass
class SequenceKV(SequenceState):
    _block_table: torch.Tensor | None = None  # `block_table` as last built; None: rebuild at the next read
    retired: list[MidSegment] = field(default_factory=list)  # earlier Mid epochs, each with its bases
    planned: dict[int, torch.Tensor] = field(default_factory=dict)  # page index -> kept tokens [Hkv, keep]
    dropped: int = 0  # tokens of the leading pages released because they left the sliding window
    evicted: int = 0  # tokens of the pages in Mid that were not kept
    moves: Moves = field(default_factory=Moves)  # pending until the append ends
    # (positions [m] int64, credit [Hkv, m] float32: `held_credit_nbytes`) that the chunks of a
    # prompt whose pages wait gave its tokens (`Policy.held_credit`), for the ranking at its end
    held_credit: list = field(default_factory=list)
    page_bytes: PageBytes = field(default_factory=PageBytes)

    @property
    def block_table(self) -> torch.Tensor:
        """The pool slots of the pages that hold one, in page order (int32). Built when first read
        after `slots_changed`: rebuilt at every change instead (a walk over every page), a prefill
        chunk walked the whole sequence once per page it opened or moved."""
        if self._block_table is None:
            self._block_table = torch.tensor([p.slot for p in self.pages if p.slot is not None], dtype=torch.int32)
        return self._block_table

    def slots_changed(self) -> None:
        self._block_table = None


@dataclass
class Segments:
    """One sequence's history, grouped by how it is stored, ready for attention."""

    exact: tuple[torch.Tensor, torch.Tensor] | None
    recent: tuple[torch.Tensor, torch.Tensor] | None
    mid: tuple | None  # (LowRankHeads, LowRankHeads) if projected, else dense (keys, values)
    mid_projected: bool
    retired: tuple[tuple, ...] = ()  # earlier Mid epochs, each (LowRankHeads, LowRankHeads)

    @property
    def only_exact(self) -> bool:
        return self.recent is None and self.mid is None and not self.retired


class LayerCache(Lifecycle):
    """The lifecycle (runtime/lifecycle.py) over torch storage: pool slots, codecs, block tables."""

    def __init__(self, config: Config, policy: Policy, shared_value_dim: int | None = None,
                 window: int | None = None, reported_budget: Config | None = None):
        """`shared_value_dim`: values are the first that many dims of the keys and are not
        stored (MLA: the cached latent is both key and value). `window`: a sliding-window
        layer, whose queries see only the last `window` tokens: pages that leave the window go
        back to the pool (the session gives such layers an exact policy, and its own config as
        `reported_budget`: the budget `over_budget` reports against, never enforced here)."""
        super().__init__(config, policy)
        self.reported_budget = reported_budget
        check_value_energy(config, self.mid_encoding, bool(shared_value_dim))
        self.shared_value_dim = shared_value_dim
        self.window = window
        self.pool: PagePool | None = None
        self._sequences: dict[int, SequenceKV] = {}
        self.scale: float | None = None
        self.softcap: float | None = None
        # The batch whose decode steps run without Python per sequence (runtime/decode_batch.py);
        # it defers its sequences' counters, so every read of the store writes it back first.
        self.decode_batch = None
        self.decode_batch_refused = 0  # decode steps to run without one before trying to make one again
        self.decode_batch_candidate = None  # the last decode step's batch (runtime/decode_batch.decode_step)
        self._longest = 0  # the longest sequence's length
        self.columns = 0  # the batch's tokens attended through `Session.attend`, padding included (HF's cache length)

    @property
    def sequences(self) -> dict[int, SequenceKV]:
        """Every sequence's state, with a decode batch's deferred counters written back."""
        self.write_back()
        return self._sequences

    def write_back(self) -> None:
        """Write back what the current decode batch deferred, and end it."""
        batch, self.decode_batch = self.decode_batch, None
        if batch is not None:
            batch.write_back()

    # -- writing -------------------------------------------------------------------------------
    def _pool_for(self, key: torch.Tensor, value: torch.Tensor) -> PagePool:
        if self.pool is None:
            self.pool = PagePool(
                kv_heads=key.shape[0], page_size=self.config.page_size, key_dim=key.shape[-1],
                value_dim=value.shape[-1], dtype=key.dtype, device=key.device, max_pages=self.config.max_pages,
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
        """Tokens of `seq` stored (counting those a decode batch has not written back yet)."""
        entry = self._sequences.get(seq)
        if entry is None:
            return 0
        return entry.length + (self.decode_batch.deferred(seq) if self.decode_batch is not None else 0)

    def page_count(self, seq: int) -> int:
        """Pages `seq` has opened (0: none); a decode batch defers no page, so this reads without
        writing it back."""
        entry = self._sequences.get(seq)
        return len(entry.pages) if entry is not None else 0

    def longest(self) -> int:
        """The longest sequence's length (0 when none): read by every forward for positions,
        so kept as sequences grow instead of looking at each."""
        return self._longest

    def reached(self, length: int) -> None:
        """A sequence is `length` tokens long now (a decode batch's deferred counters say so)."""
        self._longest = max(self._longest, length)

    def _entry(self, seq: int) -> SequenceKV:
        """Sequence `seq`'s state, made on first use (not `setdefault`: a SequenceKV is not free
        to build, and decode steps look one up in every layer)."""
        entry = self._sequences.get(seq)
        if entry is None:
            entry = self._sequences[seq] = SequenceKV()
        return entry

    def observe(self, seq: int, queries: torch.Tensor, kv_heads: int) -> None:
        self.write_back()
        super().observe(self._entry(seq), queries, kv_heads)

    def append(self, seq: int, key: torch.Tensor, value: torch.Tensor, prompt_end: int = 0) -> None:
        """Append key [Hkv, n, dk] / value [Hkv, n, dv] to `seq`, then move pages through phases.
        `prompt_end`: the length the prompt this chunk belongs to reaches (0: this append's end)."""
        self.write_back()
        entry = self._entry(seq)
        entry.prompt_end = prompt_end
        self.append_entry(entry, key, value)

    def append_entry(self, entry: SequenceKV, key: torch.Tensor, value: torch.Tensor) -> None:
        """`append` to a sequence's state (a decode batch appends its due sequences here, each
        written back first, without writing back the others)."""
        n = key.shape[1]
        if n == 0:
            return
        self._pool_for(key, value)
        self.start_append(entry, n, key.shape[-1], (key, value))
        if self.config.eviction_scope == "append":
            entry.planned = self._plan_joint_eviction(entry, key, value)
        try:
            self.write(entry, n, (key, value))
        finally:
            self._flush(entry)
            entry.planned = {}
            if not entry.holding:  # the tokens it was kept for are in Mid, or ranked when in no joint plan
                entry.held_credit = []
        if self.window is not None:
            self._drop_outside_window(entry)
        self.reached(entry.length)

    def write_in_place(self, seqs: list[int], key: torch.Tensor, value: torch.Tensor) -> list[int]:
        """Write the one token of each of the distinct sequences `seqs` (key/value [B, Hkv, 1, d])
        that lands in its sequence's Terminal page with room left and starts no Mid epoch: it
        moves no page (at page size 32, 31 decode steps in 32), so one indexed copy into the pool
        is all `append` would do for it. Returns the rows it did not write, in order; the caller
        `append`s those. A serving batch appends every decode step of a layer here, so the cost
        per step is not a Python walk of the lifecycle per sequence."""
        self.write_back()
        if len(set(seqs)) != len(seqs) or key.shape[0] != len(seqs) or key.shape[2] != 1:
            raise ValueError(f"a decode append takes one token for each distinct sequence, got ids {seqs} "
                             f"for keys of shape {tuple(key.shape)}")
        P = self.config.page_size
        plain = self.window is None and not self.shared_value_dim  # no window drops, values stored
        rows, slots, offsets, entries, rest = [], [], [], [], []
        for i, seq in enumerate(seqs):
            entry = self._sequences.get(seq)
            page = entry.pages[-1] if entry is not None and entry.pages else None
            if (plain and page is not None and page.slot is not None and page.tokens < P
                    and not self.starts_epoch(entry, 1, key.shape[-1])):
                rows.append(i)
                slots.append(page.slot)
                offsets.append(page.tokens)
                entries.append(entry)
            else:
                rest.append(i)
        if not rows:
            return rest
        self._pool_for(key[rows[0]], value[rows[0]])  # checks shapes and dtype against the layer's pool
        if len(rows) == 1:  # one sequence: a plain slice, no index tensors
            (slot,), (offset,), (row,) = slots, offsets, rows
        else:
            slot, offset, row = torch.tensor(slots), torch.tensor(offsets), rows
        self.pool.keys[slot, :, offset] = key[row, :, 0]
        self.pool.values[slot, :, offset] = value[row, :, 0]
        for entry in entries:
            self.count_written(entry, 1)
        return rest

    def count_written(self, entry: SequenceKV, tokens: int) -> None:
        """`tokens` decode tokens written into the sequence's Terminal page in place (by
        `write_in_place`, or by a decode batch's one copy per step): all `append` would do for them."""
        entry.pages[-1].tokens += tokens
        entry.length += tokens
        entry.final_length = entry.length
        self.reached(entry.length)

    # -- the lifecycle's hooks -----------------------------------------------------------------
    def _new_page(self) -> Page:
        return Page(Phase.TERMINAL)

    def _page_opened(self, entry: SequenceKV, page: Page) -> None:
        page.slot = self.pool.allocate()  # first: a full pool raises before the page is counted
        entry.page_bytes.track(page, self.pool.page_nbytes)
        entry.slots_changed()

    def _write_tokens(self, entry: SequenceKV, page: Page, chunk, start: int, count: int) -> None:
        key, value = chunk
        self.pool.keys[page.slot, :, page.tokens: page.tokens + count] = key[:, start: start + count]
        self.pool.values[page.slot, :, page.tokens: page.tokens + count] = value[:, start: start + count]

    def _settled(self, entry: SequenceKV) -> None:
        entry.slots_changed()

    def _encode_recent(self, entry: SequenceKV, page: Page) -> None:
        """Deferred to the append's end (`_flush`); the exact tokens are copied now, before the
        page's slot is reused."""
        entry.moves.add_recent(page, *self._page_kv(page))

    def _enter_mid(self, entry: SequenceKV, index: int) -> int:
        """A page of the joint plan: deferred to the append's end (`_flush`), its survivors are
        known. Any other: its survivors depend on the bytes held now, so the pending moves are
        made first and the page is encoded at once."""
        page = entry.pages[index]
        kept = entry.planned.get(index)
        if kept is None:
            self._flush(entry)
            keys, values = self._evict(entry, index, *self._page_kv(page))
            entry.mid.append_page(keys, values)
            count = keys.shape[1]
        else:
            source = entry.moves.recent_index(page)
            if source is None:  # not encoded in this append: a Recent page as the plan decoded it, else read now
                source = entry.moves.decoded.pop(id(page), None) or self._page_kv(page)
            entry.moves.mid.append((source, kept))
            count = kept.shape[1]
        page.recent, page.mass = None, None
        entry.evicted += page.tokens - count
        return count

    def _flush(self, entry: SequenceKV) -> None:
        """Make the pending moves (`Moves`): Recent codes of the pages that went to Recent, in
        one batch; then the pages that entered Mid under the plan, gathered and encoded in one
        batch (the ones encoded Recent in this append from their decoded codes, as page by
        page). The codes are the ones page-by-page encoding gives (`encode_recent_pages`,
        `MidSegment.append_pages`)."""
        moves, entry.moves = entry.moves, Moves()
        decoded = self._encode_recent_batch(moves.recent)
        if moves.mid:
            sources = [decoded(s) if isinstance(s, int) else s for s, _ in moves.mid]
            self._enter_mid_batch(entry, sources, [kept for _, kept in moves.mid])

    def _encode_recent_batch(self, records: list):
        """Recent codes of the pages in `records` (page, keys, values); those still Recent keep
        them. Returns i -> record i's decoded (keys, values)."""
        if not records:
            return None
        stacked = None
        if len(records) > 1 and len({k.shape for _, k, _ in records}) == 1:
            values = None if self.shared_value_dim else torch.stack([v for _, _, v in records])
            stacked = encode_recent_pages(torch.stack([k for _, k, _ in records]), values, self.recent_bits)
        if stacked is None:
            pages = [encode_recent(k, v, self.recent_bits) for _, k, v in records]
            for (page, _, _), recent in zip(records, pages):
                page.recent = recent if page.phase is Phase.RECENT else None
            return lambda i: pages[i].decode()
        for i, (page, _, _) in enumerate(records):
            if page.phase is Phase.RECENT:
                page.recent = recent_page_at(stacked, i)
        decode = functools.cache(stacked.decode)  # all pages at once, if any page needs it
        return lambda i: tuple(None if x is None else x[i] for x in decode())

    def _enter_mid_batch(self, entry: SequenceKV, sources: list, kept: list[torch.Tensor]) -> None:
        """Append the survivors `kept` [Hkv, keep] of pages with tokens `sources` (keys, values)
        to the Mid epoch, in page order."""
        if len({k.shape for k, _ in sources}) > 1:
            for (keys, values), rows in zip(sources, kept):
                entry.mid.append_page(*_gather((keys, values), rows))
            return
        index = pad_sequence([rows.t() for rows in kept], batch_first=True).transpose(1, 2)  # [B, Hkv, K]
        keys = torch.stack([k for k, _ in sources])
        values = None if self.shared_value_dim else torch.stack([v for _, v in sources])
        entry.mid.append_pages(*_gather((keys, values), index, dim=2), [rows.shape[1] for rows in kept])

    def _release_exact(self, entry: SequenceKV, page: Page) -> None:
        if page.slot is not None:
            self.pool.release(page.slot)
            page.slot = None

    def _drop_outside_window(self, entry: SequenceKV) -> None:
        """Release the leading pages no later query can see: the next query is at index
        `length` or later and sees keys after `length - window`."""
        first_visible = entry.length - self.window + 1
        P = self.config.page_size
        dropped = entry.dropped
        for index in range(dropped // P, len(entry.pages) - 1):  # the dropped pages are the first, full ones
            if (index + 1) * P > first_visible:
                break
            page = entry.pages[index]
            if page.slot is not None:
                self.pool.release(page.slot)
            page.slot, page.recent, page.dropped = None, None, True
            entry.dropped += page.tokens
        if entry.dropped != dropped:
            entry.slots_changed()

    def first_held(self, seq: int) -> int:
        """Index of the first token still held (tokens before it left a sliding window)."""
        entry = self._sequences.get(seq)
        return entry.dropped if entry else 0

    def held_tokens(self, seq: int) -> int:
        """Tokens whose keys/values are held in any form (not evicted, not out of the window)."""
        entry = self._sequences.get(seq)
        if entry is None:
            return 0
        return self.length(seq) - entry.dropped - entry.evicted

    def sequence_ids(self) -> list[int]:
        """The sequences this layer holds, in the order they came."""
        return list(self._sequences)

    def stored_state(self, seq: int) -> SequenceKV | None:
        """`seq`'s state without writing a decode batch back: its pages, slots, Mid epochs and
        refit point are current; its length, its Terminal page's token count and its observation
        window may lag by the batch's steps (`length` is current). For accounting read on
        every serving step; `sequences` for anything else."""
        return self._sequences.get(seq)

    def page_keys(self, page: Page) -> torch.Tensor:
        return self._page_kv(page)[0]

    def _page_kv(self, page: Page) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A page's keys and values (values None when they are shared with the keys)."""
        if page.slot is not None:
            keys = self.pool.keys[page.slot, :, : page.tokens].clone()
            values = None if self.shared_value_dim else self.pool.values[page.slot, :, : page.tokens].clone()
            return keys, values
        return page.recent.decode()

    def _new_mid_epoch(self, entry: SequenceKV, chunk) -> None:
        """A Mid epoch. Its bases are fitted on the exact and Recent pages held plus the chunk
        being appended (for the first epoch, when its first page is about to reach Mid: the
        whole first prefill chunk, not just the first few pages). The epoch before it, if
        any, is retired: its rows stay readable under its own bases."""
        new_keys, new_values = chunk
        if entry.mid is not None:
            entry.retired.append(entry.mid)
        key_bases = value_bases = None
        if self.mid_encoding.project:
            held = [self._page_kv(p) for p in entry.pages if p.slot is not None or p.recent is not None]
            held.append((new_keys, new_values))
            key_bases = fit_bases(torch.cat([k for k, _ in held], dim=1), self.config.key_energy)
            if not self.shared_value_dim:
                value_bases = fit_bases(torch.cat([v for _, v in held], dim=1), self.config.value_energy)
        entry.mid = MidSegment(self.mid_encoding, key_bases, value_bases, self.pool.keys.dtype, self.shared_value_dim)

    # -- budget and eviction -------------------------------------------------------------------
    def fp16_token_bytes(self) -> int:
        return self.pool.keys.shape[1] * (self.pool.keys.shape[-1] + self.pool.values.shape[-1]) * 2

    def mid_page_nbytes(self, entry: SequenceKV, tokens: int) -> int:
        values = 0 if self.shared_value_dim else self.pool.values.shape[-1]
        return entry.mid.page_nbytes(tokens, self.pool.keys.shape[1], self.pool.keys.shape[-1], values)

    def _plan_joint_eviction(self, entry: SequenceKV, key: torch.Tensor, value: torch.Tensor) -> dict:
        """Survivors of the pages this append moves into Mid, chosen together (eviction_scope
        "append"): every token of the group is scored against one row max, and the room the
        budget leaves at the append's end goes to the highest-scoring tokens wherever they are,
        so a page holding what the latest queries look for keeps all of it and filler pages
        keep little. Within a page each kv-head keeps its own best tokens; a page's count is
        set by the heads' best score at each rank, as the policy makes heads comparable
        (`Policy.across_heads`). {page index: kept token indices}; empty
        when nothing is ranked (no budget, or every Mid token dropped) or only one page moves
        (it is ranked alone, as under "page")."""
        length = self.budget_length(entry)
        budget = self.budget(length)
        if not self.mid_encoding.evict or budget is None or self.mid_encoding.max_tokens == 0:
            return {}
        if entry.holding:
            self._keep_held_credit(entry, key, value)
            return {}
        P = self.config.page_size
        count = -(-entry.final_length // P)
        # Pages are settled as they open, so unless some wait in Recent (`Lifecycle.holds`) the Mid
        # pages now are the plan's for len(pages): a decode step (at most one page moving) stops
        # here without walking every page.
        if entry.held_from is None and self.plan.mid_pages(count) - self.plan.mid_pages(len(entry.pages)) < 2:
            return {}
        group = [i for i in range(count) if (i >= len(entry.pages) or entry.pages[i].phase is not Phase.MID)
                 and self.plan.phase(i, count) is Phase.MID]
        if len(group) < 2:
            return {}
        keys, values, mass = self._group_tokens(entry, group, key, value)
        # The chunk's queries that come after the group's last token (all, unless Recent is short).
        chunk = self.chunk_queries_after(entry, (group[-1] + 1) * P, keys.shape[0])
        positions = (torch.tensor(group)[:, None] * P + torch.arange(P)).flatten()
        scores = self.policy.score(ScoreInputs(keys, values, entry.observation, self.scale, mass, chunk,
                                               entry.chunk_queries, self.predecessor_rows(entry, positions),
                                               self._held_credit_at(entry, positions), softcap=self.softcap)).float()
        order = scores.view(scores.shape[0], len(group), P).sort(dim=-1, descending=True, stable=True)
        # Value of a page's k-th survivor: the best of the heads' k-th best scores (falls with k,
        # so taking the best values overall takes a prefix of every page's ranking). The max,
        # not the sum: a token one retrieval head needs is needed, whatever the other heads say.
        gain = self.policy.across_heads(order.values).amax(0).flatten()
        picked = gain.argsort(descending=True, stable=True)
        # Every page costs its row count; its first survivor (rank 0) also brings its
        # statistics; each further one, a row.
        empty, first, per_row = self.mid_row_costs(entry)
        cost = len(group) * empty + torch.cumsum(torch.where(picked % P == 0, first, per_row), 0)
        held = self._bytes_beside_group(entry, count)
        # The group's share of the room: its tokens among those entering Mid until `length` (the
        # prompt's end when the caller said it, else this append's end: the group alone).
        room = page_room(budget, held, held - self.mid_nbytes(entry), len(group) * P,
                         self.mid_tokens_coming(entry, length), self.config, self.fp16_token_bytes())
        # Pages that keep no token still cost their Mid bytes (`empty` each): under "raise" the
        # room must hold that much, or the store would end over budget without raising.
        if room < len(group) * empty and self.config.over_budget == "raise":
            raise self.budget_exceeded(budget, length, held, self.mid_nbytes(entry), len(group), len(group) * empty,
                                       settled=True)
        taken = int((cost <= room).sum())  # cost only grows along `picked`
        keep = torch.bincount(picked[:taken] // P, minlength=len(group))
        if self.mid_encoding.max_tokens is not None:
            keep = keep.clamp(max=self.mid_encoding.max_tokens)
        # Each page's kept tokens, ascending: mark the first keep[g] of its ranking, then sort the
        # marked token indices ahead of the others (which read P).
        ranks = torch.arange(P, device=keep.device)
        marked = torch.zeros_like(order.indices, dtype=torch.bool).scatter_(
            -1, order.indices, (ranks < keep[:, None]).expand_as(order.indices))
        tokens = torch.where(marked, ranks, P).sort(dim=-1).values
        return {i: tokens[:, g, :n] for (g, i), n in zip(enumerate(group), keep.tolist())}

    def _keep_held_credit(self, entry: SequenceKV, key: torch.Tensor, value: torch.Tensor) -> None:
        """While the append holds (`Lifecycle.holds`): the credit only its queries can give its
        tokens (`Policy.held_credit`), kept for the ranking at the prompt's end. Tokens of Initial
        pages (sinks, protected spans) are never ranked, so they take no part."""
        P, start = self.config.page_size, entry.length
        count = -(-entry.final_length // P)
        ranked = torch.tensor([self.plan.phase(i, count) is not Phase.INITIAL for i in range(start // P, count)])
        positions = torch.arange(start, entry.final_length)
        positions = positions[ranked[positions // P - start // P]]
        if positions.numel() == 0:
            return
        local = positions - start
        values = key[..., : self.shared_value_dim] if self.shared_value_dim else value
        credit = self.policy.held_credit(ScoreInputs(
            key[:, local], values[:, local], entry.observation, self.scale, predecessor_queries=entry.chunk_queries,
            predecessor_rows=self.predecessor_rows(entry, positions),
            # The ranking that ends the wait: at the prompt's end, or once prompt_hold_tokens wait.
            ranked_with=min(self.mid_tokens_coming(entry, self.budget_length(entry)), self.config.prompt_hold_tokens),
            softcap=self.softcap))
        if credit is not None:
            entry.held_credit.append((positions, credit.float()))

    @staticmethod
    def _held_credit_at(entry: SequenceKV, positions: torch.Tensor) -> torch.Tensor | None:
        """[Hkv, n]: the credit kept for `positions` (ascending) while the prompt's pages waited
        (`_keep_held_credit`), NaN where none; None when none was kept."""
        out = None
        for where, credit in entry.held_credit:
            if out is None:
                out = credit.new_full((credit.shape[0], positions.numel()), float("nan"))
            index = torch.searchsorted(positions, where).clamp(max=positions.numel() - 1)
            found = positions[index] == where
            out[:, index[found]] = credit[:, found]
        return out

    def _group_tokens(self, entry: SequenceKV, group: list[int], key: torch.Tensor, value: torch.Tensor):
        """Keys, values (the keys' leading dims when shared) and accumulated attention mass (None
        unless every page has it) of the group's pages, in order: each page's tokens held so far
        (pool or Recent) followed by its share of the incoming chunk. The Recent pages' decoded
        tokens are kept in `entry.moves.decoded` for `_enter_mid`, which reads them again."""
        P = self.config.page_size
        coded = [entry.pages[i] for i in group if i < len(entry.pages) and entry.pages[i].slot is None
                 and entry.pages[i].recent is not None]
        entry.moves.decoded = {id(page): kv for page, kv in zip(coded, decode_recent_pages([p.recent for p in coded]))}
        keys, values, masses = [], [], []
        for i in group:
            page = entry.pages[i] if i < len(entry.pages) else None
            held = page.tokens if page is not None else 0
            k, v = (entry.moves.decoded.get(id(page)) or self._page_kv(page)) if held else (key[:, :0], None)
            start, end = i * P + held - entry.length, (i + 1) * P - entry.length
            keys.append(torch.cat([k, key[:, start:end]], 1))
            if not self.shared_value_dim:
                values.append(torch.cat([v if v is not None else value[:, :0], value[:, start:end]], 1))
            masses.append(page.mass if page is not None and page.mass is not None and held == P else None)
        keys = torch.cat(keys, 1)
        values = torch.cat(values, 1) if values else keys[..., : self.shared_value_dim]
        return keys, values, None if any(m is None for m in masses) else torch.cat(masses, 1)

    def _bytes_beside_group(self, entry: SequenceKV, count: int) -> int:
        """What the sequence-layer will hold at the append's end besides the group's Mid rows:
        Mid epochs so far (with their bases), the exact and Recent pages of the end state,
        metadata (without the credit a waiting prompt kept: dropped as the append ends)."""
        phases = self.plan.counts(count)  # the group's pages are all Mid at the end
        recent, exact = phases[Phase.RECENT], phases[Phase.INITIAL] + phases[Phase.TERMINAL]
        slots = sum(n for phase, n in phases.items() if self.stays_exact(phase))  # the block table at the end
        metadata = self._metadata_nbytes(entry) - self._held_credit_nbytes(entry) \
            + (slots - entry.block_table.numel()) * entry.block_table.element_size()
        held = self.mid_nbytes(entry) + metadata
        return held + exact * self.pool.page_nbytes + (recent * self._recent_page_nbytes if recent else 0)

    @functools.cached_property
    def _recent_page_nbytes(self) -> int:
        """A full Recent page's bytes (known once the pool, which sets the shapes, exists)."""
        if self.recent_bits is None:
            return self.pool.page_nbytes
        P, keys, values = self.config.page_size, self.pool.keys, self.pool.values
        empty_values = None if self.shared_value_dim else values.new_zeros(values.shape[1], P, values.shape[-1])
        return encode_recent(keys.new_zeros(keys.shape[1], P, keys.shape[-1]), empty_values, self.recent_bits).nbytes

    def _evict(self, entry: SequenceKV, index: int, keys: torch.Tensor, values: torch.Tensor | None):
        """The page's survivors outside a joint plan: the `keep_count` best by the policy's score."""
        keep = self.keep_count(entry, entry.pages[index])
        if keep == keys.shape[1]:
            return keys, values
        if keep == 0:
            return keys[:, :0], None if values is None else values[:, :0]
        shown_values = values if values is not None else keys[..., : self.shared_value_dim]
        scores = self.policy.score(ScoreInputs(keys, shown_values, entry.observation, self.scale,
                                               entry.pages[index].mass, softcap=self.softcap))
        return _gather((keys, values), best_tokens(scores, keep))

    # -- reading -------------------------------------------------------------------------------
    def segments(self, seq: int) -> Segments | None:
        entry = self.sequences.get(seq)
        if entry is None or entry.length == 0:
            return None
        exact_pages = [p for p in entry.pages if p.slot is not None]
        exact = None
        if exact_pages:
            total = sum(p.tokens for p in exact_pages)
            keys = pool_rows(self.pool.keys, entry.block_table, total)
            exact = (keys, self._values(keys, lambda: pool_rows(self.pool.values, entry.block_table, total)))
        recent_pages = [p.recent.decode() for p in entry.pages if p.recent is not None]
        recent = None
        if recent_pages:
            keys = torch.cat([k for k, _ in recent_pages], 1)
            recent = (keys, self._values(keys, lambda: torch.cat([v for _, v in recent_pages], 1)))
        mid = entry.mid.attention_inputs() if entry.mid is not None else None
        retired = tuple(inputs for m in entry.retired if (inputs := m.attention_inputs()) is not None)
        return Segments(exact, recent, mid, self.mid_encoding.project, retired)

    def _values(self, keys: torch.Tensor, stored) -> torch.Tensor:
        return keys[..., : self.shared_value_dim] if self.shared_value_dim else stored()

    def unsettled_pages(self, seq: int) -> list[Page]:
        """Pages that may still be evicted later (Terminal/Recent), for attention-mass tracking."""
        entry = self.sequences.get(seq)
        return [p for p in entry.pages if p.phase in (Phase.TERMINAL, Phase.RECENT)] if entry else []

    def release(self, seq: int) -> None:
        entry = self.sequences.pop(seq, None)
        if entry is not None and self.pool is not None:
            for page in entry.pages:
                if page.slot is not None:
                    self.pool.release(page.slot)
        if entry is not None and entry.length == self._longest:
            self._longest = max((e.length for e in self._sequences.values()), default=0)
        if not self._sequences:
            self.columns = 0

    # -- accounting ----------------------------------------------------------------------------
    def page_nbytes(self, page: Page) -> int:
        return page.nbytes(self.pool.page_nbytes)

    @staticmethod
    def _epochs(entry: SequenceKV) -> list[MidSegment]:
        return entry.retired + ([entry.mid] if entry.mid is not None else [])

    def _metadata_nbytes(self, entry: SequenceKV) -> int:
        observation = entry.observation.nbytes if entry.observation is not None else 0
        return entry.block_table.nbytes + observation + entry.page_bytes.mass + self._held_credit_nbytes(entry)

    @staticmethod
    def _held_credit_nbytes(entry: SequenceKV) -> int:
        return sum(where.nbytes + credit.nbytes for where, credit in entry.held_credit)

    def over_budget(self, seq: int) -> bool:
        """Whether `seq` holds more than its budget now (possible when the exact pages and
        metadata alone exceed it, e.g. at short contexts, and on a windowed layer while its exact
        window outweighs the session's budget)."""
        entry = self._sequences.get(seq)
        if not entry or self.pool is None:
            return False
        length = self.length(seq)
        budget = (self.budget(length) if self.reported_budget is None else
                  budget_bytes(self.reported_budget, length, self.fp16_token_bytes()))
        return budget is not None and self.sequence_nbytes(entry) > budget

    def mid_nbytes(self, entry: SequenceKV) -> int:
        """Every Mid epoch's rows, statistics and bases."""
        return sum(m.nbytes for m in self._epochs(entry))

    def sequence_nbytes(self, entry: SequenceKV) -> int:
        pages = entry.page_bytes.total + self._opening_nbytes(entry)
        return pages + self.mid_nbytes(entry) + self._metadata_nbytes(entry)

    def _opening_nbytes(self, entry: SequenceKV) -> int:
        """The Terminal slot of a page opened but not counted yet (during an append, between
        `_new_page` and `_page_opened`, while the pages before it settle)."""
        opening = len(entry.pages) - entry.page_bytes.pages
        return opening * self.pool.page_nbytes if opening else 0

    def nbytes(self) -> dict[str, int]:
        """Bytes held per phase, plus free pool slots and metadata (tables, bases, queries):
        O(sequences), from each sequence's `PageBytes`. A decode batch's deferred counters hold no
        bytes (its tokens are in slots already counted), so this does not write it back."""
        kinds = {phase.value: 0 for phase in Phase} | {"free": 0, "metadata": 0}
        for entry in self._sequences.values():
            for phase, n in entry.page_bytes.by_phase.items():
                kinds[phase.value] += n
            kinds[Phase.TERMINAL.value] += self._opening_nbytes(entry)
            for mid in self._epochs(entry):  # coded rows are Mid; the head bases are metadata
                bases = sum(b.nbytes for b in (mid.key_bases, mid.value_bases) if b is not None)
                kinds["mid"] += mid.nbytes - bases
                kinds["metadata"] += bases
            kinds["metadata"] += self._metadata_nbytes(entry)
        if self.pool is not None:
            kinds["free"] = self.pool.nbytes - self.pool.live_pages * self.pool.page_nbytes
        return kinds
