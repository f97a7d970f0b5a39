"""How pages are encoded once they leave the exact pool: Recent (int8) and Mid pages.

Recent: keys quantized per channel, values per token (`recent_bits`, int8 by default).
Mid (per `MidEncoding`, `MidSegment`): the tokens kept by eviction (per kv-head, the same
count per head), optionally projected onto the head's principal directions (`HeadBases`,
fitted per Mid epoch: once per sequence and layer, or again as it grows when the policy
refits), optionally quantized, appended page by page to contiguous buffers. Projected coefficients of all heads sit side by side in one
[n, sum of ranks] matrix, so only each head's true rank is stored; they are quantized with one
scale per direction (per page) for keys and values alike. Unprojected tokens are quantized
KIVI-style: keys per channel (per page), values per token and head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtopo.kernels.compressed_attention import LowRankHeads
from kvtopo.kernels.directions import principal_basis
from kvtopo.kernels.quant import Quantized, dequantize, quantize, quantize_float16

from .page_pool import updatable
from .policies.base import MidEncoding


def _nbytes(x) -> int:
    return x.nbytes if x is not None else 0


# -- Recent ------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RecentPage:
    keys: Quantized  # [Hkv, n, dk], statistics per channel
    values: Quantized | None  # [Hkv, n, dv], statistics per token; None when values live in the keys

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + _nbytes(self.values)

    def decode(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return dequantize(self.keys), dequantize(self.values) if self.values is not None else None


def decode_recent_pages(pages: list[RecentPage]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`RecentPage.decode` of every page, in one batch of ops where the pages agree on shapes
    and statistics dtypes (else page by page): the same values, dequantizing is elementwise."""
    def layout(q: Quantized | None):
        return None if q is None else (q.codes.shape, q.scale.shape, q.scale.dtype, q.offset.dtype, q.bits, q.length)

    if len(pages) < 2 or len({(layout(p.keys), layout(p.values)) for p in pages}) > 1:
        return [page.decode() for page in pages]

    def stacked(side: str) -> torch.Tensor | None:
        parts = [getattr(page, side) for page in pages]
        if parts[0] is None:
            return None
        return dequantize(Quantized(torch.stack([q.codes for q in parts]), torch.stack([q.scale for q in parts]),
                                    torch.stack([q.offset for q in parts]), parts[0].bits, parts[0].length))

    keys, values = stacked("keys"), stacked("values")
    return [(keys[i], None if values is None else values[i]) for i in range(len(pages))]


def encode_recent(keys: torch.Tensor, values: torch.Tensor | None, bits: int) -> RecentPage:
    values = quantize(values, bits, reduce_dim=-1) if values is not None else None
    return RecentPage(quantize(keys, bits, reduce_dim=1), values)


def encode_recent_pages(keys: torch.Tensor, values: torch.Tensor | None, bits: int) -> RecentPage | None:
    """`encode_recent` of every page of keys [B, Hkv, P, dk] / values [B, Hkv, P, dv] in one
    batch of ops, with the same codes: one RecentPage whose tensors are the pages stacked on dim
    0 (`recent_page_at` takes page i out); None when some page's statistics need float32
    (encode the pages one by one then: each decides for itself)."""
    k = quantize_float16(keys, bits, reduce_dim=2)
    v = quantize_float16(values, bits, reduce_dim=-1) if values is not None else None
    if k is None or (values is not None and v is None):
        return None
    return RecentPage(k, v)


def recent_page_at(stacked: RecentPage, i: int) -> RecentPage:
    """Page i of `encode_recent_pages`' stack as its own tensors (views would keep the stack alive)."""
    return RecentPage(_page_of(stacked.keys, i), _page_of(stacked.values, i) if stacked.values is not None else None)


def _page_of(q: Quantized, i: int) -> Quantized:
    return Quantized(q.codes[i].clone(), q.scale[i].clone(), q.offset[i].clone(), q.bits, q.length)


