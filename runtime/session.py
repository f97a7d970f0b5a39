"""A kvtopo session: one KV store shared by every kvtopo attention call made inside it.

Batch row b of every call is sequence b of the session. Each call of `attend` gathers the layer's
stored history for each sequence, attends over [history ; new chunk] (causal within the chunk),
then appends the chunk's new k/v. Tokens marked invalid for the current step (left padding) are
neither attended to nor stored. Decode steps (one token per sequence) of the whole batch are one
batched kernel call over the stored codes; a token that moves no page is written into its
Terminal page first (`LayerCache.write_in_place`) and read there; the observation windows are
kept per sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import contextmanager
import dataclasses
import operator
import weakref
from dataclasses import dataclass

import torch

from kvtopo.config import Config
from kvtopo.kernels.compressed_attention import merge_partials, partial_causal, partial_dense, partial_lowrank
from kvtopo.kernels.history_attention import history_attention
from kvtopo.kernels.reference import chunk_causal_mask, grouped_attention

from . import context, declared_attention
from .decode_batch import decode_step
from .decode_view import attend_cache_batch, decode_segments
from .layer_cache import LayerCache, Segments
from .policies import make_policy


@dataclass(frozen=True)
class CacheStats:
    """Bytes held by the session's KV tensors: pool slots (live and free), encoded pages and
    metadata (block tables, bases, observation queries). `per_kind` splits them by page phase
    (initial/mid/recent/terminal) plus "free" pool slots and "metadata"."""

    total_bytes: int
    per_layer: dict[str, int]
    per_kind: dict[str, int]
    tokens: tuple[int, ...]
    fp16_bytes: int
    budget_missed: bool = False  # some sequence-layer holds more than its budget right now
    # Per layer, the tokens each sequence still holds in any form (a sliding-window layer: at
    # most its window plus a page; an evicting policy: fewer than stored).
    held_tokens: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @property
    def ratio_vs_fp16(self) -> float:
        """How many times smaller than an fp16 cache of the same tokens (inf when nothing is held;
        0 when the pools hold only free slots, e.g. after `clear()`)."""
        return self.fp16_bytes / self.total_bytes if self.total_bytes else float("inf")


@dataclass(frozen=True)
class SequenceStats:
    """What one sequence holds over every layer -- its pages, codes and metadata (the pools' free
    slots are shared: only `Session.stats` counts them) -- against an fp16 cache of its tokens,
    and the tokens it still holds in each layer (`CacheStats.held_tokens`)."""

    total_bytes: int
    fp16_bytes: int
    tokens: int
    held_tokens: tuple[int, ...]
    budget_missed: bool = False  # one of its layers holds more than its budget now

    ratio_vs_fp16 = CacheStats.ratio_vs_fp16


class Session:
    def __init__(self, config: Config | None = None):
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"a kvtopo session takes a kvtopo.Config, got {type(config).__name__}")
        self.config = config if config is not None else Config()
        self.policy = make_policy(self.config)
        self.layers: dict[str, LayerCache] = {}
        self._batch: int | None = None
        self._step_valid: torch.Tensor | None = None
        self._step_full: list[int] | None = None  # the step's rows without padding
        self._prompt_end: dict[int, int] = {}  # sequence -> the length its prompt reaches (`step`)
        self._mask_passed: _PassedMask | None = None  # the last mask (and arguments) that passed the checks
        self._token = None
        self._models: dict[int, tuple[weakref.ref, str]] = {}  # id(model key) -> (its ref, name)
        self._computed_starts: dict[str, int] = {}  # model name -> `computed_positions_start` over an empty store
        self._unfinished: dict[int, str] = {}  # sequence -> the error that left part of a chunk stored
        self._forward_layers: set[str] | None = None  # layers attended in the model forward under way
        self.calls = 0
        # Counts every change of what the stores hold (an attend, a release, a clear): a record of
        # the token ids fed to them (kvtopo.hf_cache) is current while this count is unchanged.
        self.changes = 0
        self.engine = None  # a continuous-batching engine whose requests the stores hold (serving/)

    # -- lifetime -----------------------------------------------------------------------------
    def __enter__(self) -> "Session":
        if self._token is not None:
            raise RuntimeError("this kvtopo session is already active")
        self._token = context.enter(self)
        return self

    def __exit__(self, *exc) -> None:
        if context.active_session() is not self:  # a context variable restores what was active at entry
            raise RuntimeError("kvtopo session exited where it is not the innermost active session: exit sessions "
                               "in the reverse order of entering them, in the thread that entered them (use `with`)")
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
        self._unfinished.clear()
        self._computed_starts.clear()
        self.changes += 1

    @contextmanager
    def model_forward(self):
        """One forward of a model (`kvtopo.compile`'s call, `kvtopo.generate`'s step): a site
        attended twice in it raises. A module a model calls at two places split by a graph break
        gets one site name in both graphs, and its two calls would share one store."""
        outer, self._forward_layers = self._forward_layers, set()
        try:
            yield
        finally:
            self._forward_layers = outer

    @contextmanager
    def step(self, valid: torch.Tensor, prompt_end: Sequence[int] | None = None):
        """Mark which tokens of the next forward's chunk are real ([B, T] bool; False = padding).
        `prompt_end`: when the chunk is part of a longer prompt, the length (real tokens) each row's
        sequence (row b: sequence b, as in `attend`) reaches at the prompt's end; its pages are then
        budgeted at that length and wait in Recent until it, then ranked together, as if the prompt
        came in one chunk (`Lifecycle.budget_length`, `Lifecycle.holds`)."""
        if valid.dtype != torch.bool or valid.dim() != 2:
            raise ValueError(f"step validity must be a [batch, tokens] bool tensor, got {valid.dtype} {tuple(valid.shape)}")
        ends = [] if prompt_end is None else [int(n) for n in prompt_end]
        if prompt_end is not None and (len(ends) != valid.shape[0] or min(ends) < 0):
            raise ValueError(f"prompt_end must give one length >= 0 per row of the step's batch of {valid.shape[0]}, "
                             f"got {ends}")
        self._step_valid = valid
        self._step_full = valid.all(1).nonzero().squeeze(1).tolist()
        self._prompt_end = dict(enumerate(ends))
        try:
            yield
        finally:
            self._step_valid = self._step_full = None
            self._prompt_end = {}

    # -- the op's entry point -------------------------------------------------------------------
    def attend(self, layer: str, query, key, value, attn_mask, scale: float, *, is_causal: bool = True,
               window: int | None = None, softcap: float | None = None,
               shared_value_dim: int | None = None, model_key: torch.Tensor | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of `query` over this layer's history and the new `key`/`value` chunk.

        The session applies its own mask: causal over [history ; chunk], the sliding `window` if
        the site has one, and the step's padding. `attn_mask` / `is_causal` are what the graph
        asked for over the chunk; they are checked to say exactly that (see `_check_chunk_mask`),
        so a mask the session cannot honour raises instead of being dropped.
        `softcap`: logits are `softcap * tanh(logits / softcap)` (Gemma-2).
        `shared_value_dim`: the values are the first that many dims of the keys (MLA latents),
        so `value` is ignored and only the keys are stored.
        `model_key`: a parameter of the calling model; its layers are stored as
        '<model name>/<layer>', so two models in one session never share a store.
        `sinks`: [Hq] attention sinks (gpt-oss), one more logit per query head in every row's
        softmax with no value behind it: merged as one more segment (output 0, lse = the sink).
        """
        if not self.active:
            raise RuntimeError("kvtopo session used after it was closed")
        _check_shapes(layer, query, key, None if shared_value_dim else value)
        batch, _, chunk, _ = query.shape
        if self._batch is None:
            self._batch = batch
        elif batch != self._batch:
            raise ValueError(
                f"this session holds {self._batch} sequences but the call has batch {batch}; "
                "use one session per batch (or session.clear())"
            )
        valid = self._step_valid
        if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
            raise ValueError(f"attention site {layer!r} has sinks of shape {tuple(sinks.shape)}, "
                             f"not one per query head ({query.shape[1]})")
        if valid is not None and tuple(valid.shape) != (batch, chunk):
            raise ValueError(f"step validity has shape {tuple(valid.shape)}, the call has (batch, tokens)=({batch}, {chunk})")
        declared = declared_attention.declared(model_key, layer)
        if window is None and declared is not None:
            # The config declares what the graph cannot show: HF skipped the mask, or passed one into a
            # graph of its own (a block compiled apart after a graph break), checked against it below.
            window = _declared_window(layer, declared) if attn_mask is None else declared.window
        arguments = (is_causal, window, batch, chunk)
        passed = self._mask_passed  # a model passes one mask to all its layers: checked once while unchanged
        if passed is None or not passed.matches(attn_mask, valid, arguments):
            _check_pure_mask(layer, attn_mask)
            _check_chunk_mask(layer, attn_mask, is_causal, window, valid, batch, chunk)
            self._mask_passed = _PassedMask.record(attn_mask, valid, arguments)
        if model_key is not None:
            layer = f"{self.model_name(model_key)}/{layer}"
        if self._forward_layers is not None:
            if layer in self._forward_layers:
                raise RuntimeError(
                    f"kvtopo: attention site {layer!r} ran twice in one forward: a module the model calls at two "
                    "places split by a graph break has one site name in both graphs, so both calls would store "
                    "into one cache. Remove the graph break between the calls, or give each call its own module")
            self._forward_layers.add(layer)
        cache = self._layer_cache(layer, scale, softcap, shared_value_dim, window)
        if declared is not None:
            _check_continuation(layer, declared, cache.longest(), chunk)
        if shared_value_dim:
            value = key[..., :shared_value_dim]

        full = self._step_full if valid is not None else list(range(batch))
        with self._storing(range(batch)):  # rows with padding are stored apart: an error may stop between them
            if len(full) == batch:
                out = self._attend_and_store(cache, full, query, key, value, scale, softcap, sinks, self._prompt_end)
            else:
                out = query.new_zeros(*query.shape[:-1], value.shape[-1])
                if full:
                    out[full] = self._attend_and_store(cache, full, query[full], key[full], value[full], scale,
                                                       softcap, sinks, self._prompt_end)
                for b in sorted(set(range(batch)) - set(full)):  # rows with padding: their real tokens only
                    rows = valid[b].nonzero().squeeze(1)
                    if not rows.numel():  # padding only: nothing to attend or store, its output stays zero
                        continue
                    one = slice(b, b + 1), slice(None), rows
                    out[b, :, rows] = self._attend_and_store(cache, [b], query[one], key[one], value[one], scale,
                                                             softcap, sinks, self._prompt_end)[0]
        cache.columns += chunk
        return out

    def attend_sequence(self, layer: str, seq: int, query, key, value, scale: float, *,
                        softcap: float | None = None, sinks: torch.Tensor | None = None,
                        prompt_end: int = 0) -> torch.Tensor:
        """Attention of one sequence's queries [Hq, T, d] over layer `layer`'s history of sequence
        `seq` and its new keys/values [Hkv, T, d] (causal within the chunk), then store the chunk.
        `prompt_end`: when the chunk is part of a longer prompt, the length the sequence reaches
        at the prompt's end, as `step` takes it (0: not said).

        For callers that keep their own request -> sequence map (a serving engine packing many
        requests into one flat batch): any int is a sequence id, sequences join when first seen
        and leave with `release`. `attend` (batch row b = sequence b) is for one fixed batch."""
        if not self.active:
            raise RuntimeError("kvtopo session used after it was closed")
        if prompt_end < 0:
            raise ValueError(f"prompt_end must be a length >= 0, got {prompt_end}")
        seq = _sequence_id(seq)
        cache = self._layer_cache(layer, scale, softcap, None, None)
        with self._storing([seq]):
            return self._attend_and_store(cache, [seq], query[None], key[None], value[None], scale, softcap, sinks,
                                          {seq: prompt_end})[0]

    def attend_sequences(self, layer: str, seqs: Sequence[int], query, key, value, scale: float, *,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """`attend_sequence` for several distinct sequences at once, each with its chunk of T new
        tokens: query [N, Hq, T, d], key/value [N, Hkv, T, d], row i of sequence ``seqs[i]``
        -> [N, Hq, T, dv]. The rows that are decode steps (T = 1, over a stored history) are
        attended by one batched decode call; the others one by one."""
        if not self.active:
            raise RuntimeError("kvtopo session used after it was closed")
        seqs = [_sequence_id(seq) for seq in seqs]
        if len(set(seqs)) != len(seqs) or len(seqs) != query.shape[0]:
            raise ValueError(f"attend_sequences needs one row per distinct sequence, got ids {seqs} "
                             f"for {query.shape[0]} rows")
        cache = self._layer_cache(layer, scale, softcap, None, None)
        with self._storing(seqs):
            return self._attend_and_store(cache, seqs, query, key, value, scale, softcap, sinks, None)

    def release(self, seq: int) -> None:
        """Forget sequence `seq` in every layer: its pool slots go back to each layer's free list.
        A sequence the session does not hold is nothing to release (a server may free a request
        that never reached attention)."""
        seq = _sequence_id(seq)
        for cache in self.layers.values():
            cache.release(seq)
        self._unfinished.pop(seq, None)
        self.changes += 1

    def _layer_cache(self, layer: str, scale: float, softcap: float | None, shared_value_dim: int | None,
                     window: int | None) -> LayerCache:
        """The store of `layer` for this call (made on first use; a layer keeps the value sharing
        and window it was made with), counting the call."""
        cache = self.layers.get(layer)
        if cache is None:
            cache = self.layers[layer] = self._new_layer(shared_value_dim, window)
        elif cache.shared_value_dim != shared_value_dim or cache.window != window:
            raise ValueError(f"layer {layer!r} was cached with shared_value_dim={cache.shared_value_dim}, "
                             f"window={cache.window}; now called with {shared_value_dim}, {window}")
        cache.scale, cache.softcap = scale, softcap  # what eviction scores see
        self.calls += 1
        self.changes += 1
        return cache

    def _new_layer(self, shared_value_dim: int | None, window: int | None) -> LayerCache:
        """A layer's store. A windowed layer only ever needs its last `window` tokens, so it keeps
        them exactly (the compression policy applies to the global layers) and frees the rest; its
        bytes are measured against the session's budget (`stats().budget_missed`), never evicted
        for it."""
        if window is None:
            return LayerCache(self.config, self.policy, shared_value_dim)
        exact = Config.lossless(page_size=self.config.page_size, max_pages=self.config.max_pages)
        return LayerCache(exact, make_policy(exact), shared_value_dim, window=window, reported_budget=self.config)

    def model_name(self, model_key: torch.Tensor) -> str:
        """'model0', 'model1', ... in the order the session first sees each model's key parameter."""
        entry = self._models.get(id(model_key))
        if entry is None or entry[0]() is not model_key:  # new, or a freed tensor's id reused
            entry = self._models[id(model_key)] = (weakref.ref(model_key), f"model{len(self._models)}")
        return entry[1]

    def model_layers(self, model: torch.nn.Module | None = None) -> list[LayerCache]:
        """The stores of `model`'s layers (by the key parameter its graphs pass), or of every
        layer when `model` is None; raises when that would mix several models' stores."""
        if model is None:
            if len(self._models) > 1:
                raise ValueError(f"this session holds the stores of {len(self._models)} models; say which one "
                                 "(kvtopo.hf_cache.SessionCache(session, model=model))")
            return list(self.layers.values())
        parameters = {id(p): p for p in model.parameters()}
        names = {name for key, (ref, name) in self._models.items() if parameters.get(key) is ref() is not None}
        return [cache for layer, cache in self.layers.items() if layer.split("/")[0] in names]

    def model_row_tokens(self, model_key: torch.Tensor, batch: int) -> torch.Tensor:
        """The tokens each of `batch` rows stores for the model `model_key` belongs to ([batch]
        int64; padding is never stored): where a model numbers a row's tokens by its mask (OPT)."""
        cache = self._first_layer(model_key)
        return torch.tensor([cache.length(row) if cache is not None else 0 for row in range(batch)])

    def model_length(self, model_key: torch.Tensor) -> int:
        """The length HF's cache would report for the model `model_key` belongs to: the batch's
        columns its forwards attended, padding included (a left-padded row stores fewer tokens)."""
        cache = self._first_layer(model_key)
        return cache.columns if cache is not None else 0

    def computed_positions_start(self, model_key: torch.Tensor, start: int) -> int:
        """The lowest first position the model's graphs computed from numbers of their own
        (`kvtopo.given_positions(fixed=True)`) while its store was empty: `start` is recorded when
        it is. A graph that ignores the store numbers every chunk from there again (`arange(T) + 2`
        gives 2), so a continuation's positions begin that far past the stored length."""
        name = self.model_name(model_key)
        if self.model_length(model_key) == 0:
            self._computed_starts[name] = min(start, self._computed_starts.get(name, start))
        return self._computed_starts.get(name, 0)

    def _first_layer(self, model_key: torch.Tensor) -> LayerCache | None:
        """The first layer the model `model_key` belongs to has stored (None before its first call)."""
        prefix = self.model_name(model_key) + "/"
        return next((cache for name, cache in self.layers.items() if name.startswith(prefix)), None)

    @contextmanager
    def _storing(self, seqs: Sequence[int]):
        """A call that stores chunks of `seqs`. Refused for a sequence an earlier error left stored
        in part; an error on the way (the pool full, a budget that cannot be met) may leave this
        call's chunks stored in part (some rows, some layers), so all of `seqs` then raise here
        until they are released."""
        if self._unfinished:
            self._refuse_unfinished(seqs)
        try:
            yield
        except BaseException as error:
            for seq in seqs:
                self._unfinished.setdefault(seq, f"{type(error).__name__}: {error}")
            raise

    def _refuse_unfinished(self, seqs: Sequence[int]) -> None:
        unfinished = {seq: self._unfinished[seq] for seq in seqs if seq in self._unfinished}
        if unfinished:
            seq, error = next(iter(unfinished.items()))
            raise RuntimeError(
                f"kvtopo: sequence(s) {sorted(unfinished)} hold a chunk stored in part, left by an earlier error "
                f"(sequence {seq}: {error}); release them (session.release(seq)) or clear the session "
                "(session.clear()) before attending them again")

    def _attend_and_store(self, cache: LayerCache, seqs: Sequence[int], q, k, v, scale: float,
                          softcap: float | None, sinks: torch.Tensor | None,
                          prompt_end: Mapping[int, int] | None) -> torch.Tensor:
        """Attend q[i] [Hq, T, d] of sequence seqs[i] over [its history ; its chunk k[i], v[i]],
        then store the chunks (inside `_storing`). A decode step of the same sequences as the
        layer's last one goes through its ``DecodeBatch`` where that takes it
        (runtime/decode_batch.py); otherwise decode steps that can read the stored codes directly
        (C kernel on CPU, Triton on CUDA) go together through one batched call, and the other rows
        one by one. `prompt_end`: sequence -> the length its prompt reaches (`step`); a one-token
        chunk with more of its prompt to come is a prompt chunk, not a decode step: its append is
        told the prompt's end."""
        prompt_end = prompt_end or {}
        prompt = {i for i, seq in enumerate(seqs) if prompt_end.get(seq, 0) > cache.length(seq) + q.shape[2]} \
            if prompt_end else set()  # a decode step's call says no prompt end: no walk over its sequences
        if q.shape[2] == 1 and sinks is None and not prompt:
            out = decode_step(cache, seqs, q, k, v, scale, softcap)
            if out is not None:
                return out
        fast = [i for i, seq in enumerate(seqs) if i not in prompt and self._reads_codes(cache, seq, q[i], sinks)]
        if len(fast) == len(seqs):
            return self._decode_batch(cache, seqs, q, k, v, scale, softcap)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        if fast:
            out[fast] = self._decode_batch(cache, [seqs[i] for i in fast], q[fast], k[fast], v[fast], scale, softcap)
        for i in sorted(set(range(len(seqs))) - set(fast)):
            out[i] = self._attend_one(cache, seqs[i], q[i], k[i], v[i], scale, softcap, sinks,
                                      prompt_end.get(seqs[i], 0))
        return out

    @staticmethod
    def _reads_codes(cache: LayerCache, seq: int, q, sinks) -> bool:
        """A decode step (one query token over a stored history) that the decode kernels can take."""
        return q.shape[1] == 1 and Session._history_as_stored(cache, seq, sinks)

    @staticmethod
    def _history_as_stored(cache: LayerCache, seq: int, sinks) -> bool:
        """Whether the kernels that read the stored codes (decode kernels, ``history_attention``)
        can attend this sequence's history: not for policies that track attention mass, MLA
        latents, sliding windows or sinks."""
        return (bool(cache.length(seq)) and not cache.policy.tracks_attention_mass
                and not cache.shared_value_dim and cache.window is None and sinks is None)

    @staticmethod
    def _decode_batch(cache: LayerCache, seqs: Sequence[int], q, k, v, scale: float,
                      softcap: float | None) -> torch.Tensor:
        """One batched decode call over the stored codes of every sequence in ``seqs`` (q
        [B, Hq, 1, d], k/v [B, Hkv, 1, d]), each sequence's token observed and stored. A token
        that moves no page is written into its Terminal page first and read there with the rest
        of the exact history (one segment fewer per step); the others are attended as a
        separate new token and appended after (their append may evict, by the observed queries)."""
        seqs = list(seqs)
        pending = cache.write_in_place(seqs, k, v)
        out = attend_cache_batch(cache, seqs, q, k, v, scale, softcap, pending=pending)
        for i, seq in enumerate(seqs):
            cache.observe(seq, q[i], k.shape[1])
        for i in pending:
            cache.append(seqs[i], k[i], v[i])
        return out

    def _attend_one(self, cache: LayerCache, seq: int, q, k, v, scale: float, softcap: float | None,
                    sinks: torch.Tensor | None = None, prompt_end: int = 0) -> torch.Tensor:
        """Attend q [Hq, T, d] over [stored history ; new chunk], then store the chunk. A history
        of exact tokens only is one softmax with the chunk; a compressed one is read as stored
        (``history_attention``) where the kernels can, else decoded for the torch reference."""
        tracks_mass = cache.policy.tracks_attention_mass
        stored = decode_segments(cache, seq) if self._history_as_stored(cache, seq, sinks) else None
        segments = cache.segments(seq) if stored is None else None  # the decoded history, for the torch reference
        if stored is not None and not stored.only_exact:
            history = history_attention(q, stored, scale, softcap)
            out = merge_partials([history, partial_causal(q, k, v, scale, softcap)]).to(q.dtype)
        elif stored is not None or segments is None or (segments.only_exact and not tracks_mass):
            past = stored.exact_kv() if stored is not None else segments.exact if segments is not None else None
            keys = k if past is None else torch.cat([past[0], k], dim=1)
            values = v if past is None else torch.cat([past[1], v], dim=1)
            mask = chunk_causal_mask(keys.shape[1] - k.shape[1], q.shape[1], device=q.device, window=cache.window)
            out = grouped_attention(q[None], keys[None], values[None], mask, scale, softcap=softcap, sinks=sinks)[0]
        else:
            parts = _history_partials(q, segments, scale, softcap) + [partial_causal(q, k, v, scale, softcap)]
            if sinks is not None:  # one more logit per head with no value: output 0, lse = the sink
                parts.append((q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float32),
                              sinks.float()[:, None].expand(q.shape[0], q.shape[1])))
            out = merge_partials(parts).to(q.dtype)
            if tracks_mass:
                _accumulate_mass(cache, seq, q, parts, scale, softcap)
        cache.observe(seq, q, k.shape[0])
        cache.append(seq, k, v[..., :0] if cache.shared_value_dim else v, prompt_end=prompt_end)
        return out

    # -- accounting ------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """What the session holds now; read without ending any layer's decode batch (a serving
        loop measures it after every step)."""
        per_layer, per_kind, fp16, missed, held = {}, {}, 0, False, {}
        tokens: list[int] = []
        for name, cache in self.layers.items():
            kinds = cache.nbytes()
            per_layer[name] = sum(kinds.values())
            for kind, n in kinds.items():
                per_kind[kind] = per_kind.get(kind, 0) + n
            held[name] = tuple(cache.held_tokens(seq) for seq in self._sequence_ids(cache))
            if cache.pool is not None:
                fp16 += sum(self._fp16_nbytes(cache, seq) for seq in cache.sequence_ids())
            missed |= any(cache.over_budget(seq) for seq in cache.sequence_ids())
        if self.layers:
            first = next(iter(self.layers.values()))
            tokens = [first.length(s) for s in self._sequence_ids(first)]
        return CacheStats(sum(per_layer.values()), per_layer, per_kind, tuple(tokens), fp16, missed, held)

    def sequence_stats(self, seq: int) -> SequenceStats:
        """What sequence `seq` holds now over every layer (a server reads it before releasing a
        request), against an fp16 cache of its tokens."""
        seq = _sequence_id(seq)
        total = fp16 = tokens = 0
        held, missed = [], False
        for cache in self.layers.values():
            entry = cache.stored_state(seq)
            if entry is not None and cache.pool is not None:
                total += cache.sequence_nbytes(entry)
                fp16 += self._fp16_nbytes(cache, seq)
                tokens = cache.length(seq)
                held.append(cache.held_tokens(seq))
                missed |= cache.over_budget(seq)
        return SequenceStats(total, fp16, tokens, tuple(held), missed)

    @staticmethod
    def _fp16_nbytes(cache: LayerCache, seq: int) -> int:
        """An fp16 cache's bytes for `seq` in this layer: a windowed layer's holds only its window
        too (what HF keeps)."""
        return (cache.length(seq) - cache.first_held(seq)) * cache.fp16_token_bytes()

    def _sequence_ids(self, cache: LayerCache):
        """The sequences stats() reports: batch rows 0..B-1, or (sequences added through
        `attend_sequence` only) the ids the layer holds, ascending."""
        return range(self._batch) if self._batch is not None else sorted(cache.sequence_ids())


def _sequence_id(seq) -> int:
    """`seq` as the int that keys a sequence's store (a numpy or 0-d tensor int included): any
    other key would start a sequence no int reaches, and a release of it would free nothing."""
    if isinstance(seq, bool):
        raise TypeError(f"a sequence id is an int, got {seq!r}")
    try:
        return operator.index(seq)
    except TypeError:
        raise TypeError(f"a sequence id is an int, got {type(seq).__name__} {seq!r}") from None


def _history_partials(q, segments: Segments, scale: float, softcap: float | None) -> list:
    parts = []
    if segments.exact is not None:
        parts.append(partial_dense(q, *segments.exact, scale, softcap=softcap))
    if segments.recent is not None:
        parts.append(partial_dense(q, *segments.recent, scale, softcap=softcap))
    if segments.mid is not None:
        attend = partial_lowrank if segments.mid_projected else partial_dense
        parts.append(attend(q, *segments.mid, scale, softcap=softcap))
    parts += [partial_lowrank(q, *epoch, scale, softcap=softcap) for epoch in segments.retired]
    return parts


def _accumulate_mass(cache: LayerCache, seq: int, q, parts, scale: float, softcap: float | None) -> None:
    """Add the softmax mass this step's queries gave each not-yet-Mid token (H2O-style)."""
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)  # [Hq, T]
    for page in cache.unsettled_pages(seq):
        keys = cache.page_keys(page)
        heads = keys.shape[0]
        logits = scale * (q.float().reshape(heads, -1, keys.shape[-1]) @ keys.float().transpose(1, 2))
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        mass = torch.exp(logits - lse.reshape(heads, -1, 1)).sum(1)  # [Hkv, n]
        if page.mass is None or page.mass.shape[1] < mass.shape[1]:
            grown = mass.new_zeros(mass.shape)
            if page.mass is not None:
                grown[:, : page.mass.shape[1]] = page.mass
            page.mass = grown
        page.mass[:, : mass.shape[1]] += mass


