"""kvtopo as the KV cache of transformers' continuous batching (`model.generate_batch`).

    from kvtopo.config import Config
    from kvtopo.serving.continuous_batching import generate_batch

    result = generate_batch(model, [prompt_ids_0, prompt_ids_1, ...], Config(), max_new_tokens=64)
    result.outputs["req_0"].generated_tokens     # transformers' GenerationOutput, per request
    result.peak.total_bytes, result.peak.fp16_bytes

The engine (transformers' `ContinuousBatchingManager`: its scheduler, request queue, batch packing
and sampling) runs unchanged. kvtopo replaces two things through the engine's own extension points:

* attention: `kvtopo_paged`, registered in transformers' `AttentionInterface`. The engine packs the
  new tokens of every scheduled request into one flat batch [1, heads, tokens, dim] with cumulative
  query lengths (`cu_seq_lens_q`); for each request's span of it, kvtopo attends over that
  request's history in the kvtopo session and appends the span's keys/values to it: the
  single-token spans (decode steps) of all requests together, in one `Session.attend_sequences`
  call per layer (one batched decode kernel), each prefill chunk on its own
  (`Session.attend_sequence`);
* the cache: `KvtopoPagedCache`, a `PagedAttentionCache` whose `update` stores nothing (the new
  keys/values go to attention as they are) and whose physical tensor is never allocated (the
  engine builds it on the meta device: `_EngineCacheOnMeta`).
  It admits requests by kvtopo's bytes when given a K/V byte budget (`kv_budget_bytes`, below);
  without one, by the engine's own block ledger of logical tokens (`num_blocks`). The cache
  records, in the order the engine packs them, which request each span of the next forward
  belongs to (the engine reports it through `extend_read_and_write_indices` /
  `fill_block_table`), maps each request id to a kvtopo sequence id, and releases the request's
  pages in every layer (`Session.release`) when the engine frees its blocks: when it finishes, is
  cancelled, or is evicted (offloaded and later re-prefilled from scratch). Every layer of the
  session has one `PagePool`, shared by all requests; a released slot goes back on its free list
  and is the next one handed out.

Admission by bytes (`kv_budget_bytes`: the bytes all requests' K/V may take together, as
`Session.stats().total_bytes` counts them: live and free pool slots, codes, metadata). The engine's
scheduler asks its cache, per request and forward, whether the next `n` tokens can be stored
(`can_store_request_tokens`), how much of the cache is free (`compute_free_capacity`, its safety
margin) and, before it evicts, how many starved requests would then fit (`count_storable_requests`).
`KvtopoPagedCache` answers all three from the session's measured bytes plus a conservative
estimate of what the new tokens can add (`_Growth`), and reserves that estimate until the forward
has stored them (then the measurement replaces it). So a request joins, or a running one grows by
a prefill chunk or a decode token, only when the budget holds it; when it does not, the engine's own
mechanism acts: the request waits, or the engine evicts the newest starved request (its pages are
released at once) and re-prefills it later. The engine's block ledger still runs underneath (its
index tensors need it), sized by `num_blocks` large enough not to bind (`generate_batch` sizes it to
hold every input). After every forward the measured bytes are checked against the budget; a miss
(an estimate that was not an upper bound: a bug) is counted (`budget_misses`) and logged.

The estimate charges, per layer, what the stored tokens can cost before compression has shrunk
them: every page the tokens open at its exact cost (the model's dtype: float32 here, fp16 on a
half-precision model) for whatever it becomes (a Recent code, Mid rows, attention mass: each smaller
than the exact page), plus the pool slots the sequence can hold exact at its new length (the
lifecycle's Initial/Terminal pages, and Recent/Mid ones when they stay exact) beyond the pool's
free slots, one page each: before the forward the cache grows each pool by exactly the slots it
admitted (`PagePool.reserve`), and a growth step may add free slots (counted bytes) only as far
as the budget leaves (`PagePool.spare`), so a decode that needs one more page is charged one
page, not the pool's step of an eighth. Plus a new sequence's observation window and, for projecting policies, a new Mid epoch's bases. A prompt chunk is charged about
its exact size until it settles, then held at the compressed size: admission is bounded by
the prefill chunk in flight, not by a guessed ratio. Lossless pages never re-encode: their slots
alone are charged.

A prompt the engine splits over several forwards is compressed as `kvtopo.generate` compresses
one fed in chunks: each chunk is told where its request's prompt ends (`Session.attend_sequence(
prompt_end=...)`: the request's initial tokens, which for an evicted request include what it had
generated), so its pages are budgeted at that length and wait in Recent codes until it, then are
ranked together (`Config.prompt_hold_tokens`; 0 moves each page as a chunk pushes it out of Recent).
A one-token chunk with more of its prompt to come is attended as a prompt chunk, not with the decode
steps. While a prompt is read, its waiting pages are in the measured bytes; the estimate adds the
credit kept for a waiting chunk's tokens (`Policy.held_credit`).

Every span is checked against the store before attention: the engine's past length for the request
must equal the tokens kvtopo holds for its sequence, so a request never attends over a history that
is not its own (`page_ownership_errors` checks the pools' slots besides).

What the engine must not do, because kvtopo's store would not follow it, is forced off in the
engine's config: prefix sharing (`allow_block_sharing`: a request would skip the prefill of a
shared prefix kvtopo never stored for it), CPU offloading (`cpu_offload_space`: it copies the
engine's own blocks back; with it off an evicted request is re-prefilled), async batching and
CUDA graphs / compiled forwards (one forward's batch is recorded while the previous one runs, or
replayed without kvtopo's host-side store), and the block-table decode path
(`max_blocks_per_request=0`). `num_return_sequences > 1` (forks copy the engine's blocks) and
models with sliding-window layers are refused.

One patch of transformers' internals: `ContinuousBatchingManager._create_batch_processor` builds a
`PagedAttentionCache` by the name its module imported, with no argument to choose the class. While
the kvtopo manager's processor is built, that module-level name is rebound to `KvtopoPagedCache`
(under a lock, then restored). Byte admission overrides the cache's accounting methods named
above, which transformers 5.24.0's `Scheduler._process_candidates` / `_try_to_meet_safety_margin`
and `OffloadingManager.offload_requests` call (and reads the scheduler's `starved_requests`, kept
in step with the list `count_storable_requests` is given). This relies on transformers 5.24.0's
internals, so this module raises on any other transformers version (`TRANSFORMERS_VERSION`).
"""

