"""How pages are encoded once they leave the exact pool: Recent (int8) and Mid pages.

Recent: keys quantized per channel, values per token (`recent_bits`, int8 by default).
Mid (per `MidEncoding`): the tokens kept by eviction (per kv-head, the same count per head),
optionally projected onto the head's principal directions (`HeadBases`, fitted once per
sequence and layer), optionally quantized. Projected coefficients of all heads sit side by
side in one [n, sum of ranks] matrix, so only each head's true rank is stored; they are
quantized with one scale per direction for keys and values alike. Unprojected tokens are
quantized KIVI-style: keys per channel, values per token and head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtopo.kernels.compressed_attention import LowRankHeads
from kvtopo.kernels.directions import principal_basis
from kvtopo.kernels.quant import Quantized, dequantize, quantize

from .policies.base import MidEncoding


def _nbytes(x) -> int:
    return x.nbytes if x is not None else 0


# -- Recent ------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RecentPage:
    keys: Quantized  # [Hkv, n, dk], statistics per channel
    values: Quantized  # [Hkv, n, dv], statistics per token

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize(self.keys), dequantize(self.values)


def encode_recent(keys: torch.Tensor, values: torch.Tensor, bits: int) -> RecentPage:
    return RecentPage(quantize(keys, bits, reduce_dim=1), quantize(values, bits, reduce_dim=-1))


# -- Mid: principal directions -------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class HeadBases:
    """Per-kv-head principal directions, padded to the largest rank (zero columns beyond rank)."""

    vectors: torch.Tensor  # [Hkv, d, R]
    mean: torch.Tensor  # [Hkv, d]
    ranks: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.vectors.nbytes + self.mean.nbytes

    @property
    def columns(self) -> torch.Tensor:
        """Indices of the true-rank columns in the flattened [Hkv * R] padded layout."""
        width = self.vectors.shape[-1]
        return torch.cat([h * width + torch.arange(r) for h, r in enumerate(self.ranks)]).long() \
            if sum(self.ranks) else torch.empty(0, dtype=torch.long)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [Hkv, n, d] -> coefficients [n, sum of ranks] (true ranks only)."""
        padded = (x.float() - self.mean[:, None]) @ self.vectors  # [Hkv, n, R]
        return padded.transpose(0, 1).reshape(x.shape[1], -1)[:, self.columns]

    def expand(self, flat: torch.Tensor) -> LowRankHeads:
        """Coefficients [n, sum of ranks] -> LowRankHeads for compressed-domain attention."""
        heads, _, width = self.vectors.shape
        padded = flat.new_zeros(flat.shape[0], heads * width)
        padded[:, self.columns] = flat
        return LowRankHeads(padded.view(-1, heads, width).transpose(0, 1), self.vectors, self.mean)


def fit_bases(x: torch.Tensor, energy: float) -> HeadBases:
    """Principal directions of each kv-head's rows of x [Hkv, N, d], keeping `energy` of it."""
    bases = [principal_basis(head, energy) for head in x.float()]
    width = max(1, max(b.rank for b in bases))
    vectors = x.new_zeros(x.shape[0], x.shape[-1], width, dtype=torch.float32)
    for h, b in enumerate(bases):
        vectors[h, :, : b.rank] = b.vectors
    return HeadBases(vectors, torch.stack([b.mean for b in bases]), tuple(b.rank for b in bases))


# -- Mid pages ------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class MidPage:
    """One Mid page's surviving tokens: floats or Quantized, projected or [n, Hkv, d]."""

    keys: torch.Tensor | Quantized
    values: torch.Tensor | Quantized
    tokens: int

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def _store(x: torch.Tensor, bits: int | None, reduce_dim: int, float_dtype: torch.dtype):
    return quantize(x, bits, reduce_dim) if bits else x.to(float_dtype)


def _load(x) -> torch.Tensor:
    return dequantize(x) if isinstance(x, Quantized) else x.float()


class MidCodec:
    """Encodes/decodes Mid pages of one sequence and layer under one MidEncoding."""

    def __init__(self, encoding: MidEncoding, key_bases: HeadBases | None, value_bases: HeadBases | None,
                 dtype: torch.dtype):
        if encoding.project and (key_bases is None or value_bases is None):
            raise ValueError("a projecting Mid encoding needs key and value bases")
        self.encoding = encoding
        self.key_bases, self.value_bases = key_bases, value_bases
        # Projected coefficients are new numbers, not cache entries: float16 is their float form.
        self.float_dtype = torch.float16 if encoding.project else dtype

    @property
    def nbytes(self) -> int:
        return _nbytes(self.key_bases) + _nbytes(self.value_bases)

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> MidPage:
        """keys [Hkv, n, dk], values [Hkv, n, dv] of the surviving tokens -> MidPage."""
        e = self.encoding
        n = keys.shape[1]
        if e.project:
            k = _store(self.key_bases.project(keys), e.key_bits, 0, self.float_dtype) if n else keys.new_empty(0)
            v = _store(self.value_bases.project(values), e.value_bits, 0, self.float_dtype) if n else values.new_empty(0)
        else:
            k = _store(keys.transpose(0, 1), e.key_bits, 0, self.float_dtype) if n else keys.new_empty(0)
            v = _store(values.transpose(0, 1), e.value_bits, -1, self.float_dtype) if n else values.new_empty(0)
        return MidPage(k, v, n)

    def segment(self, pages: list[MidPage]):
        """All Mid pages of a sequence, ready to attend to: (LowRankHeads, LowRankHeads) when
        projected, else dense (keys [Hkv, N, dk], values [Hkv, N, dv]). None when empty."""
        pages = [p for p in pages if p.tokens]
        if not pages:
            return None
        keys = torch.cat([_load(p.keys) for p in pages])
        values = torch.cat([_load(p.values) for p in pages])
        if self.encoding.project:
            return self.key_bases.expand(keys), self.value_bases.expand(values)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def page_nbytes(self, tokens: int, kv_heads: int, key_dim: int, value_dim: int) -> int:
        """Bytes `encode` will hold for `tokens` survivors, for budgeting before encoding.

        Assumes float16 statistics (what `quantize` stores unless a slice needs float32).
        """
        if tokens == 0:
            return 0
        e = self.encoding
        if e.project:
            return (_coded_nbytes((tokens, sum(self.key_bases.ranks)), 0, e.key_bits, self.float_dtype)
                    + _coded_nbytes((tokens, sum(self.value_bases.ranks)), 0, e.value_bits, self.float_dtype))
        return (_coded_nbytes((tokens, kv_heads, key_dim), 0, e.key_bits, self.float_dtype)
                + _coded_nbytes((tokens, kv_heads, value_dim), -1, e.value_bits, self.float_dtype))


def _coded_nbytes(shape: tuple[int, ...], reduce_dim: int, bits: int | None, float_dtype: torch.dtype) -> int:
    """Bytes of `_store` of a tensor of `shape`: floats, or packed codes + float16 scale/offset."""
    elements = math.prod(shape)
    if not bits:
        return elements * torch.finfo(float_dtype).bits // 8
    per_byte = 8 // bits
    codes = math.prod(shape[:-1]) * -(-shape[-1] // per_byte)
    stats = list(shape)
    stats[reduce_dim] = 1
    return codes + 2 * 2 * math.prod(stats)