class _PassedMask:
    """The mask and step-validity tensors (weak references and in-place versions) and the
    arguments whose checks last passed: a call that matches them would pass again."""

    def __init__(self, mask, valid, arguments: tuple):
        self.refs = tuple(None if t is None else weakref.ref(t) for t in (mask, valid))
        self.versions = tuple(None if t is None else t._version for t in (mask, valid))
        self.arguments = arguments

    @staticmethod
    def record(mask, valid, arguments: tuple) -> "_PassedMask | None":
        """None for an inference tensor: it has no version counter, so its changes cannot be seen."""
        if any(t is not None and t.is_inference() for t in (mask, valid)):
            return None
        return _PassedMask(mask, valid, arguments)

    def matches(self, mask, valid, arguments: tuple) -> bool:
        return arguments == self.arguments and all(
            (t is None and ref is None) or (t is not None and ref is not None and ref() is t and t._version == version)
            for t, ref, version in zip((mask, valid), self.refs, self.versions))


def _declared_window(layer: str, declared: declared_attention.Declared) -> int | None:
    """The sliding window the model's config declares for `layer` (`declared_attention`) when the
    graph shows no mask; a block layer or a layer that is not causal raises: with no mask in the
    graph neither can be checked, and a session would attend across blocks, or causally."""
    if declared.blocks is not None:
        raise ValueError(f"attention site {layer!r} attends within blocks of {declared.blocks} tokens (its config's "
                         "attention_chunk_size), which a kvtopo session cannot carry into the cached history")
    if declared.bidirectional:
        raise ValueError(f"attention site {layer!r} belongs to a module that is not causal (is_causal=False: "
                         "every token sees the later ones too), which a kvtopo session cannot do over a cached "
                         "history")
    return declared.window