from __future__ import annotations

import functools
import numbers
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
import transformers
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache, group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.utils import (WorkloadHints, find_head_dim, find_num_key_value_heads,
                                                               logger)

from kvtopo.config import Config
from kvtopo.runtime.layer_cache import held_credit_nbytes
from kvtopo.runtime.lifecycle import Lifecycle, observed_positions
from kvtopo.runtime.page_pool import growth_step
from kvtopo.runtime.session import CacheStats, SequenceStats, Session

__all__ = ["ATTN_IMPLEMENTATION", "BatchResult", "KvtopoBatchingManager", "KvtopoPagedCache", "TRANSFORMERS_VERSION",
           "generate_batch", "ledger_blocks", "page_ownership_errors"]

# The one transformers version whose continuous-batching internals this module was written against.
TRANSFORMERS_VERSION = "5.24.0"
# The attention implementation name kvtopo registers in transformers' AttentionInterface.
ATTN_IMPLEMENTATION = "kvtopo_paged"
# The key under which KvtopoPagedCache.update hands itself to the attention function.
_BATCH_KWARG = "kvtopo_batch"
# What the engine's config must say for kvtopo's store to follow it (see the module docstring).
_ENGINE_SETTINGS = dict(allow_block_sharing=False, cpu_offload_space=0.0, use_async_batching=False,
                        use_cuda_graph=False, max_blocks_per_request=0, varlen_compile_config=None,
                        decode_compile_config=None, default_compile_level=0, q_padding_interval_size=0,
                        kv_padding_interval_size=0)

_CACHE_CLASS_LOCK = threading.Lock()


def check_transformers_version() -> None:
    if transformers.__version__ != TRANSFORMERS_VERSION:
        raise RuntimeError(
            f"kvtopo.serving.continuous_batching works with transformers {TRANSFORMERS_VERSION} only (it replaces the "
            "cache class that ContinuousBatchingManager._create_batch_processor builds, an internal of that "
            f"version); installed: transformers {transformers.__version__}")


@torch.compiler.disable(reason="kvtopo continuous batching attends over the session's store in host code")
def kvtopo_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention-interface function: the packed batch's attention over kvtopo's store
    (never traced: a compiled model's graphs break around it and it runs as it is)."""
    cache = kwargs.get(_BATCH_KWARG)
    if not isinstance(cache, KvtopoPagedCache):
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside kvtopo's continuous batching "
                           "(kvtopo.serving.continuous_batching), whose cache supplies each request's history")
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} attention is for inference: dropout={dropout} is not supported")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache.attend(module, query, key, value, scaling, kwargs.get("softcap")), None


