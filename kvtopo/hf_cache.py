"""HF `model.generate(...)` on a kvtopo-compiled model, through a tensor-free `transformers` Cache.

    import kvtopo, kvtopo.hf_cache

    model = kvtopo.compile(model)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        out = model.generate(ids, max_new_tokens=32, cache=kvtopo.hf_cache.SessionCache(s, model=model))
        print(s.stats().tokens)           # (prompt + new - 1,): the tokens each sequence stores

(`past_key_values=SessionCache(s)` works too; transformers 5.x renamed that argument `cache`.)

`SessionCache` keeps no tensors. Its `update` hands each layer's new k/v straight back, so the
graph's attention sees only the step's new tokens; the rewritten `kvtopo::attention` op then
takes the layer's history from the active session and appends the new k/v to it. Accordingly:

* `get_seq_length()` is the session's stored length for `model` (what HF generate reads,
  outside the compiled graph, to slice the prompt and to continue from an existing history;
  `model=` says whose, when a session holds several models' stores);
* `get_query_offset()` / `get_mask_sizes(q)` describe attention over the new chunk only:
  query offset 0, kv length q, kv offset 0. These are constants, so the compiled graph never
  depends on how many tokens are stored and Dynamo compiles once for the prefill shape and once
  for decode (T=1), not once per step (a later prompt of another length adds one dynamic-shape
  compile). The graph's own mask is therefore causal over the chunk; inside the session the op
  ignores it anyway and applies the session's causal/padding mask over [history ; chunk].

Left-padded batches need the session to know which tokens are padding (`Session.step`), which
`model.generate` does not tell a Cache. Use `kvtopo.hf_cache.generate(model, ids,
attention_mask=mask, max_new_tokens=...)` inside the session for those: it calls
`model.generate` with a `SessionCache` and marks each forward's real tokens for the session.
Without padding it is the same as passing `cache=SessionCache(s)` yourself.

Calling the model yourself works as well (`model(input_ids=chunk, position_ids=pos, cache=c)`
inside the session); without `position_ids` the model asks `get_seq_length()` from inside the
compiled forward, which then runs eagerly and splits the graph there (still a bounded number of
compiles, since Dynamo makes the returned length a dynamic int).

Calling the same `model.generate` again with the full token history (e.g. the previous output
plus a new turn) continues the session: HF slices off the stored prefix via `get_seq_length()`.

Not supported: beam search, assisted/speculative decoding, and anything else that must reorder,
crop or repeat stored history; the Cache methods they use raise NotImplementedError. A forward
that runs eagerly instead of through the kvtopo-compiled graph (model not compiled with
backend="kvtopo", or Dynamo fell back to eager) raises rather than attending over the new
tokens alone.
"""

from __future__ import annotations

import functools
import types
import weakref
from contextlib import ExitStack

import torch
from transformers.cache_utils import Cache

from kvtopo.runtime import context, declared_attention
from kvtopo.runtime.session import Session

__all__ = ["SessionCache", "generate"]


