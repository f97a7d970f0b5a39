"""kvtopo's one configuration object: validated at construction, immutable afterwards."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

OVER_BUDGET = ("evict", "raise")
EVICTION_SCOPES = ("append", "page")
BITS = (2, 4, 8)
PALU_ENERGY = 0.9  # the energy palu keeps when none is given


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"Config.{field}={value!r} is invalid: {allowed}")


# Exact types: a bool is not an int and a float is not a bit width or a token count, even when it
# compares equal to one (4.0 == 4). Real numbers must be finite: inf and NaN are no ratio, margin
# or energy.
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value, lo: int) -> bool:
    return _is_int(value) and value >= lo


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fraction(value) -> bool:
    return _real(value) and 0.0 < value <= 1.0


def _choice(value, choices) -> bool:
    return isinstance(value, str) and value in choices


def _as_python_number(value):
    """A numpy (or other registered) integer or real as Python's own int or float: checked like
    one, and written to JSON and handed to the kernels like one. bool stays bool (refused)."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, tuple):
        return tuple(_as_python_number(v) for v in value)
    return value


def _spans_ok(spans) -> bool:
    return isinstance(spans, tuple) and all(
        isinstance(s, tuple) and len(s) == 2 and _int(s[0], 0) and _int(s[1], 0) and s[0] < s[1] for s in spans)


