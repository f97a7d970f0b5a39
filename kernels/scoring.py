"""Token importance for eviction: an exponential-free score and the exact softmax reference.

Eviction keeps, per kv-head, the tokens the recent queries attend to most. The exact measure
(SnapKV/H2O-like) is the softmax attention mass a token receives from an observation window
of queries. ``expfree_scores`` approximates it with matrix-unit operations only (matmul, max,
subtract, relu, sums, multiplication/addition by constants), so it runs on NPU matrix units
without the exp/softmax vector path:

    s = scale * q @ k.T            per query row, over the N candidate tokens
    m = max_n s                    the row's largest logit
    score = sum relu(s - m + margin)   over the window's queries and the group's query heads

``relu(s - m + margin) / margin`` is a linear ramp standing in for ``exp(s - m)``: 1 at the
row's best token, falling to 0 at ``margin`` logits below it; tokens further down get no
credit. Subtracting
the row max is what makes rows comparable: it is softmax's own shift, without the exp.

Why ``margin = 4``: measured as recall of the softmax-mass top tokens (``topk_recall``) on
the synthetic heads of ``tests/kernels/test_scoring.py::synthetic_heads`` (1024 tokens, d=64,
32 window queries, GQA 2, 6 kv-heads x 3 seeds; keys = offset + decaying low-rank structure
+ noise, 1/32 heavy hitters on 6 retrieval directions, a sink; query heads scaled to mean
(max - median) logit spreads of 12, 8 and 4). Recall at budgets 10% / 25% / 50%:

    margin 2: 0.72/0.73/0.76   3: 0.78/0.80/0.84   4: 0.80/0.84/0.87   5: 0.78/0.84/0.87
    margin 6: 0.76/0.81/0.86   8: 0.70/0.77/0.83   no clipping (sum of logits): 0.37/0.44/0.57
    random scores: 0.09/0.24/0.50

At margin 4 the kept tokens held 97.6% / 98.3% / 98.9% of the softmax mass that the exact
top-k would keep: the misses are mostly near-ties among low-mass tokens.

Per spread the best margin was 3-4 (spread 4), 4-5 (spread 8), 4-6 (spread 12), 5-6 (all
heads at 16); 4 stayed within 0.05 of the best everywhere (worst: spread 16 at the 50%
budget, 0.85 vs 0.90 at margin 6; all heads at spread 6 gave 0.81/0.84/0.87).
Smaller margins give zero credit to most tokens (ties that large budgets then break
arbitrarily); larger ones drift toward the plain logit sum. These figures hold for this
synthetic structure only; real-model agreement has to be measured on captured q/k.

What is given up: softmax divides each row by its sum, so a peaked query and a diffuse one
contribute equal mass; this score has no division, and a diffuse row (many tokens within the
margin) contributes more. Dividing each row by its relu sum (not an allowed op here) raised
recall to 0.91/0.92/0.93 on the same data, at the cost of one reciprocal per query row.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_MARGIN = 4.0


def _grouped_logits(q_obs: Tensor, k: Tensor, scale: float) -> Tensor:
    """Scaled logits [Hkv, G*W, N]: query head h (of Hq = Hkv*G) against kv-head h // G."""
    hq, w, d = q_obs.shape
    kv_heads = k.shape[0]
    if hq % kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {kv_heads} kv-heads")
    return (q_obs.float().reshape(kv_heads, hq // kv_heads * w, d) * scale) @ k.float().transpose(1, 2)


def expfree_scores(q_obs: Tensor, k: Tensor, scale, margin: float = DEFAULT_MARGIN, num_queries=None) -> Tensor:
    """Exponential-free importance [Hkv, N] of keys k [Hkv, N, d] for queries q_obs [Hq, W, d].

    Higher is more important. ``margin`` is in logit units (after ``scale``). ``num_queries``
    (an int or a 0-dim tensor, for graphs with a fixed window): only the first that many of the
    W positions are queries, the rest padding that gets no say.
    """
    logits = _grouped_logits(q_obs, k, scale)
    if logits.shape[-1] == 0:
        return logits.sum(1)
    row_max = logits.amax(-1, keepdim=True)
    # relu(logits - row_max + margin), in place on the logits (a temporary): the same ops in the
    # same order, without allocating two more [Hkv, G*W, N] tensors (a prefill chunk's queries
    # make them large).
    credit = logits.sub_(row_max).add_(margin).relu_()
    if num_queries is not None:
        hq, w = q_obs.shape[:2]
        rows = (torch.arange(w, device=k.device) < num_queries).repeat(hq // k.shape[0])
        credit = credit * rows[None, :, None].float()
    return credit.sum(1)


# Logits a block of `successor_shares` holds at once (float32: 2 MB, about a core's L2, so the
# passes over them after the product stay in cache; its prefill cost: docs/measurements.md, "Successor shares").
SHARE_BLOCK_LOGITS = 1 << 19


def successor_shares(queries: Tensor, rows: Tensor, k: Tensor, scale, margin: float = DEFAULT_MARGIN,
                     competitors: int | None = None) -> Tensor:
    """[Hkv, N]: the share of its predecessor's exp-free credit that each token gets, summed over
    the kv-head's query heads. ``queries[:, rows[n]]`` ([Hq, d]) is the query of the token before
    key n of k [Hkv, N, d]; its credit ``relu(s - max + margin)`` is taken over all N keys, later
    ones included, and divided by its sum (one reciprocal per row).

    A model reading its context back fetches each token with the query of the token before it
    (KVzip scores tokens by such a reconstruction, run as a second pass). A token that query
    singles out -- a number or name nothing else in the text predicts -- gets a share near 1;
    one it shares with many look-alikes (filler, repeated phrases) a small share. Rows are
    gathered and taken in blocks of at most ``SHARE_BLOCK_LOGITS`` logits (an MLA layer's 128
    query heads never copy a whole chunk's queries).

    ``competitors``: when the share is to be among more tokens than the N given (a chunk of a
    prompt whose tokens are ranked together later, its other tokens' keys not yet stored), the
    credit of the N - 1 others is taken as a sample of that many: the own token's credit over
    ``own + others * (competitors - 1) / (N - 1)``."""
    kv_heads, n = k.shape[:2]
    widen = (competitors - 1) / (n - 1) if competitors is not None and competitors > n > 1 else 1.0
    group = queries.shape[0] // kv_heads
    out = k.new_zeros(kv_heads, n, dtype=torch.float32)
    step = max(1, SHARE_BLOCK_LOGITS // max(1, group * n))
    k = k.float()
    for start in range(0, n, step):
        block = queries[:, rows[start:start + step]]
        b = block.shape[1]
        logits = _grouped_logits(block, k, scale).view(kv_heads, group, b, n)
        floor = logits.amax(-1).sub_(margin)  # [Hkv, G, b]
        own = logits[:, :, torch.arange(b), torch.arange(start, start + b)].sub_(floor).relu_()  # a copy
        total = logits.sub_(floor[..., None]).relu_().sum(-1)  # in place: the logits are a temporary
        if widen != 1.0:
            total = own + (total - own) * widen
        out[:, start:start + b] = (own / total).sum(1)
    return out


def softmax_mass(q_obs: Tensor, k: Tensor, scale: float, softcap: float | None = None) -> Tensor:
    """Exact attention mass [Hkv, N]: softmax over the N keys per query row (logits capped as
    the layer's attention caps them), summed over the window's queries and the group's query
    heads, as ``expfree_scores`` sums its surrogate."""
    logits = _grouped_logits(q_obs, k, scale)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.softmax(logits, dim=-1).sum(1)


def topk_recall(score: Tensor, reference: Tensor, budget: int) -> float:
    """Fraction of the reference's top-``budget`` tokens that ``score``'s top-``budget`` also
    keeps, per head ([H, N] inputs), averaged over heads. Ties are broken arbitrarily."""
    if score.shape != reference.shape or score.dim() != 2:
        raise ValueError(f"score and reference must both be [H, N], got {tuple(score.shape)} and {tuple(reference.shape)}")
    if not 1 <= budget <= score.shape[1]:
        raise ValueError(f"budget must be in [1, {score.shape[1]}], got {budget!r}")
    kept = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    kept.scatter_(1, score.topk(budget, dim=1).indices, True)
    hits = kept.gather(1, reference.topk(budget, dim=1).indices)
    return hits.float().mean().item()