class _Growth:
    """Upper bounds of what appending tokens to a sequence adds to the session's bytes (see the
    module docstring): exact page cost for every opened page, the pool slots the lifecycle keeps
    exact (priced by the pool's growth rule), a new sequence's observation window, new Mid bases."""

    def __init__(self, session: Session, model_config, dtype: torch.dtype):
        config = session.config
        self.session, self.max_pages = session, config.max_pages
        self.lifecycle = Lifecycle(config, session.policy)  # the store's own rules: which pages stay exact, when Mid starts
        self.plan, self.mid = self.lifecycle.plan, self.lifecycle.mid_encoding
        self.layers = [str(i) for i in range(model_config.num_hidden_layers)]
        kv_heads, q_heads = find_num_key_value_heads(model_config), model_config.num_attention_heads
        key_dim, value_dim = attention_dims(model_config)
        # The exact page before the layer's pool exists (LayerCache makes it from the first k/v).
        self.first_page_nbytes = kv_heads * config.page_size * (key_dim + value_dim) * dtype.itemsize
        self.reencodes = not (self.mid.identity and self.lifecycle.recent_bits is None)
        window = observed_positions(config.observation_window, q_heads, kv_heads)
        self.new_sequence_nbytes = q_heads * window * key_dim * 2 if self.lifecycle.observes else 0  # float16 queries
        # Per Mid epoch, keys and values: float16 directions of rank <= their dims, float32 means.
        self.bases_nbytes = kv_heads * sum(d * (d * 2 + 4) for d in (key_dim, value_dim)) if self.mid.project else 0
        # Per token of a chunk with more of its prompt to come: the credit the policy keeps for its
        # ranking at the prompt's end (`Policy.held_credit`; topo's successor shares).
        keeps = self.mid.evict and session.policy.keeps_held_credit
        self.held_credit_nbytes = held_credit_nbytes(kv_heads) if keeps else 0

    def exact_pages(self, pages: int) -> int:
        """Pages the lifecycle holds in exact pool slots when a sequence has `pages` pages."""
        return sum(n for phase, n in self.plan.counts(pages).items() if self.lifecycle.stays_exact(phase))

    def new_slots(self, pool, promised: int, slots: int) -> int | None:
        """Slots the pool adds to hand out `slots` more live slots after `promised` others (None:
        max_pages forbids it). An existing pool adds just those beyond its free ones (the cache
        reserves them before the forward, growth steps bounded by what the budget leaves); a pool
        the forward creates grows page by page in the pool's own steps (`growth_step`)."""
        if pool is not None:
            grown = max(0, promised + slots - (pool.capacity - pool.live_pages))
            fits = self.max_pages is None or pool.capacity + grown <= self.max_pages
            return grown if fits else None
        grown = 0
        while grown < promised + slots:
            bigger = grown + growth_step(grown, 1)
            if self.max_pages is not None:
                bigger = min(bigger, self.max_pages)
            if bigger <= grown:
                return None
            grown = bigger
        return grown

    def of(self, seq: int | None, past: int, tokens: int, prompt_end: int,
           promised: dict[str, int]) -> tuple[int, dict[str, int]] | None:
        """(bytes, pool slots per layer) that appending `tokens` after `past` to sequence `seq`
        (None: not stored yet; its prompt reaching `prompt_end`) can add, after the `promised`
        slots of other scheduled appends; None when a pool at `max_pages` cannot hold them."""
        pages_before, pages_after = self.plan.pages(past), self.plan.pages(past + tokens)
        opened = pages_after - pages_before
        total, slots_by_layer = 0, {}
        for name in self.layers:
            layer = self.session.layers.get(name)
            pool = layer.pool if layer is not None else None
            entry = layer.stored_state(seq) if layer is not None and seq is not None else None
            page = pool.page_nbytes if pool is not None else self.first_page_nbytes
            live = entry.block_table.numel() if entry is not None else 0
            slots = min(opened, max(0, self.exact_pages(pages_after) - live))
            already = self.new_slots(pool, 0, promised.get(name, 0))
            grown = self.new_slots(pool, promised.get(name, 0), slots)
            if already is None or grown is None:
                return None
            total += (grown - already) * page + opened * ((page if self.reencodes else 0) + 4)  # + block-table int32
            if entry is None:
                total += self.new_sequence_nbytes
            if prompt_end > past + tokens:
                total += tokens * self.held_credit_nbytes
            if self.bases_nbytes and self._epoch_starts(entry, past + tokens):
                total += self.bases_nbytes
            slots_by_layer[name] = slots
        return total, slots_by_layer

    def _epoch_starts(self, entry, length: int) -> bool:
        if entry is None or entry.mid is None:
            return self.lifecycle.reaches_mid(length)
        return entry.next_refit is not None and length >= entry.next_refit


