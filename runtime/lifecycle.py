"""The lifecycle of one sequence-layer's pages, decided in one place for both executors.

The PyTorch store (`runtime.layer_cache.LayerCache`) and the host runner of exported graphs
(`export.host_runner`) keep a sequence's bytes in their own form: pool slots and torch codecs,
or numpy buffers fed to onnxruntime, OpenVINO or IREE. Both subclass `Lifecycle`, which makes
every decision and calls them back (the `_hooks` below) to move bytes:

* where a chunk's tokens go, page by page, settling the phases (runtime/phases.py) as each
  page opens, before it takes storage, so a long chunk never holds more exact pages than the
  lifecycle allows;
* which moves re-encode a page (into Recent codes, into Mid) and which only relabel it;
* when a chunk brings the first page to Mid (the executor fits the head bases then, on every
  token not yet in Mid plus the chunk) and when a refitting policy starts a new Mid epoch;
* the byte budget, and how many tokens a page entering Mid keeps under it (`page_room`);
* which recent queries are held for eviction scores, and which of a chunk's own queries rank the
  pages it moves (held only while it is stored).

Which tokens a page keeps is the policy's score: the store ranks in torch and the exported
compressor in its graph, both with the same `runtime.policies` function.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtopo.config import Config

from .phases import TRANSITIONS, Phase, PhasePlan
from .policies import MidEncoding, Policy

# A refit waits for an append that gives it at least this many tokens per head dimension to fit
# on (a prefill chunk; decode steps alone would fit 128-dim bases on ~130 tokens).
REFIT_ROWS_PER_DIM = 4

# Query heads per kv-head whose observation window is held in full (see observed_positions).
OBSERVED_GROUP = 8

# A prefill chunk's own last queries that rank the pages it moves into Mid, beside the held
# window; dropped when the chunk is stored, so they cost no bytes. When the context is stored
# before its question (query-agnostic), a 32-query window sees only what the document's last
# sentence reads. SmolLM2, 2K-token number needles, float32, nominal 4x (3.47x achieved):
# agnostic 0.60 -> 0.70 on validation seeds 1000-1019 (256 queries: the same), 0.75 -> 0.80 on
# the benchmark seeds; aware 1.00 -> 1.00 on both. The window itself widened to 128 instead gave
# agnostic 0.75 but aware 0.95 / 0.85: the question's few queries were outvoted
# (bench/results/real_quality_agnostic_f32/).
CHUNK_QUERIES = 128


def observed_positions(window: int, q_heads: int, kv_heads: int) -> int:
    """Query positions the observation window holds: `window`, or proportionally fewer (at
    least one) when more than `OBSERVED_GROUP` query heads share a kv-head, so that it costs
    what a GQA-8 layer's does. MLA's 128 heads share one latent: 32 positions of 128 absorbed
    576-dim queries (4.7 MB per layer) outweighed the whole 8x budget of a 4K-token latent
    cache."""
    group = max(1, q_heads // max(1, kv_heads))
    return window if group <= OBSERVED_GROUP else max(1, window * OBSERVED_GROUP // group)


def check_value_energy(config: Config, mid_encoding: MidEncoding, shares_values: bool) -> None:
    """A projected Mid fits value bases at `value_energy` for a layer whose values are its own:
    `key_energy` alone projects the keys of an MLA latent only (its values are its keys, projected
    once, at `key_energy`: another `value_energy` would be ignored)."""
    if mid_encoding.project and not shares_values and config.value_energy is None:
        raise ValueError(f"Config(key_energy={config.key_energy!r}) without value_energy projects an MLA latent's keys "
                         "only; this layer stores values of its own: set value_energy too")
    if (mid_encoding.project and shares_values and config.value_energy is not None
            and config.value_energy != config.key_energy):
        raise ValueError(f"Config(value_energy={config.value_energy!r}) differs from key_energy={config.key_energy!r}: "
                         "an MLA latent is its layer's keys and values, projected once at key_energy; leave "
                         "value_energy unset or equal to key_energy")


def budget_bytes(config: Config, length: int, fp16_token_bytes: int) -> float | None:
    """Bytes one sequence-layer may hold at `length` tokens under `config` (None: no budget)."""
    limits = []
    if config.target_ratio is not None:
        limits.append(length * fp16_token_bytes / config.target_ratio)
    if config.layer_budget_bytes is not None:
        limits.append(config.layer_budget_bytes)
    return min(limits) if limits else None


class BudgetExceeded(RuntimeError):
    """The byte budget cannot be met even by evicting a whole Mid page (over_budget="raise")."""


def page_room(budget: float, held: float, fixed: float, tokens: int, mid_tokens_coming: int, config: Config,
              fp16_token_bytes: int) -> float:
    """Bytes a page of `tokens` tokens entering Mid may take, given the sequence-layer's
    `budget` at the length the current append ends at, the bytes `held` without the page (of
    which `fixed` are not Mid: exact and Recent pages, tables, observation queries), and the
    tokens (this page's included) that will have entered Mid by then.

    The room left is shared out by tokens, so that the pages a long chunk pushes into Mid one
    by one get equal room: judged at the length reached so far, the first pages of a chunk
    would lose every token and the last ones keep everything.

    When the budget is a ratio (`target_ratio`, no `layer_budget_bytes`) and
    over_budget="evict", a page keeps at least `min(1, fixed / budget)` of its own tokens'
    budget. At short lengths the fixed pages alone can exceed the budget; squeezing Mid pages
    then cannot meet it and only destroys the context (the user asked for fewer bytes, not for
    wrong answers): each Mid page gets its own tokens' share, the session holds more than asked
    and says so (`stats().budget_missed`, the achieved ratio). As the sequence grows the fixed
    pages weigh less, the floor falls with them and the budget is met once they take under
    half of it (bench/needle_configs.py shows what this keeps on a real model). A byte budget
    gets no floor (a page that keeps no token still costs its row count: a long run past the cap
    ends a few bytes over it per page, as `stats().budget_missed` reports).
    """
    room = (budget - held) * tokens / max(mid_tokens_coming, tokens)
    if config.over_budget == "evict" and config.target_ratio is not None and config.layer_budget_bytes is None:
        floor = min(1.0, fixed / budget) if budget > 0 else 1.0
        room = max(room, floor * tokens * fp16_token_bytes / config.target_ratio)
    return room


@dataclass
class PageState:
    """What the lifecycle knows of a page; executors subclass it with where the bytes are."""

    phase: Phase
    tokens: int = 0
    kept: int | None = None  # tokens this page contributed to Mid, once it entered Mid
    dropped: bool = False  # left a sliding window: no query can see it again, its storage is free


@dataclass
class SequenceState:
    """What the lifecycle knows of one sequence-layer; executors subclass it."""

    pages: list = field(default_factory=list)
    length: int = 0
    final_length: int = 0  # the length this sequence reaches when the current append ends
    prompt_end: int = 0  # the length its prompt reaches, when the caller feeds it in chunks and says so (0: not said)
    holding: bool = False  # the current append keeps pages that leave Recent waiting there (`Lifecycle.holds`)
    held_from: int | None = None  # the first page waiting in Recent past its time, while any does
    mid_tokens: int = 0  # tokens of the pages that entered Mid, before eviction
    mid: object = None  # the executor's Mid epoch that pages enter now (None before the first)
    next_refit: int | None = None  # the length at which the next Mid epoch starts
    observation: torch.Tensor | None = None  # the latest queries [Hq, W, d] float16, oldest at `observed_oldest`
    observed_oldest: int = 0  # where a full window's next decode query is written (see Lifecycle.observe)
    chunk_queries: torch.Tensor | None = None  # the appending chunk's queries [Hq, T, d], until it is stored
    chunk_start: int = 0  # the position of the appending chunk's first token


class Lifecycle:
    """The decisions (public methods) and the moves executors make for them (`_hooks`)."""

    def __init__(self, config: Config, policy: Policy):
        self.config = config
        self.policy = policy
        self.plan = PhasePlan(config.page_size, config.sink_tokens, config.recent_tokens, config.protected_spans)
        self.mid_encoding = policy.mid_encoding()
        self.recent_bits = policy.recent_bits()
        # Queries are held only where a score reads them: knorm's and streaming's windows cost
        # bytes under the budget and were never read.
        self.observes = self.mid_encoding.evict and policy.reads_queries

    # -- writing -------------------------------------------------------------------------------
    def observe(self, seq: SequenceState, queries: torch.Tensor, kv_heads: int) -> None:
        """Remember the latest queries [Hq, T, d] (`observed_positions` of them): eviction scores
        use them (policies that never evict, or whose scores read no queries, hold none). A chunk
        longer than the window also leaves its queries for ranking the pages its own append moves
        (the forward's tensor, not a copy: it is dropped once the chunk is stored)."""
        if not self.observes:
            return
        window = observed_positions(self.config.observation_window, queries.shape[0], kv_heads)
        seq.chunk_queries = None
        held = seq.observation
        if (queries.shape[1] == 1 and held is not None and held.shape[1] == window
                and (not held.is_inference() or torch.is_inference_mode_enabled())):
            self.observe_steps(seq, queries.detach(), 1)
            return
        if queries.shape[1] > window:  # a prefill chunk, not a decode step
            seq.chunk_queries, seq.chunk_start = queries.detach(), seq.length
        # float16 is plenty for ranking tokens, and halves what the window costs to hold.
        recent = queries[:, -window:].detach().to(torch.float16)
        if held is not None:
            held = held.roll(-seq.observed_oldest, 1)  # oldest first again
            recent = torch.cat([held, recent], dim=1)[:, -window:]
        seq.observation, seq.observed_oldest = recent.clone(), 0

    @staticmethod
    def chunk_queries_after(seq: SequenceState, position: int, kv_heads: int) -> torch.Tensor | None:
        """The appending chunk's queries after `position`, at most its last `CHUNK_QUERIES`
        (`observed_positions` of them), float16 as the window holds its own; None if none."""
        queries = seq.chunk_queries
        after = 0 if queries is None else seq.chunk_start + queries.shape[1] - position
        if after <= 0:
            return None
        return queries[:, -min(after, observed_positions(CHUNK_QUERIES, queries.shape[0], kv_heads)):].to(torch.float16)

    @staticmethod
    def predecessor_rows(seq: SequenceState, positions: torch.Tensor) -> torch.Tensor | None:
        """[n]: the row of the appending chunk's queries (`seq.chunk_queries`) that is the token
        before each of `positions`, -1 where the chunk does not hold it; None outside a
        prefill chunk."""
        if seq.chunk_queries is None:
            return None
        before = positions - 1 - seq.chunk_start
        return torch.where((before >= 0) & (before < seq.chunk_queries.shape[1]), before, -1)

    @staticmethod
    def observe_steps(seq: SequenceState, queries: torch.Tensor, steps: int) -> None:
        """`steps` decode steps' queries into a full window, as `observe` takes each: a step's
        query replaces the oldest in place (every score sums over the window's queries, so their
        order is not needed). `queries` [Hq, m, d]: the last m = min(steps, window) of them, in
        order."""
        window = seq.observation.shape[1]
        if steps == 1:  # one copy
            seq.observation[:, seq.observed_oldest].copy_(queries[:, 0])
        else:
            shown = queries.shape[1]
            positions = (seq.observed_oldest + torch.arange(steps - shown, steps)) % window
            seq.observation[:, positions] = queries
        seq.observed_oldest = (seq.observed_oldest + steps) % window

    def start_append(self, seq: SequenceState, tokens: int, head_dim: int, chunk) -> None:
        """Before `tokens` new tokens (`chunk`, the executor's) are written: start the Mid epoch
        they need, the first when they bring a page to Mid, a new one when a refit is due."""
        seq.final_length = seq.length + tokens
        seq.holding = self.holds(seq, tokens)
        if not seq.holding and self.starts_epoch(seq, tokens, head_dim):
            self._new_mid_epoch(seq, chunk)
            seq.next_refit = self.next_refit(seq.length + tokens)

    def starts_epoch(self, seq: SequenceState, tokens: int, head_dim: int) -> bool:
        """Whether appending `tokens` starts a Mid epoch: the first, when they bring a page to Mid;
        a new one, when a refit is due and the append brings enough tokens to fit on."""
        if seq.mid is None:
            return self.reaches_mid(seq.length + tokens)
        return seq.next_refit is not None and seq.length + tokens >= seq.next_refit \
            and tokens + seq.length - seq.mid_tokens >= REFIT_ROWS_PER_DIM * head_dim

    def write(self, seq: SequenceState, tokens: int, chunk) -> None:
        """Write the chunk into pages, settling the lifecycle as each page opens: freed storage
        is reused at once. The chunk's own queries are dropped once it is written."""
        P = self.config.page_size
        written = 0
        try:
            while written < tokens:
                if not seq.pages or seq.pages[-1].tokens == P:
                    seq.pages.append(self._new_page())
                    self.settle(seq, max(0, len(seq.pages) - 2 - self.plan.recent_pages))
                    self._page_opened(seq, seq.pages[-1])
                page = seq.pages[-1]
                take = min(P - page.tokens, tokens - written)
                self._write_tokens(seq, page, chunk, written, take)
                page.tokens += take
                seq.length += take
                written += take
            if seq.held_from is not None and not seq.holding:  # the wait ended in an append that opened no page
                self.settle(seq, seq.held_from)
        finally:
            seq.chunk_queries = None

    def settle(self, seq: SequenceState, start: int) -> None:
        """Give pages `start..` (and any waiting in Recent) the phase the plan says, re-encoding
        those that move; while the append holds (`holds`), a page due in Mid waits in Recent.
        Pages enter Mid last: the room each gets (`keep_count`) is then judged beside the Recent
        codes of the Terminal pages leaving for Recent, not their exact slots (judged before them,
        the first pages to enter Mid after a prompt that filled its budget kept no token, and
        over_budget="raise" raised where the budget could be met)."""
        count = len(seq.pages)
        if seq.held_from is not None and not seq.holding:  # while it holds, the waiting pages stay
            start = min(start, seq.held_from)
        moves = []
        for index in range(start, count):
            page, target = seq.pages[index], self.plan.phase(index, count)
            if target is Phase.MID and seq.holding and page.phase is not Phase.MID:
                target = Phase.RECENT
                seq.held_from = index if seq.held_from is None else seq.held_from
            if page.phase != target and not page.dropped:
                moves.append((index, target))
        for index, target in sorted(moves, key=lambda move: move[1] is Phase.MID):  # stable: in page order
            self._move(seq, index, target)
        if not seq.holding:
            seq.held_from = None
        self._settled(seq)

    def _move(self, seq: SequenceState, index: int, target: Phase) -> None:
        page = seq.pages[index]
        if target not in TRANSITIONS.get(page.phase, ()):
            raise RuntimeError(f"illegal page transition {page.phase.value} -> {target.value} (page {index})")
        if not self.stays_exact(target):
            if target is Phase.RECENT:
                self._encode_recent(seq, page)
            else:
                page.kept = self._enter_mid(seq, index)
                seq.mid_tokens += page.tokens
            self._release_exact(seq, page)
        page.phase = target

    # -- decisions -----------------------------------------------------------------------------
    def stays_exact(self, phase: Phase) -> bool:
        """Whether a page in `phase` keeps its exact pool slot (moving there only relabels it)."""
        return phase in (Phase.INITIAL, Phase.TERMINAL) or (phase is Phase.RECENT and self.recent_bits is None) \
            or (phase is Phase.MID and self.mid_encoding.identity)

    def holds(self, seq: SequenceState, tokens: int) -> bool:
        """Whether appending `tokens` keeps the pages that leave Recent waiting there (in Recent
        codes) instead of moving them to Mid: more of the prompt comes after this chunk
        (`prompt_end`), and the tokens waiting stay within `Config.prompt_hold_tokens`. When the
        prompt ends (or the wait would grow past that), the waiting pages enter Mid together,
        ranked by the chunk then appended, as the whole prompt in one chunk ranks its pages;
        moved as each chunk pushes them out of Recent, a page is judged by the queries of the
        chunk just after it instead (docs/measurements.md, "Prompts in 512-token chunks"). Only
        where the policy evicts, Recent is coded (waiting holds no exact pool slot) and no byte
        cap (`layer_budget_bytes`) forbids holding more while the prompt is read than after."""
        end = seq.length + tokens
        if (not self.config.prompt_hold_tokens or seq.prompt_end <= end or self.recent_bits is None
                or not self.mid_encoding.evict or self.config.layer_budget_bytes is not None):
            return False
        # With none due yet it holds too: its tokens wait later, and it keeps their credit now.
        return self.mid_tokens_coming(seq, end) <= self.config.prompt_hold_tokens

    def reaches_mid(self, length: int) -> bool:
        return self.plan.mid_pages(self.plan.pages(length)) > 0

    def next_refit(self, fitted_at: int) -> int | None:
        """Bases fitted at length `fitted_at` are refitted once the sequence doubles past it (or
        past `refit_after`). RoPE turns keys as positions grow: on bench/memory.py's layer a
        basis fitted on the first 2K tokens held 0.82 of late keys' energy at 4K and 0.73-0.78
        at 32K-128K (0.9 nominal); refitting at each doubling from 4K cut topo's attention
        error at 32K from 0.76 to 0.60 (refitting from 8K on: 0.70)."""
        if not self.mid_encoding.refit:
            return None
        return 2 * max(fitted_at, self.config.refit_after)

    @staticmethod
    def budget_length(seq: SequenceState) -> int:
        """The length an append's pages entering Mid are budgeted at: the append's end, or the end
        of the prompt it is a chunk of (`prompt_end`), so that a prompt fed in chunks is compressed
        as one chunk would be. Judged at each chunk's end instead, the first chunks' fixed pages
        exceed their budget, their Mid pages keep their floor (`page_room`), and the prompt ends
        over its budget (SmolLM2, 2K in 512-token chunks: 3.0x for a nominal 4x, one chunk 3.5x;
        docs/measurements.md, "Prompts in 512-token chunks")."""
        return max(seq.length, seq.final_length, seq.prompt_end)

    def mid_tokens_coming(self, seq: SequenceState, length: int) -> int:
        """Tokens that enter Mid from now until the sequence reaches `length`: those a page or an
        append's group shares the room with (`page_room`)."""
        return self.plan.mid_pages(self.plan.pages(length)) * self.config.page_size - seq.mid_tokens

    def budget(self, length: int) -> float | None:
        """Bytes one sequence-layer may hold at `length` tokens (None: no budget)."""
        return budget_bytes(self.config, length, self.fp16_token_bytes())

    def keep_count(self, seq: SequenceState, page: PageState) -> int:
        """How many of its tokens a page entering Mid keeps: the policy's cap, then what the
        budget at `budget_length` leaves it (`page_room`)."""
        tokens = page.tokens
        if not self.mid_encoding.evict:
            return tokens
        cap = self.mid_encoding.max_tokens
        keep = tokens if cap is None else min(cap, tokens)
        length = self.budget_length(seq)
        budget = self.budget(length)
        if budget is None:
            return keep
        held = self.sequence_nbytes(seq) - self.page_nbytes(page)
        room = page_room(budget, held, held - self.mid_nbytes(seq), tokens, self.mid_tokens_coming(seq, length),
                         self.config, self.fp16_token_bytes())
        if keep > 0 and self.mid_page_nbytes(seq, keep) > room:
            keep = self._rows_within(seq, keep, room)
        # A page that keeps no token still costs its Mid bytes (its row count): under "raise" the
        # room must hold that much, or the store would end over budget without raising.
        if keep == 0 and self.config.over_budget == "raise" and room < (empty := self.mid_page_nbytes(seq, 0)):
            raise self.budget_exceeded(budget, length, held, self.mid_nbytes(seq), 1, empty, settled=False)
        return keep

    @staticmethod
    def budget_exceeded(budget: float, length: int, held: float, mid: float, pages: int, empty: float,
                        settled: bool) -> BudgetExceeded:
        """The error for `pages` pages entering Mid that cannot fit the budget even keeping no
        token (`empty` bytes together), beside the `held` bytes of which `mid` are Mid tokens
        earlier pages kept (with their bases). `settled`: `held` is what the append's end will
        hold; else what is held now, while the pages the append moves into Mid after these still
        hold their Recent codes."""
        fixed = held - mid
        where = f"{fixed:.0f} in exact/Recent pages and metadata"
        if not settled:
            where += " (as they are now: the pages this append moves into Mid after these still hold their Recent codes)"
        if mid > 0:
            where = (f"{mid:.0f} in Mid tokens that earlier pages kept (a Mid page's tokens are chosen once, when it "
                     f"enters Mid, so those pages cannot give bytes back) and {where}")
        if mid > 0 and fixed + empty <= budget:
            advice = ("a budget met exactly when those pages entered Mid leaves no room for the pages that enter "
                      "it later (as decoding crosses page boundaries): loosen the budget (lower target_ratio, "
                      "higher layer_budget_bytes), or allow over_budget='evict' (keeps going, reports the miss in "
                      "stats().budget_missed)")
        else:
            advice = ("lower sink_tokens/recent_tokens, loosen the budget (lower target_ratio, higher "
                      "layer_budget_bytes), or allow over_budget='evict'")
        return BudgetExceeded(
            f"KV budget of {budget:.0f} bytes per sequence-layer cannot be met at {length} tokens: the {pages} "
            f"page(s) entering Mid cost {empty:.0f} bytes even keeping no token, beside {held:.0f} bytes held: "
            f"{where}; {advice}")

    def mid_row_costs(self, seq: SequenceState) -> tuple[int, int, int]:
        """A Mid page's bytes as it keeps rows: (kept none, what the first row adds: it also
        brings the page's statistics, what each further row adds)."""
        empty, one, two = (self.mid_page_nbytes(seq, rows) for rows in (0, 1, 2))
        return empty, one - empty, two - one

    def _rows_within(self, seq: SequenceState, most: int, room: float) -> int:
        """The most rows below `most` whose Mid bytes fit `room` (0 if none): past the first row
        every row adds the same bytes (`mid_row_costs`), so the count is one division; the check
        after it only guards the float room's rounding."""
        empty, first, per_row = self.mid_row_costs(seq)
        one_row = empty + first
        if one_row > room:
            return 0
        keep = most - 1 if per_row <= 0 else min(most - 1, 1 + int((room - one_row) // per_row))
        while keep > 0 and self.mid_page_nbytes(seq, keep) > room:
            keep -= 1
        return keep

    # -- hooks: what executors do with their bytes ----------------------------------------------
    def _new_page(self) -> PageState:
        """A Terminal page with no storage yet."""
        raise NotImplementedError

    def _page_opened(self, seq: SequenceState, page: PageState) -> None:
        """Give the newest page exact storage (after the pages before it settled)."""
        raise NotImplementedError

    def _write_tokens(self, seq: SequenceState, page: PageState, chunk, start: int, count: int) -> None:
        """Copy `count` tokens of the chunk from `start` into the page after its `page.tokens`."""
        raise NotImplementedError

    def _settled(self, seq: SequenceState) -> None:
        """Called after pages moved (block tables and the like)."""

    def _new_mid_epoch(self, seq: SequenceState, chunk) -> None:
        """Set `seq.mid` to a new Mid epoch (fitting bases if the policy projects)."""
        raise NotImplementedError

    def _encode_recent(self, seq: SequenceState, page: PageState) -> None:
        raise NotImplementedError

    def _enter_mid(self, seq: SequenceState, index: int) -> int:
        """Encode page `index`'s survivors into `seq.mid`; return how many it kept."""
        raise NotImplementedError

    def _release_exact(self, seq: SequenceState, page: PageState) -> None:
        """Free a re-encoded page's exact storage."""
        raise NotImplementedError

    def fp16_token_bytes(self) -> int:
        """What one token of this layer costs in an fp16 cache (what target_ratio divides)."""
        raise NotImplementedError

    def sequence_nbytes(self, seq: SequenceState) -> int:
        raise NotImplementedError

    def page_nbytes(self, page: PageState) -> int:
        """Bytes the page holds outside Mid (a Terminal page: a full exact page)."""
        raise NotImplementedError

    def mid_nbytes(self, seq: SequenceState) -> int:
        raise NotImplementedError

    def mid_page_nbytes(self, seq: SequenceState, tokens: int) -> int:
        """Bytes `tokens` survivors of one page would add to `seq.mid`."""
        raise NotImplementedError
