"""`kvtopo.generate`: chunked prefill + token-by-token decode through a kvtopo session.

The model (compiled with backend="kvtopo") is called without any HF cache: each forward sees only
the new tokens, with their absolute positions, and the kvtopo attention op supplies the history
from the session's store. Left padding in a batch is carried by the session's step validity mask,
so pad tokens are never stored or attended to.

Stopping follows HF `model.generate` (transformers 5): the eos ids come from the argument, else
from `model.generation_config`; a sequence is finished at the first eos it emits, every later
position of it holds the pad id (argument, else `generation_config.pad_token_id`, else the first
eos id), the pad ids are fed to the model like HF feeds them (as real tokens), and the loop ends
as soon as every sequence is finished, so the result may be shorter than `max_new_tokens`.

Every argument is checked before the first forward (and before the session is cleared): a bad
one raises naming the argument, its value and what is allowed.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm
from transformers import GenerationMixin, PretrainedConfig

from kvtopo import hf_cache
from kvtopo.backend import RefusedAttention
from kvtopo.compiled import KVTOPO, compiled_backend
from kvtopo.config import Config
from kvtopo.runtime import context, declared_attention
from kvtopo.runtime.session import Session

_PROGRESS_MIN_TOKENS = 4096


class _FromGenerationConfig:
    """Default of `eos_token_id`, `pad_token_id` and the sampling arguments: read
    `model.generation_config` (None passed explicitly is a value)."""

    def __repr__(self) -> str:
        return "<from model.generation_config>"


FROM_GENERATION_CONFIG = _FromGenerationConfig()


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    config: Config | None = None,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = FROM_GENERATION_CONFIG,
    temperature: float = FROM_GENERATION_CONFIG,
    top_k: int | None = FROM_GENERATION_CONFIG,
    top_p: float | None = FROM_GENERATION_CONFIG,
    eos_token_id: int | Sequence[int] | None = FROM_GENERATION_CONFIG,
    prefill_chunk_size: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
    return_logits: bool = False,
    pad_token_id: int | None = FROM_GENERATION_CONFIG,
):
    """Generate up to `max_new_tokens` after `input_ids` [batch, prompt] -> LongTensor [batch, prompt + new].

    Runs in the active session if there is one (so its `stats()` can be read afterwards), else in
    a fresh session built from `config` (default `Config()`). `attention_mask` marks left padding
    (bool or 0/1 integers). With `return_logits=True` also returns the logits of every step run
    [batch, new, vocab].

    `eos_token_id`: an id or a list of ids; by default `model.generation_config.eos_token_id`;
    None: no eos (as HF, where passing None overrides the generation config). Each sequence stops
    at its first eos; its later positions hold `pad_token_id` (default
    `model.generation_config.pad_token_id`, else the first eos id); `new` is the number of steps
    run: `max_new_tokens`, or fewer when every sequence has stopped.

    `do_sample`, `temperature`, `top_k`, `top_p`: by default from `model.generation_config` where
    it sets them, else HF's defaults (greedy; when sampling, temperature 1.0, top_k 50, top_p 1.0),
    so a checkpoint that asks to sample samples here as under HF. Other processing a generation
    config asks for (a repetition penalty, banned words, a minimum length...) is not applied:
    a warning names it.

    Sampling arguments are checked in every mode for values that are meaningless in any mode
    (top_k < 0, top_p outside (0, 1], temperature NaN, infinite or negative); temperature 0 is
    accepted only without sampling (HF warns and ignores sampling arguments when
    do_sample=False). `top_k=None` (or 0, as HF's generation configs write it) / `top_p=None`
    (or 1.0) passed explicitly mean no filtering.
    """
    check_input_ids(input_ids)
    _check_int("max_new_tokens", max_new_tokens, 1)
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"kvtopo.generate: config={config!r} is invalid: None or a kvtopo.Config")
    if prefill_chunk_size is not None:
        _check_int("prefill_chunk_size", prefill_chunk_size, 1, "None (the config's) or ")
    do_sample, temperature, top_k, top_p = _sampling(model, do_sample, temperature, top_k, top_p)
    _check_sampling(do_sample, temperature, top_k, top_p, generator)
    tensor_parallel = _tensor_parallel(model, do_sample)
    for name, value in (("progress", progress), ("return_logits", return_logits)):
        if not (isinstance(value, bool) or (name == "progress" and value is None)):
            raise ValueError(f"kvtopo.generate: {name}={value!r} is invalid: "
                             f"{'None or ' if name == 'progress' else ''}a bool")
    mask = validated_mask(input_ids, attention_mask)
    active = context.active_session()
    if active is not None and active.engine is not None:
        raise RuntimeError("kvtopo.generate: the active session holds the requests of a continuous-batching engine "
                           f"({type(active.engine).__name__}); generating in it would clear them. Run kvtopo.generate "
                           "in a session of its own (with kvtopo.session(config): ...)")
    if active is not None and config is not None and config != active.config:
        raise ValueError("generate(config=...) differs from the active session's config; pass one or the other")
    _check_compiled(model)
    vocab = _vocab_size(model)
    _check_ids_in_vocab(input_ids, vocab)
    eos, pad = _special_tokens(model, eos_token_id, pad_token_id, vocab)

    elsewhere = declared_attention.declare(model)  # state outside attention a session cannot carry
    session = active or Session(config)
    chunk = prefill_chunk_size if prefill_chunk_size is not None else session.config.prefill_chunk_size
    batch, prompt = input_ids.shape
    device = input_ids.device
    eos_ids = torch.tensor(eos, dtype=torch.long, device=device) if eos is not None else None
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    show = progress if progress is not None else prompt + max_new_tokens >= _PROGRESS_MIN_TOKENS
    bar = tqdm(total=prompt + max_new_tokens, disable=not show, desc="kvtopo.generate", unit="tok")
    tokens, step_logits = [], []
    with (session if active is None else nullcontext()), torch.no_grad(), bar:
        session.clear()
        calls_before = session.calls
        forward = _SessionForward(model, session)

        def on_the_models_own_cache(why: str):
            warnings.warn(f"kvtopo.generate: {why}, so nothing is compressed; generating with the model's own cache "
                          "instead", stacklevel=3)
            uncompressed = _UncompressedForward(model, why)
            return uncompressed, _prefill(uncompressed, input_ids, positions, mask, prompt, bar)

        if elsewhere is not None:
            forward, logits = on_the_models_own_cache(f"this model keeps state outside attention ({elsewhere}), "
                                                      "which a kvtopo session does not carry between calls")
        else:
            try:
                logits = _prefill(forward, input_ids, positions, mask, chunk, bar)
            except RefusedAttention as refused:
                if refused.report.sites or session.calls != calls_before:
                    raise
                forward, logits = on_the_models_own_cache(f"no attention site of this model was rewritten ({refused})")
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        last_pos = positions[:, -1]
        all_valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            step_logits.append(logits)
            token = _select(logits, do_sample, temperature, top_k, top_p, generator)
            if do_sample and tensor_parallel:  # every rank must feed the same token to the all-reduces
                torch.distributed.broadcast(token, src=0)
            if eos_ids is not None:  # as HF: finished sequences get the pad id, fed like any token
                token = torch.where(unfinished, token, torch.full_like(token, pad))
                unfinished &= ~torch.isin(token, eos_ids)
            tokens.append(token)
            bar.update(1)
            if step == max_new_tokens - 1 or not bool(unfinished.any()):
                break
            last_pos = last_pos + 1
            logits = forward(token[:, None], last_pos[:, None], all_valid)
        out = torch.cat([input_ids.long(), torch.stack(tokens, dim=1).long()], dim=1)  # int64 as HF's, whatever came in
        if isinstance(forward, _SessionForward):  # what the stores hold, for an HF generate continuing them
            hf_cache.record_fed(next(iter(session.model_layers(model)), None), session, out)
    return (out, torch.stack(step_logits, dim=1)) if return_logits else out


# -- argument checks (all before any forward) ---------------------------------------------------
def _bad(name: str, value, allowed: str, error=ValueError):
    return error(f"kvtopo.generate: {name}={value!r} is invalid: {allowed}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value, lo: int, prefix: str = "") -> None:
    if not (_is_int(value) and value >= lo):
        raise _bad(name, value, f"{prefix}an int >= {lo}")


def _describe(t: torch.Tensor) -> str:
    return f"a {t.dtype} tensor of shape {tuple(t.shape)}"


def check_input_ids(input_ids, caller: str = "kvtopo.generate") -> None:
    """A [batch, tokens] integer tensor with at least one token per sequence; `caller` names the entry point."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{caller}: input_ids is a {type(input_ids).__name__}; "
                        "allowed: a [batch, tokens] integer tensor")
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"{caller}: input_ids is {_describe(input_ids)}; "
                         "allowed: a [batch, tokens] torch.long or torch.int tensor")
    batch, prompt = input_ids.shape
    if batch == 0:
        raise ValueError(f"{caller}: input_ids has batch 0 (shape {tuple(input_ids.shape)}); "
                         "allowed: at least one sequence")
    if prompt == 0:
        raise ValueError(f"{caller}: input_ids is an empty prompt (shape {tuple(input_ids.shape)}); "
                         "allowed: at least one token per sequence")