# -- Mid: principal directions -------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class HeadBases:
    """Per-kv-head principal directions. Held as float16 columns of each head's true rank only,
    side by side (that is what they cost); `vectors` rebuilds, per use, the padded float32
    layout the kernels read (zero columns beyond a head's rank)."""

    stored: torch.Tensor  # [d, sum of ranks] float16
    mean: torch.Tensor  # [Hkv, d] float32
    ranks: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes + self.mean.nbytes

    @property
    def vectors(self) -> torch.Tensor:
        """[Hkv, d, R] float32, R = the largest rank (rebuilt per decode step: keep it cheap)."""
        heads, d = self.mean.shape
        padded = torch.zeros(heads, d, max(1, max(self.ranks)), dtype=torch.float32, device=self.stored.device)
        for h, part in enumerate(self.stored.split(self.ranks, dim=1)):
            padded[h, :, : part.shape[1]] = part
        return padded

    @property
    def columns(self) -> torch.Tensor:
        """Indices of the true-rank columns in the flattened [Hkv * R] padded layout."""
        width = max(1, max(self.ranks))
        return torch.cat([h * width + torch.arange(r) for h, r in enumerate(self.ranks)]).long() \
            if sum(self.ranks) else torch.empty(0, dtype=torch.long)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [Hkv, n, d] -> coefficients [n, sum of ranks] (true ranks only)."""
        padded = (x.float() - self.mean[:, None]) @ self.vectors  # [Hkv, n, R]
        return padded.transpose(0, 1).reshape(x.shape[1], padded.shape[0] * padded.shape[2])[:, self.columns]

    def expand(self, flat: torch.Tensor) -> LowRankHeads:
        """Coefficients [n, sum of ranks] -> LowRankHeads for compressed-domain attention."""
        vectors = self.vectors
        heads, _, width = vectors.shape
        padded = flat.new_zeros(flat.shape[0], heads * width)
        padded[:, self.columns] = flat
        return LowRankHeads(padded.view(-1, heads, width).transpose(0, 1), vectors, self.mean)


def fit_bases(x: torch.Tensor, energy: float) -> HeadBases:
    """Principal directions of each kv-head's rows of x [Hkv, N, d], keeping `energy` of it."""
    bases = [principal_basis(head, energy) for head in x.float()]
    stored = torch.cat([b.vectors for b in bases], dim=1).to(torch.float16)
    return HeadBases(stored, torch.stack([b.mean for b in bases]), tuple(b.rank for b in bases))


