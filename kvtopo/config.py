"""kvtopo's one configuration object: validated at construction, immutable afterwards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

POLICIES = ("full",)


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"Config.{field}={value!r} is invalid: {allowed}")


@dataclass(frozen=True)
class Config:
    """How a kvtopo session stores the KV cache.

    page_size: tokens per KV page; pages are the unit of allocation and of re-encoding.
    max_pages: per-layer page limit of the pool (None: grow as needed). A full pool raises.
    prefill_chunk_size: prompt tokens per forward in `kvtopo.generate`'s chunked prefill.
    policy: what to keep and how to encode it; "full" keeps every token exactly.
    """

    page_size: int = 16
    max_pages: int | None = None
    prefill_chunk_size: int = 512
    policy: str = "full"

    def __post_init__(self):
        _require(isinstance(self.page_size, int) and 1 <= self.page_size <= 4096,
                 "page_size", self.page_size, "an int in [1, 4096]")
        _require(self.max_pages is None or (isinstance(self.max_pages, int) and self.max_pages >= 1),
                 "max_pages", self.max_pages, "None or an int >= 1")
        _require(isinstance(self.prefill_chunk_size, int) and self.prefill_chunk_size >= 1,
                 "prefill_chunk_size", self.prefill_chunk_size, "an int >= 1")
        _require(self.policy in POLICIES, "policy", self.policy, f"one of {POLICIES}")

    @classmethod
    def lossless(cls, **overrides) -> "Config":
        """Every token kept exactly: results equal the uncompressed model's."""
        return cls(policy="full", **overrides)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)