def _check_continuation(layer: str, declared: declared_attention.Declared, stored: int, chunk: int) -> None:
    """What the model's config says a session cannot continue, given the `stored` tokens and the
    new `chunk`: a hybrid's state outside attention (any continuation); RoPE that HF rescales from a
    call's length (`declared_attention.check_rescaled`: LongRoPE's switch of factors, dynamic NTK);
    Llama-4's temperature tuning (positions counted from 0 without a cache, so exact only below
    `floor_scale`); a config window its model may not apply (`Declared.window_unknown`), past it."""
    if not stored:
        return
    if declared.state_elsewhere is not None:
        raise ValueError(f"attention site {layer!r} belongs to a hybrid model whose state outside attention "
                         f"({declared.state_elsewhere}) a kvtopo session does not carry from one call to the next; "
                         "only a single forward of the whole sequence is exact (kvtopo.generate falls back to the "
                         "model's own cache)")
    declared_attention.check_rescaled(layer, declared.rescaled, stored, chunk)
    unknown = declared.window_unknown
    if unknown is not None and stored + chunk > unknown:
        raise ValueError(f"attention site {layer!r}: its config declares sliding_window={unknown} without "
                         "layer_types, and its model's code builds no sliding-window mask kvtopo knows (HF's "
                         "create_sliding_window_causal_mask), so whether it attends only within its last "
                         f"{unknown} tokens cannot be told; a session cannot continue {stored} stored tokens "
                         f"past {unknown}. Set config.layer_types ('sliding_attention' or 'full_attention' for "
                         "each layer) to say which")
    tuned = declared.temperature_from
    if tuned is not None and stored + chunk >= tuned:
        raise ValueError(f"attention site {layer!r} scales its queries by a factor of their position from position "
                         f"{tuned - 1} on (Llama-4's attn_temperature_tuning, floor_scale), and counts positions from "
                         f"0 without a cache: a session cannot give it the {stored} stored tokens' offset, so it "
                         f"cannot continue a sequence past {tuned - 1} tokens")


