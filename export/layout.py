"""The exported cache layout: fixed capacities per phase, derived from a Config and a context limit.

Batch 1. Per layer (names `<tensor>_<layer index>` in the ONNX graph; see export/attention.py):
  exact     Initial pages (+ Recent pages when Recent is stored exactly) and the Terminal page,
            in page order: E = P * (most exact pages the PhasePlan ever holds up to max_context)
  recent    int8 (recent_bits) codes of the Recent pages: C = P * recent pages; key statistics
            per page and channel, value statistics per token (as `runtime.codecs.encode_recent`)
  mid       kept tokens of every Mid page, appended in page order: M = max_context rows;
            per-page, per-direction statistics for Mp = ceil(max_context / P) pages; mid_row_page
            maps a row to its page slot
  bases     key/value principal directions padded with zero columns to R = rank_capacity
            (head_dim rounded up to a multiple of 8 // mid_bits), and their means
  An unprojected Mid (`mid_projected` False: the topo policy without key_energy/value_energy, or
  `kivi`) stores the kept tokens' own channels as KIVI-style codes, as `runtime.codecs.MidSegment`
  does: keys [Hkv, M, dk/(8/mb)] with statistics per Mid page and channel [Hkv, Mp, dk], values
  [Hkv, M, dv/(8/mb)] with statistics per row [Hkv, M]; there are no bases.
  lengths   [layers, 3] int64: valid tokens in (exact, recent, mid) of each layer
Rows past a length and padded columns are ignored by the graph (they may hold anything finite).
`mid_valid_only` (the ONNX export's default profile): the decode step's Mid tensors have dynamic
rows and pages axes (`decode_step.mid_axes`) and the host feeds only the rows and pages held, so
the step's Mid work follows the Mid length instead of max_context; the capacities above bound them.

Profiles (`profile`): None, the default, is float32 throughout with a dynamic token count in the
ONNX decode step. "npu" is a fully static export for NPU compilers: batch 1, `tokens` (1) new
tokens per decode-step call (prefill feeds the prompt one token per call), the capacities above
(page size, page counts, max_context) fixed, and float16 cache and activation tensors at both
graphs' boundaries (`boundary_dtype`); uint8 codes, int64 ids/lengths and 0-d scalars stay as
they are. Compute inside stays float32: the graphs upcast their float16 inputs once and round
their outputs to float16 (NPUs store float16 and accumulate in float32 or better; their
compilers may also lower the inner compute to float16 on their own).

MLA models (`shared_value_dim` = latent rank r) cache one kv-head per layer whose key is
[latent ; RoPE key] (head_dim = r + rope) and whose value is the latent (value_head_dim = r),
stored once inside the key as the PyTorch session does: there are no value tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from kvtopo.config import Config
from kvtopo.runtime.phases import Phase, PhasePlan
from kvtopo.runtime.policies import make_policy

SUPPORTED_POLICIES = ("topo", "full", "kivi")
PROFILES = (None, "npu")
NPU_TOKENS = 1  # tokens per decode-step call under the "npu" profile


def check_profile(function: str, profile) -> None:
    if profile not in PROFILES:
        raise ValueError(f"{function}: profile={profile!r} is invalid: one of {PROFILES}")


def plan_of(config: Config) -> PhasePlan:
    return PhasePlan(config.page_size, config.sink_tokens, config.recent_tokens, config.protected_spans)


def check_exportable(config: Config) -> None:
    """The exported graphs implement the `topo` policy's encodings, projected or not (and `full`,
    which has none, and `kivi`, which is topo's unprojected codes without eviction)."""
    if config.policy not in SUPPORTED_POLICIES:
        raise NotImplementedError(f"export supports policies {SUPPORTED_POLICIES}, not {config.policy!r}")
    enc = make_policy(config).mid_encoding()
    if not enc.identity and not (enc.key_bits and enc.value_bits):
        raise NotImplementedError(
            f"export needs Mid pages quantized (mid_bits set; projected or not) or left exact; got {enc}")
    if enc.key_bits != enc.value_bits:
        raise NotImplementedError("export needs the same bit width for Mid keys and values")