# HF generate's own defaults for what neither the caller nor the generation config sets.
_HF_SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
# Generation-config settings HF applies that kvtopo.generate does not, with the value meaning "off".
_NOT_APPLIED = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": None,
                "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None, "min_p": None,
                "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "exponential_decay_length_penalty": None,
                "num_beams": 1, "penalty_alpha": None}


def _sampling(model, do_sample, temperature, top_k, top_p) -> tuple:
    """The sampling arguments as HF generate resolves them: the caller's, else the model's
    generation config's, else HF's defaults. Warns about generation-config processing not applied."""
    generation_config = getattr(model, "generation_config", None)
    resolved = []
    for name, value in (("do_sample", do_sample), ("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if value is FROM_GENERATION_CONFIG:
            value = getattr(generation_config, name, None)
            value = _HF_SAMPLING_DEFAULTS[name] if value is None else value
        resolved.append(value)
    ignored = [f"{name}={getattr(generation_config, name)!r}" for name, off in _NOT_APPLIED.items()
               if getattr(generation_config, name, off) not in (off, None)]
    if ignored:
        warnings.warn(f"kvtopo.generate: model.generation_config sets {', '.join(ignored)}, which HF generate "
                      "applies and kvtopo.generate does not", stacklevel=3)
    return tuple(resolved)


def _tensor_parallel(model, do_sample: bool) -> bool:
    """Whether `model` is sharded by transformers' tensor parallelism. Its ranks compute the same
    logits but draw samples from their own random state: a sampled token is taken from rank 0 (the
    sharding must span every process, else rank 0 would hand its tokens to another model copy)."""
    size = getattr(model, "tp_size", None) or 1
    if size > 1 and do_sample and size != torch.distributed.get_world_size():
        raise NotImplementedError(f"kvtopo.generate: sampling under tensor parallelism over {size} of "
                                  f"{torch.distributed.get_world_size()} processes is not supported (the sampled "
                                  "token is broadcast from rank 0 of the whole world)")
    return size > 1


def _check_sampling(do_sample, temperature, top_k, top_p, generator) -> None:
    if not isinstance(do_sample, bool):
        raise _bad("do_sample", do_sample, "a bool")
    if not (_is_real(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise _bad("temperature", temperature, "a finite number > 0 (0 only with do_sample=False)")
    if do_sample and temperature == 0:
        raise _bad("temperature", temperature, "a finite number > 0 when do_sample=True "
                   "(for greedy decoding use do_sample=False)")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise _bad("top_k", top_k, "None or 0 (no top-k filtering, as in HF) or an int >= 1")
    if top_p is not None and not (_is_real(top_p) and 0 < top_p <= 1):
        raise _bad("top_p", top_p, "None (no nucleus filtering) or a number in (0, 1]")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise _bad("generator", generator, "None or a torch.Generator", TypeError)


def validated_mask(input_ids: torch.Tensor, attention_mask, caller: str = "kvtopo.generate") -> torch.Tensor:
    """`attention_mask` as bool: input_ids' shape, 0/1 values, left padding only, a real last token."""
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{caller}: attention_mask is a {type(attention_mask).__name__}; "
                        "allowed: None or a tensor shaped like input_ids")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"{caller}: attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}; allowed: the same [batch, tokens] shape")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(f"{caller}: attention_mask is {_describe(attention_mask)}; "
                         "allowed: a bool or integer (0/1) tensor")
    if attention_mask.dtype != torch.bool and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        bad = attention_mask[(attention_mask != 0) & (attention_mask != 1)][0].item()
        raise ValueError(f"{caller}: attention_mask holds the value {bad}; allowed: 0 (padding) and 1 (token)")
    mask = attention_mask.bool()
    # The session stores each row's tokens in order and marks only a leading stretch of padding.
    if bool((mask.long().cummax(1).values.bool() != mask).any()):
        raise ValueError(f"{caller}: attention_mask must be left-padded (no padding after a real token)")
    if not bool(mask[:, -1].all()):
        raise ValueError(f"{caller}: every sequence needs at least one real token (attention_mask row of zeros)")
    return mask


def _check_compiled(model) -> None:
    """Before the prefill: `model` (or a submodule of it) must be compiled with backend='kvtopo'."""
    backend = compiled_backend(model)
    if backend == KVTOPO:
        return
    others = {}
    if isinstance(model, torch.nn.Module):
        for name, module in model.named_modules():
            inner = compiled_backend(module) if module is not model else None
            if inner == KVTOPO:
                return
            if inner is not None:
                others.setdefault(name, inner)
    how = "it is not compiled" if backend is None else f"it is compiled with backend={backend!r}"
    if backend is None and others:
        name, inner = next(iter(others.items()))
        how += f"; its submodule {name!r} is compiled with backend={inner!r}"
    raise RuntimeError(f"kvtopo.generate: model {type(model).__name__} is not compiled with backend='kvtopo' "
                       f"({how}); allowed: kvtopo.compile(model) or torch.compile(model, backend='kvtopo')")


def _vocab_size(model) -> int | None:
    """The input embedding's row count, else `config.vocab_size`, else None (unknown)."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            embeddings = get()
        except (NotImplementedError, AttributeError):
            embeddings = None
        rows = getattr(embeddings, "num_embeddings", None)
        if _is_int(rows):
            return rows
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if _is_int(size) else None


def _ids_allowed(vocab: int | None) -> str:
    return f"ids in [0, {vocab}) (the model's vocabulary)" if vocab is not None else "ids >= 0"


def _check_ids_in_vocab(input_ids: torch.Tensor, vocab: int | None) -> None:
    """Every id, padding included (padding is embedded too, then masked), must be an embedding row."""
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        where = (input_ids == bad).nonzero()[0].tolist()
        raise ValueError(f"kvtopo.generate: input_ids holds {bad} at [{where[0]}, {where[1]}]; "
                         f"allowed: {_ids_allowed(vocab)}")


def _special_tokens(model, eos_token_id, pad_token_id, vocab: int | None) -> tuple[list[int] | None, int | None]:
    """(eos ids or None, pad id) as HF generate resolves them; validated against the vocabulary."""
    generation_config = getattr(model, "generation_config", None)
    ids = {}
    for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        source = ""
        if value is FROM_GENERATION_CONFIG:
            value, source = getattr(generation_config, name, None), " (from model.generation_config)"
        ids[name] = _token_list(name, value, vocab, single=name == "pad_token_id", source=source)
    eos, pad = ids["eos_token_id"], ids["pad_token_id"]
    if eos is None:
        return None, None  # no stopping, nothing is padded (HF too: padding needs an eos criterion)
    return eos, (pad[0] if pad is not None else eos[0])


def _token_list(name: str, value, vocab: int | None, single: bool, source: str) -> list[int] | None:
    if value is None:
        return None
    allowed = ("None or an int" if single else "None, an int or a non-empty list of ints") + f": {_ids_allowed(vocab)}"
    ids = value
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool \
                or ids.dim() > (0 if single else 1):
            raise ValueError(f"kvtopo.generate: {name}{source} is {_describe(ids)}; allowed: {allowed}")
        ids = ids.tolist()
    if _is_int(ids):
        ids = [ids]
    elif single or not isinstance(ids, (list, tuple)):
        ids = None
    if not ids or not all(_is_int(i) and i >= 0 and (vocab is None or i < vocab) for i in ids):
        raise ValueError(f"kvtopo.generate: {name}={value!r}{source} is invalid: {allowed}")
    return list(ids)


# -- the loop's pieces --------------------------------------------------------------------------
def _prefill(forward, input_ids, positions, mask, chunk: int, bar) -> torch.Tensor:
    prompt_end = mask.sum(1).tolist()  # each row's real tokens: every chunk is budgeted, and its pages wait, for it
    for start in range(0, input_ids.shape[1], chunk):
        end = min(start + chunk, input_ids.shape[1])
        logits = forward(input_ids[:, start:end], positions[:, start:end], mask[:, start:end], prompt_end)
        bar.update(end - start)
    return logits


def _last_logits(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1].float()


class _SessionForward:
    """One forward of the new tokens only; the kvtopo ops supply the history from the session.
    A chunk with padding also passes it as the attention mask, so the graph's own mask over the
    chunk says what the session applies (the session checks that it does)."""

    def __init__(self, model, session: Session):
        self.model, self.session = model, session

    def __call__(self, ids, positions, valid, prompt_end=None) -> torch.Tensor:
        padding = {} if bool(valid.all()) else {"attention_mask": valid.long()}
        calls = self.session.calls
        with self.session.step(valid, prompt_end), self.session.model_forward():
            logits = _last_logits(self.model(input_ids=ids, position_ids=positions, use_cache=False, **padding))
        if self.session.calls == calls:  # the model saw these tokens alone, without their history
            raise RuntimeError(
                f"kvtopo.generate: a forward of {ids.shape[1]} token(s) ran no kvtopo attention. Compile the model "
                "with backend='kvtopo' (kvtopo.compile(model)) before kvtopo.generate; a compiled model also runs "
                "eagerly when torch._dynamo gives up on it (e.g. torch._dynamo.config.recompile_limit reached, "
                "the limit shared by the frames of every model compiled in this process)")
        return logits


class _UncompressedForward:
    """The model's own generation, outside the session, for a model none of whose attention was
    rewritten or that keeps state outside attention: an HF model keeps the cache it makes itself
    (the one its layer types need: attention, Mamba, convolutions), handed back under the name its
    forward takes, its inputs prepared by its own `prepare_inputs_for_generation` as HF's generate
    prepares them; another module recomputes the whole sequence, and an HF model whose forward takes
    no cache too, unless HF's generate feeds it other inputs than the sequence (XLNet): refused."""

    def __init__(self, model, why: str):
        self.model = model
        self.why = why  # why the session could not be used: named again if this fails too
        self.cache = None
        self.cache_argument = None
        if isinstance(getattr(model, "config", None), PretrainedConfig):
            accepted = inspect.signature(model.forward).parameters
            self.cache_argument = next((name for name in ("cache", "past_key_values") if name in accepted), None)
            if self.cache_argument is None and not _fed_as_it_is(model):
                raise ValueError(
                    f"kvtopo.generate: fell back to the model's own generation because {why}, but "
                    f"{type(model).__name__}'s forward takes no cache and HF's generate feeds it other inputs than "
                    "the sequence (its prepare_inputs_for_generation; XLNet's predicts through a dummy token, a "
                    "permutation mask and its mems), which a recompute of the whole sequence does not give; use "
                    "model.generate")
        self.ids = self.positions = self.valid = None

    def __call__(self, ids, positions, valid, prompt_end=None) -> torch.Tensor:  # its own cache keeps every token
        grow = lambda held, new: new if held is None else torch.cat([held, new], 1)  # noqa: E731
        self.ids, self.positions, self.valid = grow(self.ids, ids), grow(self.positions, positions), grow(self.valid, valid)
        with context.suspended():
            if self.cache_argument is not None:  # the inputs HF's generate gives the model (Mamba's: no mask after the prompt)
                held = {} if self.cache is None else {self.cache_argument: self.cache}
                inputs = self.model.prepare_inputs_for_generation(
                    self.ids, next_sequence_length=ids.shape[1], attention_mask=self.valid.long(), use_cache=True,
                    is_first_iteration=self.cache is None, position_ids=self.positions, **held)
                out = self.model(**inputs)
                self.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                if self.cache is None:
                    raise RuntimeError(
                        f"kvtopo.generate: fell back to the model's own cache because {self.why}, but "
                        f"{type(self.model).__name__} returned no cache to generate with (a model that is not a "
                        "causal decoder, e.g. one built with is_decoder=False, does not generate token by token)")
            else:
                padding = {} if bool(self.valid.all()) else {"attention_mask": self.valid.long()}
                out = self.model(input_ids=self.ids, position_ids=self.positions, use_cache=False, **padding)
        return _last_logits(out)


def _fed_as_it_is(model) -> bool:
    """Whether HF's generate feeds `model`, an HF model whose forward takes no cache, the sequence
    as it is: GenerationMixin's `prepare_inputs_for_generation` does, and so does a model's own that
    adds nothing (openai-gpt's); XLNet's appends a dummy token and masks it."""
    own = getattr(type(model), "prepare_inputs_for_generation", None)
    if own is None or own is GenerationMixin.prepare_inputs_for_generation:
        return True
    ids = torch.ones((1, 2), dtype=torch.long)  # any sequence shows whether it is changed
    prepared = model.prepare_inputs_for_generation(ids, use_cache=False)
    added = [name for name, value in prepared.items() if name not in ("input_ids", "use_cache") and value is not None]
    return isinstance(prepared.get("input_ids"), torch.Tensor) and torch.equal(prepared["input_ids"], ids) and not added


def _select(logits, do_sample, temperature, top_k, top_p, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:  # None or 0: no top-k filtering (HF's generation configs write 0 for it)
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # As HF's TopPLogitsWarper computes it (ascending: the tail whose mass stays within
        # 1 - top_p goes, the top token always stays), so a seed draws what HF draws.
        sorted_logits, order = logits.sort(dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