class SessionCache(Cache):
    """A `transformers` Cache whose history lives in a kvtopo session (it stores nothing itself)."""

    def __init__(self, session: Session, model: torch.nn.Module | None = None):
        """`model`: whose stored length to report, needed when the session holds several models'
        stores (`generate` passes it)."""
        if not isinstance(session, Session):
            raise TypeError(f"SessionCache(session) takes a kvtopo Session, got {type(session).__name__}")
        if model is not None and (state := declared_attention.state_outside_attention(model)) is not None:
            raise ValueError(
                f"SessionCache: {type(getattr(model, '_orig_mod', model)).__name__} keeps state outside attention "
                f"({state}) in HF's cache, which a SessionCache does not hold (HF's layers would look it up and "
                "fail); kvtopo.generate runs such a model on its own cache")
        super().__init__(layers=[])
        self.session = session
        self.model = getattr(model, "_orig_mod", model)
        self.checking_prompts = False  # inside `_continuing`: the generate running is checked once

    def __repr__(self) -> str:
        return f"SessionCache(session={self.session!r})"

    # -- what the compiled forward calls (traced by Dynamo) ------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Return the new k/v unchanged: the kvtopo op adds the stored history inside the session."""
        if not torch.compiler.is_compiling():
            raise RuntimeError(
                "SessionCache.update ran eagerly: the model must run through a graph compiled with "
                "backend='kvtopo' (kvtopo.compile(model)); its attention op supplies the history. HF generate "
                "calls the module itself, so compile it in place (kvtopo.compile(model) or model.compile("
                "backend='kvtopo')): the wrapper torch.compile(model, ...) returns is not what generate calls. "
                "(Dynamo may also have fallen back to eager, e.g. after hitting its recompile limit.)"
            )
        return key_states, value_states

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """The queries' offset within the keys attention sees (only the new chunk): always 0."""
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(kv_length, kv_offset) of what attention sees: the new chunk only."""
        return query_length, 0

    # -- what HF generate calls eagerly ----------------------------------------------------------
    # Run eagerly even when a compiled forward asks (no position_ids given): Dynamo then breaks the
    # graph here and treats the returned length as a dynamic int instead of recompiling per step.
    @torch.compiler.disable(reason="kvtopo SessionCache reads the session's stored length eagerly")
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The columns of the batch the session holds, padding included (`Session.model_length`):
        HF counts columns to know which input ids are new; when every row has padding, the longest
        row's tokens alone would fall short, and HF would feed a stored token again."""
        first = self.first_layer()
        return first.columns if first is not None else 0

    def first_layer(self):
        """The store of this cache's model's first layer the session holds (None before any)."""
        return next(iter(self._active_session("get_seq_length").model_layers(self.model)), None)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self) -> None:
        """Forget every stored sequence of the session."""
        self.session.clear()

    @property
    def is_compileable(self) -> bool:
        # False: HF generate must neither build static 4D masks for it nor auto-compile the forward.
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    # One full-attention pseudo layer, so HF's mask and prefill logic treat it as an attention cache.
    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_dummy(self) -> list[bool]:
        return [False]

    @property
    def is_initialized(self) -> bool:
        return True

    # -- what would need copying or dropping history: unsupported -------------------------------
    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"kvtopo SessionCache does not support {what}: the session's history cannot be reordered, "
            "cropped or repeated (beam search and assisted decoding are not supported); use greedy or "
            "sampled decoding"
        )

    def reorder_cache(self, beam_idx):
        self._unsupported("reorder_cache")

    def crop(self, tokens_to_remove: int):
        self._unsupported("crop")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")

    def early_initialization(self, *args, **kwargs):
        pass

    # -- helpers ---------------------------------------------------------------------------------
    def _active_session(self, what: str) -> Session:
        active = context.active_session()
        if active is not self.session:
            state = ("is not active" if not self.session.active else
                     "is not active in this thread (a session is active where it was entered)" if active is None else
                     "is not the innermost active session")
            raise RuntimeError(
                f"SessionCache.{what}: its kvtopo session {state}; call model.generate(..., "
                "cache=SessionCache(s)) inside `with kvtopo.session(config) as s:`"
            )
        return self.session


def generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             **generate_kwargs):
    """`model.generate(input_ids, attention_mask=..., **generate_kwargs)` in the active kvtopo session.

    Passes a `SessionCache` of the active session and, when `attention_mask` has (left) padding,
    marks each forward's real tokens for the session so padding is neither stored nor attended.
    """
    from kvtopo.generate import check_input_ids, validated_mask  # it imports this module

    session = context.require_active_session("kvtopo.hf_cache.generate")
    declared_attention.declare(model)
    for name in ("cache", "past_key_values"):
        if generate_kwargs.get(name) is not None:
            raise ValueError(f"kvtopo.hf_cache.generate passes its own cache; do not pass {name}=")
    check_input_ids(input_ids, "kvtopo.hf_cache.generate")
    mask = validated_mask(input_ids, attention_mask, "kvtopo.hf_cache.generate")
    padding = (~mask).sum(1).tolist()
    cache = SessionCache(session, model=model)
    _check_continuation(cache.first_layer(), padding)
    return _continuing(cache, input_ids,
                       lambda: _generate(model, session, cache, input_ids, attention_mask, padding, generate_kwargs))


def check_prompts(model: torch.nn.Module) -> None:
    """Make `model.generate(..., cache=SessionCache(s))` check, as `generate` does, that its prompt
    starts with the token ids the session holds for the model (kvtopo.compile calls it): HF would cut
    any prompt at the stored length and continue the stored text."""
    if callable(getattr(type(model), "generate", None)) and "generate" not in vars(model):
        model.generate = types.MethodType(_generate_checking_prompts, model)


