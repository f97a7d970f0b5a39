"""kvtopo's own policy: exp-free eviction, directional pruning and low-bit codes in Mid; low-bit Recent.

Which Mid tokens survive is decided by `kernels.scoring.expfree_scores` (matmul, max, subtract,
relu, sums: no exponential), so the same scoring graph runs on NPU matrix units; surviving
keys/values are stored in `mid_bits` bits, projected first onto each head's retained principal
directions where the config asks for it (`key_energy`/`value_energy`, opt-in).

A token the observation window attends to passes its score on to its `SUCCESSORS` following
tokens (a running max, still exp-free): retrieval reads forward from where attention lands —
an induction head that found a key at token t copies t+1, then t+2, ... in the decode steps
that follow, and those tokens get little attention from the question itself. On the reference
model at 1K tokens and 8x, whole prompt in one chunk: passkey/multikey accuracy 0/0.25 without
it, 0.75/0.75 with it (4 examples each, 8 successors then). The tokens the queries single out
most (anchors: a needle's key) pass theirs on further, `ANCHOR_REACH` tokens, so a long needle
is kept to its end.
"""

import torch
import torch.nn.functional as F

from kvtopo.kernels.scoring import expfree_scores, successor_shares

# Tokens after an attended token that inherit its score (not a Config field: a property of how
# decoding reads retrieved spans). On SmolLM2 (bench/real_quality.py, 2K-token number needles,
# validation seeds 1000-1019, float32) 8 lost the last digits of a 7-digit needle ("478296" for
# "4782961"): 16 took topo from 0.70 to 0.95 at a nominal 4x and 0.55 to 0.75 at 8x, at the
# same achieved bytes (3.49x / 3.84x).
SUCCESSORS = 16

# Weight of the low-norm prior against the window's credit (both as shares of the head's total).
# SmolLM2, 2K-token number needles, float32, nominal 4x (3.47x achieved), query-agnostic (the
# window is the document's end): validation seeds 1000-1019 0.50 -> 0.60, benchmark seeds 0.75;
# query-aware unchanged at 1.00 (bench/results/real_quality_agnostic_f32/).
KEY_NORM_WEIGHT = 1.0

# A token whose queries' credit (window and chunk) is at least ANCHOR_STRENGTH times the head's
# mean is an anchor: it passes its credit on to the next ANCHOR_REACH tokens instead of
# SUCCESSORS (`anchor_reach`). The 16-token carry stopped inside a 35-token uuid. SmolLM2,
# 2K-token uuid needles, float32, nominal 4x (3.50x achieved), query-aware, validation seeds
# 1000-1019: 0.10 with the carry alone, 0.30 with a bridge between two anchors up to 48 tokens
# apart (the rule this replaces), 0.55 with anchors reaching 40 (every token reaching 40: 0.50;
# anchors at 16x the mean: 0.30; anchors from the window's credit alone: 0.45). The price, number
# needles query-agnostic on the same seeds: 0.70 -> 0.60. Mean KL on six prose texts (seeds
# 2000-2005): 2K at nominal 4x 0.0168 (carry alone) / 0.0149 (bridge) / 0.0150; 4K at nominal 8x
# 0.0198 / 0.0232 / 0.0247. Since the successor shares, `topo_scores` scales the reach to the whole
# score's units (docs/measurements.md, "Anchors in the whole score's units").
ANCHOR_STRENGTH = 8.0
ANCHOR_REACH = 40

# Weight of the successor shares (`successor_credit`) beside the low-norm prior, both as shares of
# the head's total: chosen among 1, 3 and 10 on SmolLM2's 2K needles (validation seeds 1000-1019);
# the benchmark runs and fidelity are in docs/measurements.md, "Successor shares".
SUCCESSOR_WEIGHT = 3.0


def carry_forward(score: torch.Tensor, successors: int = SUCCESSORS) -> torch.Tensor:
    """score[h, t] -> max(score[h, t - successors .. t]): each token's score reaches the next
    `successors` tokens. [H, n] -> [H, n]."""
    if successors < 1 or score.shape[-1] == 0:
        return score
    padded = F.pad(score[:, None], (successors, 0), value=float("-inf"))
    return F.max_pool1d(padded, successors + 1, stride=1)[:, 0]


def anchor_reach(credit: torch.Tensor, strength: float = ANCHOR_STRENGTH, reach: int = ANCHOR_REACH) -> torch.Tensor:
    """[H, n] -> [H, n]: the credit of anchors -- tokens with at least `strength` times the
    head's mean credit -- carried to the next `reach` tokens; other tokens pass on nothing. A
    needle the question singles out is read forward from its key for as long as the needle
    is, longer than the SUCCESSORS any attended token covers."""
    anchors = torch.where(credit >= strength * credit.mean(-1, keepdim=True), credit, torch.zeros_like(credit))
    return carry_forward(anchors, reach)


def shares(score: torch.Tensor) -> torch.Tensor:
    """Each head's scores as fractions of that head's total over the tokens ranked together."""
    return score / score.sum(-1, keepdim=True).clamp_min(torch.finfo(score.dtype).tiny)


def low_norm_prior(keys: torch.Tensor) -> torch.Tensor:
    """[Hkv, n, d] -> [Hkv, n] in [0, 1]: 1 for the head's smallest squared key norm, 0 for its
    largest. A query that has not been asked yet attends most to low-norm keys (the KNorm
    observation), so this is the part of a token's worth that the window's queries cannot see."""
    norms = keys.float().square().sum(-1)
    top = norms.amax(-1, keepdim=True)
    return (top - norms) / (top - norms.amin(-1, keepdim=True)).clamp_min(torch.finfo(norms.dtype).tiny)