@dataclass
class CacheLayout:
    num_layers: int
    layer_names: list[str]
    scales: list[float]
    heads: int
    kv_heads: int
    head_dim: int
    value_head_dim: int
    vocab_size: int
    page_size: int
    max_context: int
    exact_capacity: int
    recent_pages: int
    mid_capacity: int
    mid_page_capacity: int
    rank_capacity: int
    recent_bits: int | None
    mid_bits: int | None
    observation_window: int
    score_margin: float
    config: dict = field(default_factory=dict)
    shared_value_dim: int | None = None  # MLA: values are the keys' first that many dims
    profile: str | None = None  # None (float32, dynamic token count) or "npu" (static, float16 boundary)
    mid_projected: bool = True  # False: Mid holds KIVI-style codes of the tokens' channels, no bases
    tokens: int | None = None  # tokens per decode-step call when the graph fixes it (the "npu" profile)
    mid_valid_only: bool = False  # the decode step takes the Mid tensors cut to the rows and pages held

    @property
    def boundary_dtype(self) -> str:
        """numpy dtype name of the graphs' float inputs and outputs (cache, activations, logits)."""
        return "float16" if self.profile == "npu" else "float32"

    @property
    def stored_value_dim(self) -> int:
        """Value dims stored per token and kv-head (0 when the values live in the keys)."""
        return 0 if self.shared_value_dim else self.value_head_dim

    @property
    def recent_capacity(self) -> int:
        return max(1, self.recent_pages) * self.page_size

    @property
    def recent_code_bits(self) -> int:
        return self.recent_bits or 8

    @property
    def mid_code_bits(self) -> int:
        return self.mid_bits or 4

    @classmethod
    def build(cls, config: Config, max_context: int, *, layer_names, scales, heads, kv_heads, head_dim,
              value_head_dim, vocab_size, shared_value_dim: int | None = None) -> "CacheLayout":
        check_exportable(config)
        if shared_value_dim is not None and not (shared_value_dim == value_head_dim <= head_dim):
            raise ValueError(f"shared_value_dim={shared_value_dim} must equal value_head_dim={value_head_dim} "
                             f"and fit in head_dim={head_dim}")
        policy = make_policy(config)
        recent_bits = policy.recent_bits()
        enc = policy.mid_encoding()
        plan = plan_of(config)
        P = config.page_size
        pages = math.ceil(max_context / P)
        exact_phases = {Phase.INITIAL, Phase.TERMINAL} | ({Phase.RECENT} if recent_bits is None else set()) \
            | ({Phase.MID} if enc.identity else set())
        # The exact pages never get fewer as pages are added: the new page is exact (Terminal) and at most
        # one page leaves the exact phases (the old Terminal page into Recent, or a Recent page into Mid),
        # so the most the plan ever holds is what it holds at max_context.
        counts = plan.counts(pages)
        most_exact = sum(counts[phase] for phase in exact_phases)
        mid_bits = enc.key_bits if not enc.identity else None
        mid_projected = enc.identity or enc.project
        per_byte = 8 // (mid_bits or 4)
        return cls(
            num_layers=len(layer_names), layer_names=list(layer_names), scales=[float(s) for s in scales],
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, value_head_dim=value_head_dim, vocab_size=vocab_size,
            page_size=P, max_context=max_context, exact_capacity=most_exact * P,
            recent_pages=plan.recent_pages if recent_bits is not None else 0,
            mid_capacity=max_context, mid_page_capacity=pages,
            rank_capacity=-(-max(head_dim, value_head_dim) // per_byte) * per_byte,
            recent_bits=recent_bits, mid_bits=mid_bits, observation_window=config.observation_window,
            score_margin=float(config.score_margin), config=_config_dict(config), shared_value_dim=shared_value_dim,
            mid_projected=mid_projected,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CacheLayout":
        return cls(**json.loads(text))

    def config_object(self) -> Config:
        d = dict(self.config)
        d["protected_spans"] = tuple(tuple(s) for s in d.get("protected_spans", ()))
        return Config(**d)


def _config_dict(config: Config) -> dict:
    d = asdict(config)
    d["protected_spans"] = [list(s) for s in config.protected_spans]
    return d