def _generate_checking_prompts(model: torch.nn.Module, *args, **kwargs):
    """The model class's `generate`, with `_continuing` around it when given a SessionCache."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    input_ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    run = functools.partial(type(model).generate, model, *args, **kwargs)
    if not isinstance(cache, SessionCache) or not isinstance(input_ids, torch.Tensor) or cache.checking_prompts:
        return run()
    return _continuing(cache, input_ids, run)


# The token ids a model's stores hold, keyed by the model's first layer store: (ids, the session's
# `changes` count when they were recorded). Any later attend, release or clear makes it stale.
_FED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_fed(first_layer, session: Session, sequences: torch.Tensor) -> None:
    """Note that the stores whose first layer is `first_layer` now hold the first columns of
    `sequences` (a generate's output); `kvtopo.generate` and the checked HF generate call it."""
    if first_layer is not None and sequences.shape[1] >= first_layer.columns:
        _FED[first_layer] = sequences[:, :first_layer.columns].clone(), session.changes


def _continuing(cache: SessionCache, input_ids: torch.Tensor, run):
    """`run()` (an HF generate through `cache` from `input_ids`), refused when the prompt does not
    start with the ids the session holds; records the ids it leaves stored."""
    _check_prompt_continues(cache, input_ids)
    cache.checking_prompts = True
    try:
        output = run()
    finally:
        cache.checking_prompts = False
    record_fed(cache.first_layer(), cache.session, getattr(output, "sequences", output))  # a GenerateOutput's or a tensor
    return output


def _check_prompt_continues(cache: SessionCache, input_ids: torch.Tensor) -> None:
    """HF generate takes the first `get_seq_length()` columns of a prompt as stored: a prompt that
    does not start with what the session holds would be cut there and attend over another text.
    Checked when the stores hold exactly what the last generate (HF's checked one, or
    kvtopo.generate) left: nothing else fed, released or cleared them since."""
    first_layer = cache.first_layer()
    fed, changes = _FED.get(first_layer, (None, None)) if first_layer is not None else (None, None)
    columns = cache.get_seq_length()
    if fed is None or changes != cache.session.changes or fed.shape != (input_ids.shape[0], columns):
        return
    if input_ids.shape[1] <= columns:
        problem = f"the prompt has {input_ids.shape[1]} columns, nothing beyond them to generate from"
    elif not torch.equal(input_ids[:, :columns], fed.to(input_ids.device)):
        problem = "the prompt does not start with them (HF generate would cut it there and continue the stored text)"
    else:
        return
    raise ValueError(f"kvtopo: the session holds {columns} columns of token ids for this model and "
                     f"{problem}; pass the whole history plus the new turn, or start a new session (or session.clear())")


def _generate(model, session, cache: SessionCache, input_ids, attention_mask, padding: list[int], generate_kwargs):
    if not any(padding):
        return model.generate(input_ids, attention_mask=attention_mask, cache=cache, **generate_kwargs)

    original = model.prepare_inputs_for_generation
    steps = ExitStack()

    def prepare_inputs(*args, **kwargs):
        inputs = original(*args, **kwargs)
        step_mask = kwargs.get("attention_mask")
        if step_mask is None:
            raise RuntimeError("HF generate dropped the attention mask of a padded batch")
        new = inputs.get("input_ids")
        chunk = (new if new is not None else inputs["inputs_embeds"]).shape[1]
        steps.close()  # the previous forward's step ends here
        steps.enter_context(session.step(step_mask[:, -chunk:].bool()))
        # The graph's mask covers the new chunk only (SessionCache.get_mask_sizes), so its padding
        # must come from the chunk's columns, not from the start of the whole history's mask.
        inputs["attention_mask"] = step_mask[:, -chunk:]
        return inputs

    model.prepare_inputs_for_generation = prepare_inputs
    try:
        return model.generate(input_ids, attention_mask=attention_mask, cache=cache, **generate_kwargs)
    finally:
        del model.prepare_inputs_for_generation
        steps.close()


def _check_continuation(stored, padding: list[int]) -> None:
    """HF feeds every row from one column, `get_seq_length()`: a continued batch's rows must have
    their stored tokens end at the same column, or a row's first new tokens would be skipped."""
    if stored is None or not stored.longest():
        return
    ends = [stored.length(row) + pad for row, pad in enumerate(padding)]
    if len(set(ends)) > 1:
        row = ends.index(min(ends))
        raise ValueError(
            f"kvtopo.hf_cache.generate: row {row} holds {stored.length(row)} tokens and is padded by {padding[row]} "
            f"columns, so its new tokens start at column {ends[row]}, but another row's start at {max(ends)}; HF "
            "generate feeds every row from one column. Continue a batch with new turns of one length per row "
            "(pad each turn, not the whole row), or one conversation per session.")