def predecessor_shares(queries: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, scale,
                       margin: float, competitors: int | None = None) -> torch.Tensor:
    """[Hkv, n]: `successor_shares` of the tokens whose predecessor's query the chunk holds
    (`queries[:, rows[t]]`), among those tokens (or as if among `competitors`); NaN where
    `rows[t]` < 0 (the predecessor was stored with an earlier chunk, its query gone)."""
    held = (rows >= 0).nonzero()[:, 0]
    out = keys.new_full(keys.shape[:2], float("nan"), dtype=torch.float32)
    out[:, held] = successor_shares(queries, rows[held], keys[:, held], scale, margin, competitors)
    return out


def successor_credit(queries: torch.Tensor | None, rows: torch.Tensor | None, keys: torch.Tensor, scale,
                     margin: float, held: torch.Tensor | None = None) -> torch.Tensor:
    """[Hkv, n]: `predecessor_shares` where the chunk holds the predecessor's query, else what an
    earlier chunk of the prompt gave the token (`held`, NaN where nothing); the tokens with
    neither get the others' mean, so that a joint ranking across chunks neither favours nor
    penalises them."""
    credit = keys.new_full(keys.shape[:2], float("nan"), dtype=torch.float32)
    if queries is not None:
        credit = predecessor_shares(queries, rows, keys, scale, margin)
    if held is not None:
        credit = torch.where(credit.isnan(), held, credit)
    known = ~credit[0].isnan()
    return torch.where(known, credit, credit[:, known].mean(-1, keepdim=True))


def topo_scores(queries: torch.Tensor, keys: torch.Tensor, scale, margin: float, num_queries=None,
                chunk_queries: torch.Tensor | None = None, predecessor_queries: torch.Tensor | None = None,
                predecessor_rows: torch.Tensor | None = None, held_credit: torch.Tensor | None = None) -> torch.Tensor:
    """The topo policy's token scores [Hkv, n]: the window's exp-free credit, a prefill chunk's
    own queries' credit (`chunk_queries`, when given), the low-norm prior and the successor shares
    (`successor_credit`, when a prefill chunk's queries and the rows of the tokens' predecessors
    are given, or an earlier chunk's, `held_credit`), each as the head's shares, carried
    forward; the queries' strongest tokens carry theirs further (`anchor_reach`), scaled to the
    whole score.
    Each part as shares, so the window (a question's few queries) keeps its say however many
    document queries the chunk adds. The store calls it on live tensors;
    export/compressor.py traces it into the exported page compressor (with `num_queries` masking
    the fixed window's padding; it ranks one page at a time, without a chunk's queries)."""
    credit = shares(expfree_scores(queries, keys, scale, margin, num_queries))
    if chunk_queries is not None:
        credit = credit + shares(expfree_scores(chunk_queries, keys, scale, margin))
    prior = KEY_NORM_WEIGHT * shares(low_norm_prior(keys))
    live = predecessor_queries is not None and bool((predecessor_rows >= 0).any())
    if live or (held_credit is not None and not bool(held_credit.isnan().all())):
        prior = prior + SUCCESSOR_WEIGHT * shares(successor_credit(
            predecessor_queries if live else None, predecessor_rows, keys, scale, margin, held_credit))
    score = credit + prior
    # Anchors carried in the whole score's units (its total over the credit's): the prior's parts
    # add to every token, and compared in the credit's units alone a needle's reach lost to them.
    in_score_units = score.sum(-1, keepdim=True) / credit.sum(-1, keepdim=True).clamp_min(torch.finfo(score.dtype).tiny)
    return torch.maximum(carry_forward(score), anchor_reach(credit) * in_score_units)


from .base import MidEncoding, Policy, ScoreInputs


class Topo(Policy):
    name = "topo"
    meets_budgets = True
    projects = True

    def recent_bits(self):
        return self.config.recent_bits

    def mid_encoding(self) -> MidEncoding:
        c = self.config
        project = c.key_energy is not None
        return MidEncoding(evict=self.has_budget(), project=project, key_bits=c.mid_bits, value_bits=c.mid_bits,
                           refit=project and c.refit_after is not None)

    def across_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """Each kv-head's share of its own credit over the tokens ranked together. A head whose
        queries spread over many tokens gives many of them large sums; a retrieval head gives a
        few tokens most of its credit. Compared raw, the spread heads set every page's count and
        a needle that one head reads loses its tail (SmolLM2, bench/real_quality.py, 2K-token
        number needles in bfloat16, validation seeds 1000-1019: 0.90 -> 1.00 at 4.01x, 0.75 ->
        1.00 at 4.38x, the same bytes)."""
        return shares(scores.flatten(1)).view_as(scores)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        if inputs.queries is None:
            return inputs.keys.new_zeros(inputs.keys.shape[:2])
        return topo_scores(inputs.queries, inputs.keys, inputs.scale, self.config.score_margin,
                           chunk_queries=inputs.chunk_queries, predecessor_queries=inputs.predecessor_queries,
                           predecessor_rows=inputs.predecessor_rows, held_credit=inputs.held_credit)

    def held_credit(self, inputs: ScoreInputs) -> torch.Tensor | None:
        """The successor shares, which need each token's predecessor's query: a waiting page's
        chunk is gone when the prompt's end ranks it. Shared as if among the tokens that ranking
        will see (`ScoreInputs.ranked_with`), not only the chunk's: among fewer, a filler token's
        share is larger and a singled-out token stands out less."""
        if inputs.predecessor_queries is None:
            return None
        return predecessor_shares(inputs.predecessor_queries, inputs.predecessor_rows, inputs.keys, inputs.scale,
                                  self.config.score_margin, inputs.ranked_with)