@dataclass(frozen=True)
class Config:
    """How a kvtopo session stores the KV cache. Defaults: the `topo` policy at 8x vs fp16.

    Lifecycle (runtime/phases.py): pages of `page_size` tokens; the pages holding the first
    `sink_tokens` tokens and any page overlapping `protected_spans` ((start, end) token ranges,
    e.g. a system prompt) stay exact; the `recent_tokens` behind the page being written are
    stored in `recent_bits` (None = exact) and never evicted; older pages are Mid.
    Recent is where eviction waits: a page's survivors are chosen once, when it leaves Recent.
    256 tokens by default: with a 64-token window the last queries of a prompt judged the
    tokens 64-256 behind its end, evicted them, and a continuation that needed them drifted
    (SmolLM2 at 2K, `bench/fidelity_configs.py`: mean KL to the full cache 0.076 with 64 tokens,
    0.003 with 256 at 8x; 4-bit Recent codes: 0.006 at fewer bytes).
    Mid (topo): tokens are stored in `mid_bits` bits (None = floats), keys per channel and
    values per token; `key_energy` / `value_energy` (default None: no projection; topo and palu
    only; `key_energy` alone projects an MLA latent, whose values are its keys, and a layer with
    values of its own refuses it) instead keep only the principal directions holding that
    fraction of each kv-head's keys'/values' energy. Projection pays on low-rank heads (MLA latents); on a pretrained model's nearly
    full-rank heads dropping even 10% of a value's energy destroys copied tokens
    (bench/needle_configs.py), so it is opt-in. Tokens are evicted by the exp-free score of the latest
    `observation_window` queries (`score_margin` logits) when needed to meet the budget (a
    kv-head shared by more than 8 query heads, e.g. MLA's latent, keeps proportionally fewer
    query positions, at least one).
    With projection, RoPE turns keys as positions grow, so bases fitted on the first prefill
    chunk hold less of later keys' energy: past `refit_after` tokens, topo refits them each
    time the sequence doubles (a new Mid epoch; older epochs keep their bases). None: fit once.
    Budget: `target_ratio` (bytes vs an fp16 cache of the same tokens) and/or
    `layer_budget_bytes` (per sequence and layer); when even evicting a whole page cannot meet
    it, `over_budget` says whether to keep going ("evict": evict what can be, report the miss
    in stats) or raise ("raise": for the policies that evict by score; kivi, palu and
    streaming drop no token to meet a budget, so they only report a miss).
    `eviction_scope`: "append" ranks the tokens of all the pages one append (a prefill chunk)
    moves into Mid together and shares the append's room among them by score, so the pages
    the latest queries need keep more tokens (with the whole prompt in one chunk this is
    SnapKV's global selection, made when the question has been seen); "page" gives each page
    its tokens' share of the room and ranks its tokens alone (what exported graphs do).
    `policy="palu"` projects without codes; its energies default to 0.9 when neither is set.
    `max_pages`: per-layer limit of the exact page pool (None: grow). A full pool raises.
    `prefill_chunk_size`: prompt tokens per forward in `kvtopo.generate` (every chunk budgeted at
    the prompt's end). `prompt_hold_tokens`: while more of a chunked prompt comes, the pages that
    leave Recent wait there in Recent codes, up to this many tokens, and enter Mid together when
    the prompt ends (or the wait would grow past it), ranked as one chunk ranks them; 0 moves
    each as its chunk pushes it out of Recent, ranked by the chunk just after it (README, Known
    limitations). Waiting costs memory while the prompt is read, not after; it is off under a
    `layer_budget_bytes` cap, for policies that do not evict and where Recent is exact. 8,192: on
    SmolLM2 at 8K in 512-token chunks, 4,096 left a mean KL of 0.034 where one chunk has 0.0055
    (8,192: 0.0052; docs/measurements.md, "Prompts in 512-token chunks").
    """

    policy: str = "topo"
    page_size: int = 32
    sink_tokens: int = 32
    recent_tokens: int = 256
    protected_spans: tuple[tuple[int, int], ...] = ()
    recent_bits: int | None = 8
    mid_bits: int | None = 4
    key_energy: float | None = None
    value_energy: float | None = None
    observation_window: int = 32
    score_margin: float = 4.0
    refit_after: int | None = 2048
    target_ratio: float | None = 8.0
    layer_budget_bytes: int | None = None
    over_budget: str = "evict"
    eviction_scope: str = "append"
    max_pages: int | None = None
    prefill_chunk_size: int = 512
    prompt_hold_tokens: int = 8192

    def __post_init__(self):
        from kvtopo.runtime.policies import POLICIES

        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _as_python_number(getattr(self, field.name)))
        _require(_choice(self.policy, POLICIES), "policy", self.policy, f"one of {tuple(POLICIES)}")
        _require(_int(self.page_size, 1) and self.page_size <= 4096, "page_size", self.page_size, "an int in [1, 4096]")
        _require(_int(self.sink_tokens, 0), "sink_tokens", self.sink_tokens, "an int >= 0")
        _require(_int(self.recent_tokens, 0), "recent_tokens", self.recent_tokens, "an int >= 0")
        _require(_spans_ok(self.protected_spans), "protected_spans", self.protected_spans,
                 "a tuple of (start, end) int pairs with 0 <= start < end")
        for name in ("recent_bits", "mid_bits"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value in BITS), name, value, f"None or an int in {BITS}")
        for name in ("key_energy", "value_energy"):
            value = getattr(self, name)
            _require(value is None or _fraction(value), name, value, "None or a float in (0, 1]")
        _require(_int(self.observation_window, 1), "observation_window", self.observation_window, "an int >= 1")
        _require(_real(self.score_margin) and self.score_margin > 0,
                 "score_margin", self.score_margin, "a finite number > 0")
        _require(self.refit_after is None or _int(self.refit_after, 1), "refit_after", self.refit_after,
                 "None or an int >= 1 (tokens)")
        _require(self.target_ratio is None or (_real(self.target_ratio) and self.target_ratio >= 1),
                 "target_ratio", self.target_ratio, "None or a finite number >= 1 (times smaller than fp16)")
        _require(self.layer_budget_bytes is None or _int(self.layer_budget_bytes, 1),
                 "layer_budget_bytes", self.layer_budget_bytes, "None or an int >= 1")
        _require(_choice(self.over_budget, OVER_BUDGET), "over_budget", self.over_budget, f"one of {OVER_BUDGET}")
        _require(_choice(self.eviction_scope, EVICTION_SCOPES), "eviction_scope", self.eviction_scope,
                 f"one of {EVICTION_SCOPES}")
        _require(self.max_pages is None or _int(self.max_pages, 1), "max_pages", self.max_pages, "None or an int >= 1")
        _require(_int(self.prefill_chunk_size, 1), "prefill_chunk_size", self.prefill_chunk_size, "an int >= 1")
        _require(_int(self.prompt_hold_tokens, 0), "prompt_hold_tokens", self.prompt_hold_tokens,
                 "an int >= 0 (tokens)")
        if self.policy == "full":
            for name in ("target_ratio", "layer_budget_bytes"):
                _require(getattr(self, name) is None, name, getattr(self, name),
                         "None with policy 'full' (it keeps every token exactly; use Config.lossless())")
        if self.policy == "palu" and self.key_energy is None and self.value_energy is None:
            # Projection is palu's whole method: unset energies mean its usual 0.9, not "none".
            object.__setattr__(self, "key_energy", PALU_ENERGY)
            object.__setattr__(self, "value_energy", PALU_ENERGY)
            # Not a field (asdict, equality and exported layouts leave it out): `replace` with
            # another policy drops implied energies (carried to topo, they switched its projection
            # on without a word).
            object.__setattr__(self, "_implied_energies", True)
        method = POLICIES[self.policy]
        if self.value_energy is not None and self.key_energy is None:
            raise ValueError(f"Config: value_energy={self.value_energy!r} without key_energy: values are projected only "
                             "together with keys (key_energy alone projects the keys of an MLA latent, its values)")
        if self.policy == "palu" and self.value_energy is None:
            raise ValueError(f"Config: policy 'palu' projects keys and values alike: set both key_energy and "
                             f"value_energy or neither, got key_energy={self.key_energy!r}, value_energy=None")
        if self.key_energy is not None and not method.projects:
            raise ValueError(f"Config: policy {self.policy!r} does not project onto principal directions; "
                             "key_energy / value_energy would be ignored (policies that do: topo, palu)")
        if self.over_budget == "raise" and not method.meets_budgets:
            raise ValueError(f"Config: over_budget='raise' with policy {self.policy!r}, which drops no token by score "
                             "to meet a byte budget: a budget it misses is only reported (stats().budget_missed); "
                             "use over_budget='evict' or an evicting policy (topo, snapkv, h2o, knorm)")

    @classmethod
    def lossless(cls, **overrides) -> "Config":
        """Every token kept exactly: results equal the uncompressed model's. `overrides` set the
        layout (page sizes, windows, chunking), never the policy."""
        if "policy" in overrides:
            raise ValueError(f"Config.lossless: policy={overrides['policy']!r} is invalid: a lossless config's "
                             "policy is 'full'; use Config(policy=...) for another")
        return cls(**{"policy": "full", "target_ratio": None, **overrides})

    def replace(self, **changes) -> "Config":
        if getattr(self, "_implied_energies", False):  # as if built anew: palu sets them again itself
            changes = {"key_energy": None, "value_energy": None, **changes}
        return dataclasses.replace(self, **changes)