def _check_shapes(layer: str, query, key, value) -> None:
    """query [B, Hq, T, d], key [B, Hkv, T, d] and value [B, Hkv, T, dv] (None: read from the
    keys) of one dtype, Hq a multiple of Hkv: checked before anything is stored, so a wrong call
    leaves the session as it was. On every call of every layer: a few comparisons, no more."""
    qs, ks = getattr(query, "shape", ()), getattr(key, "shape", ())
    if (len(qs) == 4 and len(ks) == 4 and ks[0] == qs[0] and ks[2] == qs[2] and ks[3] == qs[3] and ks[1]
            and qs[1] % ks[1] == 0 and key.dtype == query.dtype
            and (value is None or (isinstance(value, torch.Tensor) and value.dim() == 4
                                   and value.shape[:3] == ks[:3] and value.dtype == query.dtype))):
        return
    tensors = (query, key) if value is None else (query, key, value)
    described = ", ".join(f"{name} {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else
                          f"{name} a {type(x).__name__}" for name, x in zip(("query", "key", "value"), tensors))
    raise ValueError(f"attention site {layer!r}: {described} do not fit together; allowed: query [B, Hq, T, d], "
                     "key [B, Hkv, T, d], value [B, Hkv, T, dv] tensors of one dtype, Hq a multiple of Hkv")


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


