"""What one decode step of one sequence-layer attends to, as plain tensors: exact K/V, Recent
codes and Mid codes exactly as the store keeps them (nothing decoded). The runtime builds these
(runtime/decode_view.py); the decode kernels (kernels/cpu_decode.py, kernels/triton_decode.py)
and the float64 reference (kernels/decode_reference.py) read them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .compressed_attention import LowRankHeads
from .quant import Quantized, dequantize, unpack


@dataclass(frozen=True, eq=False)
class RecentCodes:
    """Recent pages of one sequence-layer, codes as stored (packed along the last dim).

    k_codes [Hkv, Nr, ceil(dk*bits/8)] uint8 with per-page per-channel statistics
    k_scale/k_offset [Hkv, Nr // page_size, dk]; v_codes [Hkv, Nr, ceil(dv*bits/8)] with
    per-token statistics v_scale/v_offset [Hkv, Nr]. Statistics as the pages keep them (float16,
    or float32 where a value is beyond float16's range). Recent pages are always
    full pages (only the last page of a sequence is partial, and it is Terminal), so token t's
    key statistics are row t // page_size.
    """

    k_codes: Tensor
    k_scale: Tensor
    k_offset: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_offset: Tensor
    bits: int
    page_size: int
    dk: int
    dv: int

    @classmethod
    def from_pages(cls, pages: list[tuple[Quantized, Quantized]], page_size: int) -> RecentCodes:
        """Stack Recent pages, each (keys quantized per channel, values quantized per token):
        a small copy, nothing decoded."""
        keys, values = [k for k, _ in pages], [v for _, v in pages]
        return cls(
            torch.cat([k.codes for k in keys], 1), torch.cat([k.scale for k in keys], 1),
            torch.cat([k.offset for k in keys], 1), torch.cat([v.codes for v in values], 1),
            torch.cat([v.scale for v in values], 1)[..., 0], torch.cat([v.offset for v in values], 1)[..., 0],
            keys[0].bits, page_size, keys[0].length, values[0].length)

    @classmethod
    def concat(cls, parts: list[RecentCodes]) -> RecentCodes:
        """Several sequences' Recent codes as one (whole pages side by side, so the page
        statistics stay aligned), to decode a batch at once; one encoding for all of them."""
        first = parts[0]
        if any((p.bits, p.page_size, p.dk, p.dv) != (first.bits, first.page_size, first.dk, first.dv) for p in parts):
            raise ValueError("Recent codes of one batch must share bits, page size and head dims")
        fields = [torch.cat([getattr(p, f) for p in parts], 1)
                  for f in ("k_codes", "k_scale", "k_offset", "v_codes", "v_scale", "v_offset")]
        return cls(*fields, first.bits, first.page_size, first.dk, first.dv)

    @property
    def tokens(self) -> int:
        return self.k_codes.shape[1]

    def decode(self) -> tuple[Tensor, Tensor]:
        """float32 keys [Hkv, Nr, dk] and values [Hkv, Nr, dv] (reference/fallback only)."""
        k_scale = self.k_scale.repeat_interleave(self.page_size, 1)[:, : self.tokens]
        k_offset = self.k_offset.repeat_interleave(self.page_size, 1)[:, : self.tokens]
        k = dequantize(Quantized(self.k_codes, k_scale, k_offset, self.bits, self.dk))
        v = dequantize(Quantized(self.v_codes, self.v_scale[..., None], self.v_offset[..., None], self.bits, self.dv))
        return k, v


@dataclass(frozen=True, eq=False)
class MidCodes:
    """A quantized Mid segment, codes as stored.

    k_rows [N, ceil(Ck*k_bits/8)] uint8, codes of all kv-heads side by side (head h's columns
    are k_starts[h] .. k_starts[h] + k_ranks[h]), first code in the low bits; k_scale/k_offset
    [Pm, Ck] as the store keeps them (float16, or float32 where a value is beyond float16's
    range), one statistics row per page that kept rows; row_stat [N] int32: the
    statistics row of each code row. Values alike. Bases: k_vectors [Hkv, dk, Rk] (zero beyond
    each head's rank), k_mean [Hkv, dk]; v_vectors [Hkv, dv, Rv], v_mean [Hkv, dv], float32.
    k_starts/k_ranks/v_starts/v_ranks: int32 [Hkv].

    Unprojected (``projected`` False, KIVI-style): the codes are the keys/values themselves,
    i.e. an identity basis, so no bases are held (vectors and means None; ranks dk and dv,
    starts h * dk and h * dv). Keys keep per-page per-channel statistics; values are quantized
    per token and head (``value_stats_per_row``: v_scale/v_offset [N, Hkv]).
    """

    k_rows: Tensor
    k_scale: Tensor
    k_offset: Tensor
    k_bits: int
    k_starts: Tensor
    k_ranks: Tensor
    k_vectors: Tensor | None
    k_mean: Tensor | None
    v_rows: Tensor
    v_scale: Tensor
    v_offset: Tensor
    v_bits: int
    v_starts: Tensor
    v_ranks: Tensor
    v_vectors: Tensor | None
    v_mean: Tensor | None
    row_stat: Tensor
    projected: bool = True
    value_stats_per_row: bool = False

    @property
    def tokens(self) -> int:
        return self.k_rows.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k_ranks.shape[0]

    @property
    def value_width(self) -> int:
        """Columns per kv-head the kernels accumulate values in: the padded value rank, or dv
        when unprojected (read from the code width, so no device read)."""
        if self.projected:
            return self.v_vectors.shape[2]
        return self.v_rows.shape[1] * (8 // self.v_bits) // self.kv_heads

    def query_terms(self, q: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """What the Mid kernels dot with the key codes: q [Hq, dk] projected on the key bases and
        scaled, [Hkv, G, Rk], and its mean term scale * q . mean_k, [Hkv, G] (unprojected: the
        scaled query and zeros, the identity basis with zero mean)."""
        qg = q.float().reshape(self.kv_heads, -1, q.shape[-1])
        if not self.projected:
            return (scale * qg).contiguous(), qg.new_zeros(qg.shape[:2])
        projected = (scale * (qg @ self.k_vectors.float())).contiguous()
        return projected, (scale * (qg @ self.k_mean.float()[..., None]))[..., 0].contiguous()

    def values_out(self, coefficients: Tensor) -> Tensor:
        """Attention-weighted value coefficients [Hkv, ..., Rv] back to values [Hkv, ..., dv]
        (projected: through the value bases and mean; unprojected: they are the values)."""
        if not self.projected:
            return coefficients
        vectors, mean = self.v_vectors.float(), self.v_mean.float()
        shape = coefficients.shape
        flat = coefficients.reshape(shape[0], -1, shape[-1])
        return (flat @ vectors.transpose(1, 2) + mean[:, None]).reshape(*shape[:-1], vectors.shape[1])

    def rows(self, start: int, stop: int) -> MidCodes:
        """The code rows start..stop of the segment (views; the per-page statistics and bases are
        shared, so each row still reads its own statistics row)."""
        per_row = self.value_stats_per_row
        return dataclasses.replace(
            self, k_rows=self.k_rows[start:stop], v_rows=self.v_rows[start:stop], row_stat=self.row_stat[start:stop],
            v_scale=self.v_scale[start:stop] if per_row else self.v_scale,
            v_offset=self.v_offset[start:stop] if per_row else self.v_offset)

    def dense(self) -> tuple[Tensor, Tensor]:
        """An unprojected segment's keys [Hkv, N, dk] and values [Hkv, N, dv], dequantized to
        float32 (views of token-major tensors): its codes are the keys and values themselves,
        so nothing is padded or projected (``decode()`` puts them on an identity basis)."""
        if self.projected:
            raise ValueError("MidCodes.dense reads unprojected codes; projected ones are coefficients (decode())")
        n, heads, idx = self.tokens, self.kv_heads, self.row_stat.long()
        dk, dv = int(self.k_ranks[0]), int(self.v_ranks[0])
        keys = dequantize(Quantized(self.k_rows, self.k_scale[idx], self.k_offset[idx], self.k_bits, heads * dk))
        if self.value_stats_per_row:  # [N, Hkv]: one statistic per token and head, broadcast over dv
            scale, offset = self.v_scale[..., None], self.v_offset[..., None]
        else:
            scale, offset = self.v_scale[idx].view(n, heads, dv), self.v_offset[idx].view(n, heads, dv)
        codes = unpack(self.v_rows, self.v_bits, heads * dv).view(n, heads, dv)
        values = torch.addcmul(offset.float(), codes.float(), scale.float())
        return keys.view(n, heads, dk).transpose(0, 1), values.transpose(0, 1)

    def decode(self) -> tuple[LowRankHeads, LowRankHeads]:
        """Dequantized coefficients as LowRankHeads, on an identity basis with zero mean when
        unprojected (reference/fallback only): then the coefficients are ``dense()``'s K/V."""
        if not self.projected:
            return tuple(_on_identity_basis(side) for side in self.dense())
        idx = self.row_stat.long()
        sides = []
        for rows, scale, offset, bits, starts, ranks, vectors, mean, per_row in (
            (self.k_rows, self.k_scale, self.k_offset, self.k_bits, self.k_starts, self.k_ranks,
             self.k_vectors, self.k_mean, False),
            (self.v_rows, self.v_scale, self.v_offset, self.v_bits, self.v_starts, self.v_ranks,
             self.v_vectors, self.v_mean, self.value_stats_per_row)):
            width = int(starts[-1] + ranks[-1])
            if per_row:  # [N, Hkv] -> one statistic per code column
                scale, offset = (s.repeat_interleave(ranks.long(), dim=1) for s in (scale, offset))
            else:
                scale, offset = scale[idx], offset[idx]
            flat = dequantize(Quantized(rows, scale, offset, bits, width))  # [N, C]
            heads = ranks.shape[0]
            r_pad = vectors.shape[2]
            padded = flat.new_zeros(heads, flat.shape[0], r_pad)
            for h in range(heads):
                s, r = int(starts[h]), int(ranks[h])
                padded[h, :, :r] = flat[:, s: s + r]
            sides.append(LowRankHeads(padded, vectors.float(), mean.float()))
        return sides[0], sides[1]


def _on_identity_basis(dense: Tensor) -> LowRankHeads:
    """K or V [Hkv, N, d] as LowRankHeads: themselves as coefficients, identity vectors, zero mean."""
    heads, _, d = dense.shape
    return LowRankHeads(dense, torch.eye(d, device=dense.device).expand(heads, d, d), dense.new_zeros(heads, d))


@dataclass(frozen=True, eq=False)
class PagedExact:
    """Exact tokens read where they are: a layer's page pool (keys [S, Hkv, P, dk], values
    [S, Hkv, P, dv], float32 or bfloat16) and the pool slots of the sequence's exact pages, in order (int32
    [pages], every page full but the last), `tokens` tokens in all. The CPU kernel reads them in
    place, so a decode step does not copy a sequence's exact history (all of it, lossless)."""

    keys: Tensor
    values: Tensor
    slots: Tensor
    tokens: int

    def gather(self) -> tuple[Tensor, Tensor]:
        """The tokens as explicit keys [Hkv, N, dk] and values [Hkv, N, dv] (a copy)."""
        return pool_rows(self.keys, self.slots, self.tokens), pool_rows(self.values, self.slots, self.tokens)


def pool_rows(pool: Tensor, slots: Tensor, tokens: int) -> Tensor:
    """The first `tokens` rows of the pool slots `slots` (in order), pool [S, Hkv, P, d] ->
    [Hkv, tokens, d] (a copy)."""
    return pool[slots.long()].transpose(0, 1).flatten(1, 2)[:, :tokens]


@dataclass(frozen=True, eq=False)
class DecodeSegments:
    """Everything one decode step of one sequence-layer attends to.

    exact: (keys [Hkv, N0, dk], values [Hkv, N0, dv]) — Initial/Terminal pages plus the step's
    new token (any float dtype), or only the new token when the pages are `exact_pages`
    (PagedExact, before `exact` in token order); use `exact_kv()` for all exact tokens as
    tensors. recent: RecentCodes; mid: MidCodes (quantized);
    mid_other: Mid stored another way (baseline policies: dense (keys, values) or float
    coefficients as (LowRankHeads, LowRankHeads)) attended by the torch reference;
    retired: earlier Mid epochs (topo refits its bases as the sequence grows), each MidCodes or,
    uncoded, (LowRankHeads, LowRankHeads). Any of them may be None/empty (an empty phase).
    """

    exact: tuple[Tensor, Tensor] | None = None
    recent: RecentCodes | None = None
    mid: MidCodes | None = None
    mid_other: tuple | None = None
    mid_other_projected: bool = False
    retired: tuple = ()
    exact_pages: PagedExact | None = None

    def exact_kv(self) -> tuple[Tensor, Tensor] | None:
        """Every exact token, paged and explicit, as keys [Hkv, N, dk] and values [Hkv, N, dv]."""
        if self.exact_pages is None:
            return self.exact
        pages = self.exact_pages.gather()
        if self.exact is None:
            return pages
        return tuple(torch.cat([a, b.to(a.dtype)], 1) for a, b in zip(pages, self.exact))

    @property
    def only_exact(self) -> bool:
        """No coded or Mid segment: every stored token is exact."""
        return ((self.recent is None or not self.recent.tokens) and self.mid is None and self.mid_other is None
                and not self.retired)

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads: exact K/V, Recent codes + statistics, Mid codes +
        statistics + row index + bases (the torch-reference fallback segment counted as held)."""
        tensors = list(self.exact or ())
        paged = 0
        if self.exact_pages is not None:  # the tokens' rows of the pool, and the slots
            pages = self.exact_pages
            tensors.append(pages.slots)
            paged = pages.tokens * (pages.keys[0, :, 0].nbytes + pages.values[0, :, 0].nbytes)
        coded = [self.recent, self.mid] + [e for e in self.retired if isinstance(e, MidCodes)]
        for part in coded:
            if part is not None:
                tensors += [v for v in vars(part).values() if isinstance(v, Tensor)]
        uncoded = list(self.mid_other or ()) + [s for e in self.retired if not isinstance(e, MidCodes) for s in e]
        for side in uncoded:
            tensors += [side.coefficients, side.vectors, side.mean] if isinstance(side, LowRankHeads) else [side]
        return sum(t.nbytes for t in tensors) + paged

    @property
    def kv_heads(self) -> int:
        if self.mid is not None:
            return self.mid.kv_heads
        if self.exact_pages is not None:
            return self.exact_pages.keys.shape[1]
        for t in (self.exact and self.exact[0], self.recent and self.recent.k_codes):
            if t is not None:
                return t.shape[0]
        if self.mid_other is not None:
            first = self.mid_other[0]
            return (first.vectors if isinstance(first, LowRankHeads) else first).shape[0]
        raise ValueError("DecodeSegments holds no segment")


def rank_columns(ranks) -> tuple[Tensor, Tensor]:
    """(starts, ranks) int32 [Hkv] of each head's columns in a Mid code row (heads side by side)."""
    r = torch.tensor(ranks, dtype=torch.int32)
    return torch.cumsum(r, 0, dtype=torch.int32) - r, r


def check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")
