"""What a compression policy decides: how Recent and Mid pages are encoded, and which Mid tokens
survive eviction. The store (runtime/layer_cache.py) applies it; one small class per method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from kvtopo.config import Config


@dataclass(frozen=True)
class MidEncoding:
    """How a page is stored once it reaches the Mid phase.

    evict: tokens may be dropped by score to meet the budget.
    project: keys/values are stored as coefficients on the head's principal directions.
    key_bits / value_bits: low-bit codes (2/4/8) of what is stored; None keeps floats
    (the cache dtype, or float16 for projected coefficients).
    max_tokens: a cap on each Mid page's survivors independent of any budget (StreamingLLM: 0).
    refit: projected bases are refitted as the sequence grows (Config.refit_after), each fit
    starting a new Mid epoch.
    """

    evict: bool = False
    project: bool = False
    key_bits: int | None = None
    value_bits: int | None = None
    max_tokens: int | None = None  # survivors per Mid page at most, whatever the budget (0: drop)
    refit: bool = False

    @property
    def identity(self) -> bool:
        """Mid pages stored exactly as they were: they can stay in the exact page pool."""
        return not (self.evict or self.project or self.key_bits or self.value_bits)


@dataclass(frozen=True)
class ScoreInputs:
    """What a policy may look at when ranking one page's tokens for eviction.

    keys/values: the page's tokens [Hkv, n, d]; queries: the latest observation-window queries
    [Hq, W, d] of this sequence and layer; scale: the attention's softmax scale;
    attention_mass: accumulated softmax mass each token received while it was Terminal/Recent
    [Hkv, n] (only tracked for policies that ask for it); chunk_queries: the appending prefill
    chunk's own last queries [Hq, C, d], every one after every ranked token (None outside a
    prefill chunk's joint plan); predecessor_queries: the appending chunk's queries [Hq, T, d]
    and predecessor_rows [n] (long): the row of the query of the token before each ranked token,
    -1 where the chunk does not hold it (both None outside a prefill chunk's joint plan);
    held_credit [Hkv, n]: what `Policy.held_credit` gave each token while an earlier chunk of its
    prompt was appended, NaN where nothing (None when no token has any); ranked_with: for
    `Policy.held_credit`, how many tokens the ranking at the prompt's end will see; softcap: the
    layer's logit cap (Gemma-2), which softmax mass must apply as attention does.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None
    scale: float
    attention_mass: torch.Tensor | None = None
    chunk_queries: torch.Tensor | None = None
    predecessor_queries: torch.Tensor | None = None
    predecessor_rows: torch.Tensor | None = None
    held_credit: torch.Tensor | None = None
    ranked_with: int | None = None
    softcap: float | None = None


class Policy:
    """Base: keep everything, encode nothing. Subclasses override what they change."""

    name: ClassVar[str]
    tracks_attention_mass: ClassVar[bool] = False
    meets_budgets: ClassVar[bool] = False  # evicts by score to meet a byte budget (else a budget is only reported)
    projects: ClassVar[bool] = False  # reads key_energy / value_energy (principal directions)
    reads_queries: ClassVar[bool] = True  # its scores read the observation window (else none is held)

    def __init__(self, config: "Config"):
        self.config = config

    def recent_bits(self) -> int | None:
        return None

    def mid_encoding(self) -> MidEncoding:
        return MidEncoding()

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """Importance [Hkv, n] of a page's tokens; the highest are kept. Only called when evicting."""
        raise NotImplementedError(f"policy {self.name!r} does not evict")

    def held_credit(self, inputs: ScoreInputs) -> torch.Tensor | None:
        """[Hkv, n] credit of the tokens `inputs` holds that only the appending chunk's queries
        can give (NaN for tokens it gives none), for tokens ranked after the chunk is gone: a
        chunked prompt's pages wait for its end (`Lifecycle.holds`) and are ranked then, and it
        comes back to `score` as `ScoreInputs.held_credit`. Default: none."""
        return None

    @property
    def keeps_held_credit(self) -> bool:
        """Whether this policy gives a waiting chunk's tokens credit to keep (`held_credit`
        overridden): bytes a byte budget must leave room for while a prompt's pages wait."""
        return type(self).held_credit is not Policy.held_credit

    def across_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores [Hkv, ...] of the tokens ranked together, made comparable between kv-heads:
        the joint eviction plan sets a page's kept count by the heads' best score at each rank.
        Per-head order must not change. Default: as they are."""
        return scores

    def has_budget(self) -> bool:
        """Whether the config sets a byte budget, i.e. whether eviction has anything to meet."""
        return self.config.target_ratio is not None or self.config.layer_budget_bytes is not None


class ExactEviction(Policy):
    """Evict Mid tokens by `score` to meet the budget; keep survivors and Recent pages exact."""

    meets_budgets = True

    def mid_encoding(self) -> MidEncoding:
        return MidEncoding(evict=self.has_budget())
