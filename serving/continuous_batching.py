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
  request's history in the kvtopo session and appends the span's keys/values to it
  (`Session.attend_sequence`);
* the cache: `KvtopoPagedCache`, a `PagedAttentionCache` whose `update` stores nothing (the new
  keys/values go to attention as they are) and whose physical tensor is dropped (a meta tensor).
  The engine's block ledger is kept as its admission control: it still admits requests by its
  `num_blocks` pages of logical tokens (not by kvtopo's bytes). The cache records, in the order the
  engine packs them, which request each span of the next forward belongs to (the engine reports it
  through `extend_read_and_write_indices` / `fill_block_table`), maps each request id to a kvtopo
  sequence id, and releases the request's pages in every layer (`Session.release`) when the engine
  frees its blocks: when it finishes, is cancelled, or is evicted (offloaded and later re-prefilled
  from scratch). Every layer of the session has one `PagePool`, shared by all requests; a released
  slot goes back on its free list and is the next one handed out.

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
(under a lock, then restored). This relies on transformers 5.24.0's internals, so this module
raises on any other transformers version (`TRANSFORMERS_VERSION`).
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
import transformers
from transformers import AttentionInterface, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache, group_layers_by_attn_type
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.requests import GenerationOutput
from transformers.generation.continuous_batching.utils import WorkloadHints

from kvtopo.config import Config
from kvtopo.runtime.session import CacheStats, Session

__all__ = ["ATTN_IMPLEMENTATION", "BatchResult", "KvtopoBatchingManager", "KvtopoPagedCache", "TRANSFORMERS_VERSION",
           "generate_batch", "page_ownership_errors"]

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


def kvtopo_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention-interface function: the packed batch's attention over kvtopo's store."""
    cache = kwargs.get(_BATCH_KWARG)
    if not isinstance(cache, KvtopoPagedCache):
        raise RuntimeError(f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside kvtopo's continuous batching "
                           "(kvtopo.serving.continuous_batching), whose cache supplies each request's history")
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} attention is for inference: dropout={dropout} is not supported")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache.attend(module, query, key, value, scaling, kwargs.get("softcap")), None


@dataclass(frozen=True)
class _Span:
    """One request's tokens in the packed forward: kvtopo sequence, engine past length, token count."""

    request_id: str
    seq: int
    past: int
    tokens: int


class KvtopoPagedCache(PagedAttentionCache):
    """The engine's paged cache with kvtopo's session as the store (see the module docstring)."""

    def __init__(self, *args, session: Session, **kwargs):
        super().__init__(*args, **kwargs)
        self.session = session
        self._drop_physical_cache()
        self.sequence_of: dict[str, int] = {}  # request id -> kvtopo sequence id, while the request holds pages
        self._next_seq = 0
        self._recorded: list[tuple[str, int, int]] = []  # what the engine packed for the next forward
        self._spans: list[_Span] = []  # the forward running now
        self.peak: CacheStats | None = None  # session stats when it held the most bytes (checked per forward)
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
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)
        self._recorded.append((request_id, past_length, query_length))

    def fill_block_table(self, request_id, past_length, query_length, block_table):
        super().fill_block_table(request_id, past_length, query_length, block_table)
        self._recorded.append((request_id, past_length, query_length))

    # -- the forward ---------------------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx, kwargs):
        """Store nothing: hand the new keys/values and this cache to the kvtopo attention function."""
        if self._recorded:  # the first layer of a forward: take the batch the engine packed for it
            self._start_forward()
        kwargs[_BATCH_KWARG] = self
        return key_states, value_states

    def _start_forward(self) -> None:
        with self._lock:
            self._note_peak()
            spans = []
            for request_id, past, tokens in self._recorded:
                seq = self.sequence_of.get(request_id)
                if seq is None:
                    seq = self.sequence_of[request_id] = self._next_seq
                    self._next_seq += 1
                spans.append(_Span(request_id, seq, past, tokens))
            self._spans, self._recorded = spans, []

    def attend(self, module, query, key, value, scale: float, softcap: float | None) -> torch.Tensor:
        """query [1, Hq, T, d], key/value [1, Hkv, T, d] packed as the engine's spans -> [1, T, Hq, dv]."""
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None:
            raise RuntimeError(f"{type(module).__name__} has no layer_idx: kvtopo cannot tell its layers apart")
        layer = str(layer_idx)
        spans, total = self._spans, sum(span.tokens for span in self._spans)
        if query.shape[0] != 1 or total > query.shape[2]:
            raise RuntimeError(f"kvtopo continuous batching: the forward's query {tuple(query.shape)} does not hold the "
                               f"{total} tokens of the {len(spans)} requests the engine packed for it")
        sinks = getattr(module, "sinks", None)
        out = query.new_zeros(query.shape[2], query.shape[1], value.shape[-1])
        start = 0
        store = self.session.layers.get(layer)
        for span in spans:
            held = store.length(span.seq) if store is not None else 0
            if held != span.past:
                raise RuntimeError(
                    f"request {span.request_id!r} continues at token {span.past} but kvtopo holds {held} tokens of its "
                    f"sequence {span.seq} in layer {layer}: the engine restored or shared a history kvtopo never "
                    "stored (prefix sharing or CPU offloading must stay off)")
            end = start + span.tokens
            out[start:end] = self.session.attend_sequence(
                layer, span.seq, query[0, :, start:end], key[0, :, start:end], value[0, :, start:end], scale,
                softcap=softcap, sinks=sinks).transpose(0, 1)
            store = self.session.layers[layer]
            start = end
        return out[None]

    # -- requests leaving ----------------------------------------------------------------------------
    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """The engine frees a request (finished, cancelled or evicted): free its kvtopo pages too."""
        super().free_blocks(request_id, no_cache)
        with self._lock:
            seq = self.sequence_of.pop(request_id, None)
            if seq is not None:
                self._note_peak()
                self.session.release(seq)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        with self._lock:
            for seq in self.sequence_of.values():
                self.session.release(seq)
            self.sequence_of.clear()

    def _note_peak(self) -> None:
        stats = self.session.stats()
        if self.peak is None or stats.total_bytes > self.peak.total_bytes:
            self.peak = stats


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
    `generate_batch`. The session must be active (`with session:`) while the manager runs."""

    def __init__(self, model, session: Session, generation_config: GenerationConfig | None = None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None,
                 workload_hints: WorkloadHints | None = None):
        check_transformers_version()
        if not isinstance(session, Session):
            raise TypeError(f"session must be a kvtopo Session, got {type(session).__name__}")
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
        self.session = session
        self.kv_cache: KvtopoPagedCache | None = None
        super().__init__(model, generation_config, engine_config(continuous_batching_config), workload_hints)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        """Attention through kvtopo's store (the engine's default picks sdpa/eager/flash over its own cache)."""
        original = model.config._attn_implementation
        if original != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            self._original_attn_impl = original

    def _create_batch_processor(self):
        with _engine_builds(functools.partial(KvtopoPagedCache, session=self.session)):
            processor = super()._create_batch_processor()
        if not isinstance(processor.cache, KvtopoPagedCache):
            raise RuntimeError("transformers built its own paged cache instead of kvtopo's: this transformers build "
                               f"differs from {TRANSFORMERS_VERSION}")
        self.kv_cache = processor.cache
        return processor


def replace_generation_config(generation_config: GenerationConfig, **changes) -> GenerationConfig:
    """A copy of `generation_config` with `changes` (the caller's object is left as it is)."""
    copy = GenerationConfig.from_dict(generation_config.to_dict())
    copy.update(**changes)
    return copy


@dataclass(frozen=True)
class BatchResult:
    """What `generate_batch` returns: the engine's outputs (request id -> GenerationOutput, in the
    order of the inputs) and the session's stats when it held the most bytes."""

    outputs: dict[str, GenerationOutput]
    peak: CacheStats | None


def generate_batch(model, inputs: list[list[int]], config: Config | None = None, *, max_new_tokens: int | None = None,
                   generation_config: GenerationConfig | None = None,
                   continuous_batching_config: ContinuousBatchingConfig | None = None,
                   session: Session | None = None) -> BatchResult:
    """transformers' `model.generate_batch(inputs, ...)` with kvtopo's store as the KV cache.

    `config`: the kvtopo Config of a new session (default `Config()`); or pass `session` (then its
    config is used, and its stats can be read afterwards; every request is released when it
    finishes). A request that fails raises here (transformers' generate_batch logs it and returns
    the others)."""
    if session is None:
        session = Session(config)
    elif config is not None and config != session.config:
        raise ValueError("generate_batch: pass config= or session=, not two different configs")
    if not inputs:
        return BatchResult({}, None)
    gen = generation_config if generation_config is not None else model.generation_config
    new_tokens = max_new_tokens if max_new_tokens is not None else gen.max_new_tokens
    hints = WorkloadHints(max_prompt_length=max(len(ids) for ids in inputs),
                          max_generated_length=new_tokens or 0, num_requests=len(inputs))
    manager = KvtopoBatchingManager(model, session, gen, continuous_batching_config, hints)
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
    return BatchResult(outputs, manager.kv_cache.peak)


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