# -- Mid segment ---------------------------------------------------------------------------------
class GrowingRows:
    """Rows appended along dim 0 into preallocated capacity, grown by an eighth (at least the
    rows added), so appending N rows copies O(N) bytes in all, not O(N^2) as re-concatenating
    the history per append would. `tensor` is a view of the rows held (None before the first);
    the view object changes only when rows are appended, so readers may cache by identity.
    `nbytes` counts the rows held, the bytes the budget plans with; the spare capacity behind
    them (at most an eighth more, and none until the buffer holds eight appends) is allocator
    slack, the price of amortised growth, and is not counted.
    A float16 buffer widens to float32 if appended rows need it (quantization statistics)."""

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self.tensor: torch.Tensor | None = None
        self.length = 0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensor)

    def append(self, rows: torch.Tensor) -> None:
        if self._buffer is not None and self._buffer.dtype != rows.dtype:
            wide = torch.promote_types(self._buffer.dtype, rows.dtype)
            with updatable():
                self._buffer = self._buffer.to(wide)
            rows = rows.to(wide)
        needed = self.length + rows.shape[0]
        if self._buffer is None or needed > self._buffer.shape[0]:
            capacity = max(needed, 0 if self._buffer is None else self._buffer.shape[0] * 9 // 8)
            with updatable():
                grown = rows.new_empty(capacity, *rows.shape[1:])
                if self.length:
                    grown[: self.length] = self._buffer[: self.length]
            self._buffer = grown
        self._buffer[self.length: needed] = rows
        self.length = needed
        self.tensor = self._buffer[:needed]


class CodedRows:
    """One side (keys or values) of a sequence-layer's Mid segment, stored contiguously.

    Rows are the surviving tokens in page order; each page's rows are appended once, when the
    page enters Mid. Rows are floats, or uint8 codes packed along the last dim with statistics
    either per page (reduced over the page's rows: one scale per direction/channel) or per row.
    Contiguous buffers (not per-page pieces) are what attention kernels read in one pass.
    """

    def __init__(self, bits: int | None, per_row_stats: bool, float_dtype: torch.dtype):
        self.bits, self.per_row_stats, self.float_dtype = bits, per_row_stats, float_dtype
        self._rows, self._scale, self._offset = GrowingRows(), GrowingRows(), GrowingRows()
        self._page_rows = GrowingRows()  # rows contributed by each page (0: evicted whole)
        self._page_rows.append(torch.empty(0, dtype=torch.int32))
        self.length = 0  # last-dim length before packing

    rows = property(lambda self: self._rows.tensor)
    scale = property(lambda self: self._scale.tensor)
    offset = property(lambda self: self._offset.tensor)
    page_rows = property(lambda self: self._page_rows.tensor)

    @property
    def count(self) -> int:
        return self._rows.length

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in (self._rows, self._scale, self._offset, self._page_rows))

    def append(self, x: torch.Tensor) -> None:
        """Append one page's rows x [n, ...] (n may be 0: the page was evicted entirely)."""
        self._page_rows.append(torch.tensor([x.shape[0]], dtype=torch.int32))
        if x.shape[0] == 0:
            return
        self.length = x.shape[-1]
        if not self.bits:
            self._rows.append(x.to(self.float_dtype))
            return
        q = quantize(x, self.bits, reduce_dim=-1 if self.per_row_stats else 0)
        self._rows.append(q.codes)
        self._scale.append(q.scale)
        self._offset.append(q.offset)

    def append_pages(self, x: torch.Tensor, counts: torch.Tensor) -> None:
        """`append` of B pages at once: page b's rows are x[b, :counts[b]] of x [B, K, ...] (the
        rest of dim 1 is padding; `counts` on the CPU, as `page_rows`). One batch of ops gives each page the codes its own `append`
        would, unless some page's statistics need float32: then page by page."""
        valid = torch.arange(x.shape[1], device=x.device) < counts.to(x.device)[:, None]  # [B, K]
        held = (counts > 0).to(x.device)
        any_held = bool(counts.any())
        if self.bits and any_held:
            if self.per_row_stats:
                q = quantize_float16(x[valid], self.bits, reduce_dim=-1)
            else:  # statistics over each page's own rows
                mask = valid[held].view(*valid[held].shape, *(1,) * (x.dim() - 2))
                q = quantize_float16(x[held], self.bits, reduce_dim=1, valid=mask)
            if q is None:
                for b, n in enumerate(counts.tolist()):
                    self.append(x[b, :n])
                return
        self._page_rows.append(counts.to(torch.int32))
        if not any_held:
            return
        self.length = x.shape[-1]
        if not self.bits:
            self._rows.append(x[valid].to(self.float_dtype))
        elif self.per_row_stats:
            self._rows.append(q.codes)
            self._scale.append(q.scale)
            self._offset.append(q.offset)
        else:
            self._rows.append(q.codes[valid[held]])
            self._scale.append(q.scale.squeeze(1))
            self._offset.append(q.offset.squeeze(1))

    def decode(self) -> torch.Tensor:
        """All rows as float32 [N, ...]."""
        if not self.bits:
            return self.rows.float()
        scale, offset = self.scale, self.offset
        if not self.per_row_stats:  # one statistics row per page that kept any rows
            repeats = self.page_rows[self.page_rows > 0].long()
            scale = scale.repeat_interleave(repeats, dim=0)
            offset = offset.repeat_interleave(repeats, dim=0)
        return dequantize(Quantized(self.rows, scale, offset, self.bits, self.length))


