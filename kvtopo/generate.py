"""`kvtopo.generate`: chunked prefill + token-by-token decode through a kvtopo session.

The model (compiled with backend="kvtopo") is called without any HF cache: each forward sees only
the new tokens, with their absolute positions, and the kvtopo attention op supplies the history
from the session's store. Left padding in a batch is carried by the session's step validity mask,
so pad tokens are never stored or attended to.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from kvtopo.config import Config
from kvtopo.runtime import context
from kvtopo.runtime.session import Session

_PROGRESS_MIN_TOKENS = 4096


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    config: Config | None = None,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    prefill_chunk_size: int | None = None,
    generator: torch.Generator | None = None,
    progress: bool | None = None,
    return_logits: bool = False,
):
    """Generate `max_new_tokens` after `input_ids` [batch, prompt] -> LongTensor [batch, prompt + new].

    Runs in the active session if there is one (so its `stats()` can be read afterwards), else in
    a fresh session built from `config` (default `Config()`). `attention_mask` marks left padding.
    With `return_logits=True` also returns the logits of every generated step [batch, new, vocab].
    """
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int):
        raise ValueError(f"input_ids must be a [batch, tokens] integer tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    mask = _validated_mask(input_ids, attention_mask)
    active = context.active_session()
    if active is not None and config is not None and config != active.config:
        raise ValueError("generate(config=...) differs from the active session's config; pass one or the other")
    session = active or Session(config)
    chunk = prefill_chunk_size or session.config.prefill_chunk_size
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"prefill_chunk_size={chunk!r} must be an int >= 1")

    batch, prompt = input_ids.shape
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    show = progress if progress is not None else prompt + max_new_tokens >= _PROGRESS_MIN_TOKENS
    bar = tqdm(total=prompt + max_new_tokens, disable=not show, desc="kvtopo.generate", unit="tok")
    tokens, step_logits = [], []
    with (session if active is None else nullcontext()), torch.no_grad(), bar:
        session.clear()
        calls_before = session.calls
        for start in range(0, prompt, chunk):
            end = min(start + chunk, prompt)
            logits = _forward(model, session, input_ids[:, start:end], positions[:, start:end], mask[:, start:end])
            bar.update(end - start)
        if session.calls == calls_before:
            raise RuntimeError("no kvtopo attention ran during prefill: compile the model with "
                               "backend='kvtopo' (kvtopo.compile(model)) before kvtopo.generate")
        finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        last_pos = positions[:, -1]
        all_valid = torch.ones(batch, 1, dtype=torch.bool, device=input_ids.device)
        for step in range(max_new_tokens):
            step_logits.append(logits)
            token = _select(logits, do_sample, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                token = torch.where(finished, torch.full_like(token, eos_token_id), token)
                finished |= token == eos_token_id
            tokens.append(token)
            bar.update(1)
            if step == max_new_tokens - 1 or bool(finished.all()):
                break
            last_pos = last_pos + 1
            logits = _forward(model, session, token[:, None], last_pos[:, None], all_valid)
    out = torch.cat([input_ids, torch.stack(tokens, dim=1).to(input_ids.dtype)], dim=1)
    return (out, torch.stack(step_logits, dim=1)) if return_logits else out


def _validated_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    mask = attention_mask.bool()
    if bool((mask.long().cummax(1).values.bool() != mask).any()):
        raise ValueError("attention_mask must be left-padded (no padding after a real token)")
    if not bool(mask[:, -1].all()):
        raise ValueError("every sequence needs at least one real token (attention_mask row of zeros)")
    return mask


def _forward(model, session: Session, ids, positions, valid) -> torch.Tensor:
    with session.step(valid):
        out = model(input_ids=ids, position_ids=positions, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -1].float()


def _select(logits, do_sample, temperature, top_k, top_p, generator) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 when sampling")
    logits = logits / temperature
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)