def _check_chunk_mask(layer: str, attn_mask, is_causal: bool, window: int | None, valid, batch: int,
                      chunk: int) -> None:
    """The graph's mask over the new chunk must be exactly what the session applies to it: causal,
    cut to the site's sliding window, with padding keys hidden. Anything else (bidirectional
    attention, a window the passes did not read, a prefix-LM or document mask) raises here: the
    session would otherwise attend over keys the model never meant to see, or hide ones it did.
    Only rows of real (non-padding) queries are compared; a mask over more keys than the chunk
    (e.g. one that includes a history the graph holds itself) is refused too."""
    if attn_mask is None:
        if not is_causal and chunk > 1:
            raise ValueError(f"attention site {layer!r} is not causal (no mask, is_causal=False) over a chunk of "
                             f"{chunk} tokens: a kvtopo session only attends causally over the cache")
        return
    if attn_mask.shape[-1] != chunk or (attn_mask.dim() >= 2 and attn_mask.shape[-2] not in (1, chunk)):
        raise ValueError(f"attention site {layer!r} has a mask of shape {tuple(attn_mask.shape)} but the call has "
                         f"{chunk} new tokens: a session can only honour a [..., {chunk}, {chunk}] mask over the chunk")
    shown = attn_mask if attn_mask.dtype == torch.bool else attn_mask > -1e4
    if chunk == 1 and bool(shown.all()):  # a decode step's mask showing its one key: what the session applies
        return
    shown = shown.reshape((1,) * (4 - shown.dim()) + tuple(shown.shape)).expand(batch, -1, chunk, chunk)
    expected = chunk_causal_mask(0, chunk, device=shown.device, window=window)
    if is_causal:
        shown = shown & expected
    expected = expected.expand(batch, 1, chunk, chunk)
    if valid is not None:
        real = valid.to(shown.device)
        expected = expected & real[:, None, None, :]
        differs = (shown != expected) & real[:, None, :, None]
    else:
        differs = shown != expected
    if bool(differs.any()):
        b, h, t, j = (int(i) for i in differs.nonzero()[0])
        what = "hides" if bool(expected[b, 0, t, j]) else "shows"
        padding = ("" if valid is not None or what == "shows" else
                   " If this is a padded batch, the session was not told which tokens are padding: "
                   "model.generate(..., cache=SessionCache(s)) cannot tell it; use kvtopo.generate(model, ids, "
                   "attention_mask=mask) or kvtopo.hf_cache.generate(model, ids, attention_mask=mask).")
        raise ValueError(
            f"attention site {layer!r}: its mask {what} key {j} for query {t} of the chunk (batch row {b}), which "
            f"a causal{f' window-{window}' if window else ''} mask with padding does not; a kvtopo session cannot "
            "carry this mask into the cached history (non-causal, a window the passes did not recognise, or "
            f"another mask pattern). Leave this model uncompiled or report the pattern.{padding}")