def attention_dims(model_config) -> tuple[int, int]:
    """(key/query dim, value dim) of the model's attention heads: `head_dim`, except where the
    config sets them apart (DeepSeek's MLA: `qk_head_dim` and `v_head_dim`, `head_dim` being its
    RoPE part only)."""
    head_dim = find_head_dim(model_config)
    return getattr(model_config, "qk_head_dim", None) or head_dim, getattr(model_config, "v_head_dim", None) or head_dim


def _prompt_length(state) -> int:
    """The length a request's prompt reaches (an evicted request re-prefills its generated tokens too)."""
    return len(state.initial_tokens)


def _rows(packed: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The tokens at positions `at` of a packed [1, H, T, d] batch as rows [N, H, 1, d]."""
    return packed[0][:, at].transpose(0, 1)[:, :, None]


@dataclass(frozen=True)
class _Span:
    """One request's tokens in the packed forward: kvtopo sequence, engine past length, token
    count, and the length its prompt reaches (a prompt in chunks waits for it: `Session.step`)."""

    request_id: str
    seq: int
    past: int
    tokens: int
    prompt_end: int

    @property
    def decodes(self) -> bool:
        """A decode step: one token, the prompt's last or later (a one-token chunk with more of its
        prompt to come is a prompt chunk)."""
        return self.tokens == 1 and self.prompt_end <= self.past + 1


class _EngineCacheOnMeta(TorchFunctionMode):
    """While the engine builds its paged cache, its flat uint8 cache tensor is made on the meta
    device: kvtopo holds the keys and values, and the engine, sizing that tensor to the memory it
    finds free (on CPU, most of the machine's), would zero-fill it only for it to be dropped
    (serving four 2K prompts to SmolLM2 on a 24 GB machine: 12.9 GB resident instead of 1.2 GB,
    bench/served_memory.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "zeros" and kwargs.get("dtype") is torch.uint8:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


class KvtopoPagedCache(PagedAttentionCache):
    """The engine's paged cache with kvtopo's session as the store (see the module docstring)."""

    def __init__(self, *args, session: Session, budget_bytes: int | None = None, record_request_stats: bool = False,
                 **kwargs):
        with _EngineCacheOnMeta():
            super().__init__(*args, **kwargs)
        self.session = session
        self.budget_bytes = budget_bytes
        self.growth = _Growth(session, self.config, self.dtype)
        self.scheduler = None  # the engine's scheduler (its starved requests), set by the manager
        self._reserved = 0  # bytes admitted for the forward not run yet
        self._promised: dict[str, int] = {}  # pool slots per layer admitted for it
        self._held: int | None = None  # the session's measured bytes (None: changed since measured)
        self.budget_misses = 0  # forwards after which the session held more than the budget
        if not self.cache_tensor.is_meta:  # an engine that builds its cache tensor another way: free it now
            self._drop_physical_cache()
        self.sequence_of: dict[str, int] = {}  # request id -> kvtopo sequence id, while the request holds pages
        self._next_seq = 0
        self._recorded: list[tuple[str, int, int]] = []  # what the engine packed for the next forward
        self._spans: list[_Span] = []  # the forward running now
        self.peak: CacheStats | None = None  # session stats when it held the most bytes (checked per forward)
        # request id -> what its sequence held when the engine last freed it (finished, cancelled,
        # evicted); kept only when asked (`generate_batch`): a long-running server would grow it forever
        self.request_stats: dict[str, SequenceStats] | None = {} if record_request_stats else None
        self._lock = threading.Lock()

    def _drop_physical_cache(self) -> None:
        """Re-register the engine's allocators on a meta tensor: kvtopo holds the keys and values."""
        meta = torch.empty(self.cache_tensor.shape, dtype=self.cache_tensor.dtype, device="meta")
        for allocator in self.cache_allocators.values():
            allocator.register_cache_tensor(self.bytes_per_sector, self.num_sectors * self.bytes_per_sector, meta,
                                            self.pool)
        self.cache_tensor = meta

    # -- what the engine reports while it packs a batch ----------------------------------------------
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
        """Record the span; build the engine's write indices only. Its read indices list every
        token the request holds, rebuilt in Python for every request on every step, and only its
        own cache reads them: kvtopo attends from its store (`update` reads nothing)."""
        super().extend_read_and_write_indices(request_id, past_length, query_length, None, write_index)
        self._recorded.append((request_id, past_length, query_length))

    def fill_block_table(self, request_id, past_length, query_length, block_table):
        super().fill_block_table(request_id, past_length, query_length, block_table)
        self._recorded.append((request_id, past_length, query_length))

    # -- admission by bytes (transformers' scheduler and offloading manager call these) -------------
    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        if self.budget_bytes is None:
            return super().can_store_request_tokens(state, request_len, dry_run)
        with self._lock:
            cost = self._cost(state, request_len, self._promised)
            if cost is None or self.held_bytes() + self._reserved + cost[0] > self.budget_bytes:
                return False
            if not super().can_store_request_tokens(state, request_len, dry_run):
                return False
            if not dry_run:
                self._reserved += cost[0]
                for name, slots in cost[1].items():
                    self._promised[name] = self._promised.get(name, 0) + slots
            return True

    def count_storable_requests(self, list_blocks_needed: list[dict[str, int]]) -> int:
        """How many of the scheduler's starved requests (the first len(list_blocks_needed): the
        offloading manager pops both lists together) would fit in turn, by bytes."""
        if self.budget_bytes is None:
            return super().count_storable_requests(list_blocks_needed)
        with self._lock:
            free, promised = self.budget_bytes - self.held_bytes() - self._reserved, dict(self._promised)
            fits = 0
            for state, request_len in self.scheduler.starved_requests[: len(list_blocks_needed)]:
                cost = self._cost(state, request_len, promised)
                if cost is None or cost[0] > free:
                    break
                free, fits = free - cost[0], fits + 1
                for name, slots in cost[1].items():
                    promised[name] = promised.get(name, 0) + slots
            return min(fits, super().count_storable_requests(list_blocks_needed))

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        if self.budget_bytes is None:
            return super().compute_free_capacity(relative)
        free = max(0, self.budget_bytes - self.held_bytes() - self._reserved)
        return free / self.budget_bytes if relative else free

    def held_bytes(self) -> int:
        """What the session holds now (Session.stats().total_bytes), measured once per change."""
        if self._held is None:
            self._held = sum(sum(layer.nbytes().values()) for layer in self.session.layers.values())
        return self._held

    def _cost(self, state, tokens: int, promised: dict[str, int]):
        return self.growth.of(self.sequence_of.get(state.request_id), state.current_len(), tokens,
                              _prompt_length(state), promised)

    # -- the forward ---------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, kwargs):
        """Store nothing: hand the new keys/values and this cache to the kvtopo attention function,
        which does all the bookkeeping (host code, never traced). Nothing here reads the layer or
        the cache's state, so a compiled model's Dynamo traces it without guards on either: before,
        it traced the bookkeeping down to the session's pages, and compiled each layer's attention
        frame for its layer index, past its recompile limit."""
        kwargs[_BATCH_KWARG] = self
        return key_states, value_states

    def _start_forward(self) -> None:
        with self._lock:
            self._note_peak()
            # The forward stores what was admitted for it; the engine schedules again only after it
            # ran (async batching is off), when the measurement includes it.
            if self.budget_bytes is not None:
                self._reserve_slots()
            self._held, self._reserved, self._promised = None, 0, {}
            spans = []
            for request_id, past, tokens in self._recorded:
                seq = self.sequence_of.get(request_id)
                if seq is None:
                    seq = self.sequence_of[request_id] = self._next_seq
                    self._next_seq += 1
                spans.append(_Span(request_id, seq, past, tokens,
                                   _prompt_length(self.scheduler.active_requests[request_id])))
            self._spans, self._recorded = spans, []

    def _reserve_slots(self) -> None:
        """Grow each layer's pool by the slots admitted for the forward (their bytes are in the
        reservation), and let growth steps add no more free slots than the budget leaves."""
        pools = [layer.pool for layer in self.session.layers.values() if layer.pool is not None]
        spare = max(0, self.budget_bytes - self.held_bytes() - self._reserved) // max(1, len(pools))
        for name, layer in self.session.layers.items():
            if layer.pool is not None:
                layer.pool.spare = spare // layer.pool.page_nbytes
                layer.pool.reserve(self._promised.get(name, 0))

    def attend(self, module, query, key, value, scale: float, softcap: float | None) -> torch.Tensor:
        """query [1, Hq, T, d], key/value [1, Hkv, T, d] packed as the engine's spans -> [1, T, Hq, dv]."""
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None:
            raise RuntimeError(f"{type(module).__name__} has no layer_idx: kvtopo cannot tell its layers apart")
        layer = str(layer_idx)
        if self._recorded:  # the first layer of a forward: take the batch the engine packed for it
            self._start_forward()
        spans, total = self._spans, sum(span.tokens for span in self._spans)
        if query.shape[0] != 1 or total > query.shape[2]:
            raise RuntimeError(f"kvtopo continuous batching: the forward's query {tuple(query.shape)} does not hold the "
                               f"{total} tokens of the {len(spans)} requests the engine packed for it")
        sinks = getattr(module, "sinks", None)
        out = query.new_zeros(query.shape[2], query.shape[1], value.shape[-1])
        store = self.session.layers.get(layer)
        starts, start = [], 0
        for span in spans:
            held = store.length(span.seq) if store is not None else 0
            if held != span.past:
                raise RuntimeError(
                    f"request {span.request_id!r} continues at token {span.past} but kvtopo holds {held} tokens of its "
                    f"sequence {span.seq} in layer {layer}: the engine restored or shared a history kvtopo never "
                    "stored (prefix sharing or CPU offloading must stay off)")
            starts.append(start)
            start += span.tokens
        # Every decode step in one call, so that they share one batched kernel.
        decodes = [i for i, span in enumerate(spans) if span.decodes]
        if decodes:
            at = torch.tensor([starts[i] for i in decodes], device=query.device)
            out[at] = self.session.attend_sequences(
                layer, [spans[i].seq for i in decodes], *(_rows(x, at) for x in (query, key, value)), scale,
                softcap=softcap, sinks=sinks)[:, :, 0]
        for span, start in zip(spans, starts):
            if not span.decodes:
                end = start + span.tokens
                out[start:end] = self.session.attend_sequence(
                    layer, span.seq, query[0, :, start:end], key[0, :, start:end], value[0, :, start:end], scale,
                    softcap=softcap, sinks=sinks, prompt_end=span.prompt_end).transpose(0, 1)
        return out[None]

    # -- requests leaving ----------------------------------------------------------------------------
    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """The engine frees a request (finished, cancelled or evicted): free its kvtopo pages too."""
        super().free_blocks(request_id, no_cache)
        with self._lock:
            seq = self.sequence_of.pop(request_id, None)
            if seq is not None:
                self._note_peak()
                if self.request_stats is not None:
                    self.request_stats[request_id] = self.session.sequence_stats(seq)
                self.session.release(seq)
                self._held = None

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        with self._lock:
            for seq in self.sequence_of.values():
                self.session.release(seq)
            self.sequence_of.clear()
            self._held = None

    def _note_peak(self) -> None:
        """Measure the session (after a forward, before a release): its peak, and a budget miss."""
        stats = self.session.stats()
        if self.peak is None or stats.total_bytes > self.peak.total_bytes:
            self.peak = stats
        if self.budget_bytes is not None and stats.total_bytes > self.budget_bytes:
            self.budget_misses += 1
            logger.warning(f"kvtopo continuous batching: the session holds {stats.total_bytes} bytes, over the "
                           f"K/V budget of {self.budget_bytes}: an admission estimate was not an upper bound")


@contextmanager
def _engine_builds(cache_factory):
    """While the block runs, transformers' batch processor builds `cache_factory(...)` as its cache."""
    with _CACHE_CLASS_LOCK:
        original = continuous_api.PagedAttentionCache
        continuous_api.PagedAttentionCache = cache_factory
        try:
            yield
        finally:
            continuous_api.PagedAttentionCache = original


def engine_config(continuous_batching_config: ContinuousBatchingConfig | None = None) -> ContinuousBatchingConfig:
    """The engine's config with what kvtopo's store cannot follow turned off (see the module docstring)."""
    base = continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
    return replace(base, **_ENGINE_SETTINGS)


class KvtopoBatchingManager(continuous_api.ContinuousBatchingManager):
    """transformers' ContinuousBatchingManager whose KV cache is the kvtopo `session`.

    Use it as the engine's manager (`add_request`, `get_result`, `start`, `stop`, ...), or through
    `generate_batch`. The session must be active (`with session:`) while the manager runs.
    `kv_budget_bytes`: admit requests by the session's bytes (module docstring); the engine's
    `num_blocks` must then be set, to a ledger of logical tokens large enough not to bind.
    `record_request_stats`: keep what each request's sequence held when it was freed
    (`kv_cache.request_stats`)."""

    def __init__(self, model, session: Session, generation_config: GenerationConfig | None = None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None,
                 workload_hints: WorkloadHints | None = None, *, kv_budget_bytes: int | None = None,
                 record_request_stats: bool = False):
        check_transformers_version()
        if not isinstance(session, Session):
            raise TypeError(f"session must be a kvtopo Session, got {type(session).__name__}")
        if any(layer.length(seq) for layer in session.layers.values() for seq in layer.sequences):
            raise ValueError("this session already holds sequences; continuous batching numbers its requests from 0 "
                             "and releases each in every layer when it ends: give it a session of its own")
        if kv_budget_bytes is not None:
            if kv_budget_bytes < 1:
                raise ValueError(f"kv_budget_bytes must be a positive number of bytes, got {kv_budget_bytes}")
            if continuous_batching_config is None or continuous_batching_config.num_blocks is None:
                raise ValueError("with kv_budget_bytes the engine's block ledger must be sized by hand "
                                 "(ContinuousBatchingConfig.num_blocks: logical tokens / page_size, enough not to "
                                 "bind; see ledger_blocks); transformers would size it from free device memory")
        text_config = model.config.get_text_config()
        layer_types = set(group_layers_by_attn_type(text_config))
        if layer_types != {FULL_ATTENTION}:
            raise NotImplementedError(f"kvtopo continuous batching supports full-attention layers only; this model has "
                                      f"{sorted(layer_types)}")
        generation_config = generation_config if generation_config is not None else model.generation_config
        if (generation_config.num_return_sequences or 1) > 1:
            raise NotImplementedError("num_return_sequences > 1 forks a request's cache blocks, which kvtopo's store "
                                      "does not follow; ask for each sequence as its own request")
        if generation_config.eos_token_id is None:  # as init_continuous_batching does
            generation_config = replace_generation_config(generation_config, eos_token_id=-1)
        AttentionInterface.register(ATTN_IMPLEMENTATION, kvtopo_paged_attention)
        session.engine = self  # the store holds this engine's requests: kvtopo.generate must not clear it
        self.session = session
        self.kv_budget_bytes = kv_budget_bytes
        self.record_request_stats = record_request_stats
        self.kv_cache: KvtopoPagedCache | None = None
        super().__init__(model, generation_config, engine_config(continuous_batching_config), workload_hints)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        """Attention through kvtopo's store (the engine's default picks sdpa/eager/flash over its own cache)."""
        original = model.config._attn_implementation
        if original != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            self._original_attn_impl = original

    def add_request(self, input_ids: list[int], *args, **kwargs) -> str | None:
        """The engine's `add_request` (`transformers serve` and `add_requests` call it), refusing a
        prompt the engine would mishandle (`_check_prompts`) before it reaches the batch."""
        _check_prompts(self.model, [input_ids], "KvtopoBatchingManager.add_request")
        return super().add_request(input_ids, *args, **kwargs)

    def start(self) -> None:
        """transformers' `stop()` puts the model's own attention back; a restart attends through
        kvtopo's store again (before, it ran sdpa over a cache that stores nothing)."""
        self.switch_to_cb_friendly_attn(self.model)
        super().start()

    def _create_batch_processor(self):
        with _engine_builds(functools.partial(KvtopoPagedCache, session=self.session, budget_bytes=self.kv_budget_bytes,
                                              record_request_stats=self.record_request_stats)):
            processor = super()._create_batch_processor()
        if not isinstance(processor.cache, KvtopoPagedCache):
            raise RuntimeError("transformers built its own paged cache instead of kvtopo's: this transformers build "
                               f"differs from {TRANSFORMERS_VERSION}")
        self.kv_cache = processor.cache
        self.kv_cache.scheduler = processor.scheduler
        return processor


def _check_prompts(model, inputs: list[list[int]], caller: str = "generate_batch") -> None:
    """Every prompt one or more integer ids inside the model's vocabulary. The engine takes an
    empty prompt's first token from another request's logits (or, alone, its worker dies), and an
    id outside the vocabulary fails the whole batch with an indexing error deep in the model."""
    vocab = model.get_input_embeddings().num_embeddings
    for i, ids in enumerate(inputs):
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise ValueError(f"{caller}: prompt {i} is a {ids.dim()}-d {ids.dtype} tensor; a prompt is a list "
                                 "(or 1-d integer tensor) of token ids")
            ids = ids.tolist()
        if not len(ids):
            raise ValueError(f"{caller}: prompt {i} is empty; every request needs at least one token")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{caller}: prompt {i} holds values that are not integer token ids")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"{caller}: prompt {i} holds ids outside the vocabulary [0, {vocab}): "
                             f"{min(ids)}..{max(ids)}")


def replace_generation_config(generation_config: GenerationConfig, **changes) -> GenerationConfig:
    """A copy of `generation_config` with `changes` (the caller's object is left as it is)."""
    copy = GenerationConfig.from_dict(generation_config.to_dict())
    copy.update(**changes)
    return copy


@dataclass(frozen=True)
class BatchResult:
    """What `generate_batch` returns: the engine's outputs (request id -> GenerationOutput, in the
    order of the inputs), the session's stats when it held the most bytes, and what each request's
    sequence held when it finished."""

    outputs: dict[str, GenerationOutput]
    peak: CacheStats | None
    request_stats: dict[str, SequenceStats] = field(default_factory=dict)


def generate_batch(model, inputs: list[list[int]], config: Config | None = None, *, max_new_tokens: int | None = None,
                   generation_config: GenerationConfig | None = None,
                   continuous_batching_config: ContinuousBatchingConfig | None = None,
                   session: Session | None = None, kv_budget_bytes: int | None = None) -> BatchResult:
    """transformers' `model.generate_batch(inputs, ...)` with kvtopo's store as the KV cache.

    `config`: the kvtopo Config of a new session (default `Config()`); or pass `session` (then its
    config is used, and its stats can be read afterwards; every request is released when it
    finishes). `kv_budget_bytes`: admit by kvtopo's bytes (the engine's ledger, unless set, is
    sized to hold every input at once). A request that fails raises here (transformers'
    generate_batch logs it and returns the others)."""
    if session is None:
        session = Session(config)
    elif config is not None and config != session.config:
        raise ValueError("generate_batch: pass config= or session=, not two different configs")
    if not inputs:
        return BatchResult({}, None)
    _check_prompts(model, inputs)
    gen = generation_config if generation_config is not None else model.generation_config
    new_tokens = max_new_tokens if max_new_tokens is not None else gen.max_new_tokens
    hints = WorkloadHints(max_prompt_length=max(len(ids) for ids in inputs),
                          max_generated_length=new_tokens or 0, num_requests=len(inputs))
    if kv_budget_bytes is not None:
        cb = continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig()
        if cb.num_blocks is None:
            cb = replace(cb, num_blocks=ledger_blocks([len(ids) + (new_tokens or 0) for ids in inputs], cb.page_size))
        continuous_batching_config = cb
    manager = KvtopoBatchingManager(model, session, gen, continuous_batching_config, hints,
                                    kv_budget_bytes=kv_budget_bytes, record_request_stats=True)
    # transformers' entry point reuses a manager cached on the model: generate_batch then runs ours.
    model._cached_continuous_batching_manager = manager
    try:
        with (session if not session.active else nullcontext()):
            outputs = model.generate_batch(inputs, generation_config=gen, max_new_tokens=new_tokens, warmup=False)
    finally:
        if getattr(model, "_cached_continuous_batching_manager", None) is manager:
            del model._cached_continuous_batching_manager
    if manager.kv_cache is None:
        raise RuntimeError("transformers' generate_batch did not run kvtopo's manager (it reuses a manager cached on "
                           "the model only if it is its own ContinuousBatchingManager class)")
    failed = {rid: out.error for rid, out in outputs.items() if out.error is not None}
    if failed or len(outputs) != len(inputs):
        raise RuntimeError(f"kvtopo continuous batching: {len(outputs)} of {len(inputs)} requests returned; "
                           f"failed: {failed}")
    return BatchResult(outputs, manager.kv_cache.peak, dict(manager.kv_cache.request_stats))


def ledger_blocks(request_tokens: list[int], page_size: int) -> int:
    """The engine's block ledger (`num_blocks`) that holds requests of these token counts all at
    once: under byte admission it only indexes tokens, and must never be what refuses one."""
    return sum(-(-n // page_size) for n in request_tokens) + 1


def page_ownership_errors(session: Session) -> list[str]:
    """How the session's pools break page ownership, as messages (empty: none): a pool slot in
    two sequences' block tables, a block table pointing outside its pool, or a pool counting more
    or fewer live slots than its layer's block tables hold (a leaked or a double-counted slot)."""
    errors = []
    for name, cache in session.layers.items():
        owner: dict[int, int] = {}
        for seq, entry in cache.sequences.items():
            for slot in entry.block_table.tolist():
                if slot in owner:
                    errors.append(f"layer {name}: slot {slot} is in the block tables of sequences {owner[slot]} and {seq}")
                owner[slot] = seq
                if cache.pool is None or not 0 <= slot < cache.pool.capacity:
                    errors.append(f"layer {name}: sequence {seq} points at slot {slot}, outside its pool")
        live = cache.pool.live_pages if cache.pool is not None else 0
        if live != len(owner):
            errors.append(f"layer {name}: the pool has {live} live slots but block tables hold {len(owner)}")
    return errors