class MidSegment:
    """The Mid tokens of one sequence and layer under one MidEncoding, plus the head bases.

    With `shared_value_dim` set (MLA latents), values are the leading dims of the keys and
    only the keys are stored.
    """

    def __init__(self, encoding: MidEncoding, key_bases: HeadBases | None, value_bases: HeadBases | None,
                 dtype: torch.dtype, shared_value_dim: int | None = None):
        if encoding.project and (key_bases is None or (value_bases is None and shared_value_dim is None)):
            raise ValueError("a projecting Mid encoding needs key and value bases")
        self.shared_value_dim = shared_value_dim
        self.encoding = encoding
        self.key_bases, self.value_bases = key_bases, value_bases
        # Projected coefficients are new numbers, not cache entries: float16 is their float form.
        self.float_dtype = torch.float16 if encoding.project else dtype
        # Projected: one scale per direction for both sides. Unprojected (KIVI): keys per
        # channel, values per token and head.
        self.keys = CodedRows(encoding.key_bits, False, self.float_dtype)
        self.values = CodedRows(encoding.value_bits, not encoding.project, self.float_dtype)

    @property
    def tokens(self) -> int:
        return self.keys.count

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + _nbytes(self.key_bases) + _nbytes(self.value_bases)

    def append_page(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Encode one page's surviving tokens, keys [Hkv, n, dk] and values [Hkv, n, dv]."""
        if self.encoding.project:
            self.keys.append(self.key_bases.project(keys))
        else:
            self.keys.append(keys.transpose(0, 1))
        if self.shared_value_dim is None:
            self.values.append(self.value_bases.project(values) if self.encoding.project else values.transpose(0, 1))

    def append_pages(self, keys: torch.Tensor, values: torch.Tensor | None, kept: list[int]) -> None:
        """`append_page` of B pages, page b's survivors being the first kept[b] of the K rows of
        keys [B, Hkv, K, dk] and values [B, Hkv, K, dv] (the rest is padding). Unprojected
        pages are encoded together (the same codes); projected ones page by page (a projection
        of more rows is another matmul, which need not round the same)."""
        if self.encoding.project:
            for b, n in enumerate(kept):
                self.append_page(keys[b, :, :n], None if values is None else values[b, :, :n])
            return
        counts = torch.tensor(kept)
        self.keys.append_pages(keys.transpose(1, 2), counts)
        if self.shared_value_dim is None:
            self.values.append_pages(values.transpose(1, 2), counts)

    def attention_inputs(self):
        """(LowRankHeads, LowRankHeads) when projected, else dense (keys [Hkv, N, dk], values
        [Hkv, N, dv]); None while empty. Coefficients are dequantized, never expanded to K/V."""
        if self.tokens == 0:
            return None
        keys = self.keys.decode()
        if self.encoding.project:
            keys = self.key_bases.expand(keys)
        else:
            keys = keys.transpose(0, 1)
        if self.shared_value_dim is not None:
            return keys, _leading_dims(keys, self.shared_value_dim)
        values = self.values.decode()
        values = self.value_bases.expand(values) if self.encoding.project else values.transpose(0, 1)
        return keys, values

    def page_nbytes(self, tokens: int, kv_heads: int, key_dim: int, value_dim: int) -> int:
        """Bytes `append_page` adds for `tokens` survivors, for budgeting before encoding.

        Statistics are counted as float16, what `quantize` stores unless a value is beyond
        float16's range (then float32: this undercounts them).
        """
        shared = self.shared_value_dim is not None
        page_rows = self.keys.page_rows.element_size() * (1 if shared else 2)
        if tokens == 0:
            return page_rows
        e = self.encoding
        if e.project:
            keys = _coded_nbytes((tokens, sum(self.key_bases.ranks)), 0, e.key_bits, self.float_dtype)
            values = 0 if shared else _coded_nbytes((tokens, sum(self.value_bases.ranks)), 0, e.value_bits,
                                                    self.float_dtype)
        else:
            keys = _coded_nbytes((tokens, kv_heads, key_dim), 0, e.key_bits, self.float_dtype)
            values = 0 if shared else _coded_nbytes((tokens, kv_heads, value_dim), -1, e.value_bits, self.float_dtype)
        return page_rows + keys + values


def _leading_dims(keys, dims: int):
    """Values that are the first `dims` dims of the keys, in the keys' representation."""
    if isinstance(keys, LowRankHeads):
        return LowRankHeads(keys.coefficients, keys.vectors[:, :dims], keys.mean[:, :dims])
    return keys[..., :dims]


def _coded_nbytes(shape: tuple[int, ...], reduce_dim: int, bits: int | None, float_dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` as floats, or as packed codes + float16 scale/offset."""
    elements = math.prod(shape)
    if not bits:
        return elements * torch.finfo(float_dtype).bits // 8
    per_byte = 8 // bits
    codes = math.prod(shape[:-1]) * -(-shape[-1] // per_byte)
    stats = list(shape)
    stats[reduce_dim] = 1
    return codes + 2 * 2 * math.prod(stats)
