"""The page compressor as one exponential-free graph: score, select, project, quantize.

What `runtime.layer_cache` does to a page entering Mid under the `topo` policy, as a pure
function of tensors with static shapes (so NPU toolchains get one fixed graph):

1. score every token with the store's own function, `runtime.policies.topo.topo_scores`
   (`kernels.scoring.expfree_scores`: matmul, max, subtract, relu, sum — no exponential —
   against the observation-window queries, padding rows masked, carried forward to each
   token's successors by a running max);
2. keep the `keep` highest per kv-head. Instead of TopK (data-dependent output shape, and an
   unspecified order among equal scores) each token's rank is counted with comparisons
   (`descending_ranks`), kept = rank < keep, i.e. ties go to the
   lower index. The kept tokens are written in ascending index order into the first `keep`
   of P slots (what `runtime.layer_cache.best_tokens` gives);
3. project the kept keys/values onto the head's principal directions (`HeadBases` padded to
   `rank_capacity` zero columns: padded columns give exact zeros and code 0);
4. quantize each direction over the kept tokens exactly like `kernels.quant.quantize(x, bits,
   reduce_dim=0)`: min/max statistics rounded to float16 toward -inf/+inf (export/f16.py; the
   whole page falls back to float32 statistics when a value is beyond float16's range),
   round-half-even codes, packed `8 // bits` per byte along the directions
   of each head, first code in the low bits.

Inputs (P = page size, W = observation window, R = rank capacity, a multiple of 8 // bits):
    keys [Hkv, P, dk] f32, values [Hkv, P, dv] f32, queries [Hq, W, d] f32 (rows >= num_queries
    are padding), num_queries int64 [], keep int64 [] (1..P), scale f32 [],
    key_vectors [Hkv, dk, R] f32, key_mean [Hkv, dk] f32, value_vectors [Hkv, dv, R], value_mean.
Outputs:
    kept [Hkv, P] int64 (token index per slot; slots >= keep hold 0), key_codes [Hkv, P, R/(8/bits)]
    uint8, key_scale / key_offset [Hkv, R] f32 (float16-exact values when key_stats_f16),
    value_codes, value_scale, value_offset likewise, stats_f16 bool [2] (keys, values).

An unprojected Mid (`CacheLayout.mid_projected` False) uses `UnprojectedPageCompressor`: steps
1-2, then step 4 on the kept tokens' own channels for keys and per token and head for values
(KIVI-style, as `runtime.codecs.MidSegment` without bases); no basis inputs.

MLA layers (values = the keys' leading latent dims, stored once with the keys, as
`runtime.codecs.MidSegment` with `shared_value_dim`) use `SharedValuePageCompressor`: the same
graph without the value inputs and outputs (stats_f16 is [1]).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kvtopo.kernels.quant import float16_holds
from kvtopo.runtime.policies.topo import topo_scores

from .f16 import nextafter_f16, round_toward_f16


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Integer-valued float codes [..., R] (R a multiple of 8 // bits) -> uint8 [..., R / (8 // bits)]."""
    per_byte = 8 // bits
    grouped = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    weights = torch.tensor([float(1 << (bits * j)) for j in range(per_byte)], device=codes.device)
    # Through int32: IREE lowers a float -> uint8 cast as a signed 8-bit conversion, which gets
    # bytes above 127 wrong; int32 -> uint8 keeps the low byte on every toolchain.
    return (grouped * weights).sum(-1).to(torch.int32).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """uint8 [..., C] -> float codes [..., C * (8 // bits)] (arithmetic only: floor and multiply).
    One field per pass, each pass elementwise over [..., C] (no broadcast over a short last dim),
    shifts as multiplications by powers of two (exact, as the divisions they stand for):
    onnxruntime's CPU kernels ran the broadcast form at a third of a decode step."""
    per_byte = 8 // bits
    rest = packed.float()
    if per_byte == 1:
        return rest
    fields = []
    for _ in range(per_byte - 1):
        higher = torch.floor(rest * 2.0 ** -bits)
        fields.append(rest - higher * float(1 << bits))
        rest = higher
    fields.append(rest)
    return torch.stack(fields, dim=-1).flatten(-2)


def quantize_columns(x: Tensor, valid: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`kernels.quant.quantize(x[:, valid], bits, reduce_dim=rows)` per column of x [H, P, R].

    Returns float codes [H, P, R] (0 on invalid rows), scale and offset [H, R] and whether the
    statistics are float16.
    """
    rows = valid[None, :, None]
    lo = torch.where(rows, x, torch.full_like(x, float("inf"))).amin(1)
    hi = torch.where(rows, x, torch.full_like(x, -float("inf"))).amax(1)
    offset, scale, use16 = _statistics(lo, hi, bits)
    return _codes(x, rows, offset[:, None], scale[:, None], bits), scale, offset, use16


def quantize_rows(x: Tensor, valid: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`kernels.quant.quantize(x[:, valid], bits, reduce_dim=-1)`: one statistics pair per row of
    x [H, P, D] (a token of a head). Returns float codes [H, P, D], scale and offset [H, P] (0 on
    invalid rows, which take no part in the float16 decision) and whether they are float16."""
    rows = valid[None, :, None]
    x = torch.where(rows, x, torch.zeros_like(x))  # an invalid row: range 0 at 0 (float16-exact)
    offset, scale, use16 = _statistics(x.amin(-1), x.amax(-1), bits)
    scale = torch.where(valid[None], scale, torch.zeros_like(scale))
    return _codes(x, rows, offset[..., None], scale[..., None], bits), scale, offset, use16


def _statistics(lo: Tensor, hi: Tensor, bits: int) -> tuple[Tensor, Tensor, Tensor]:
    """`kernels.quant`'s offset and scale of slices with range [lo, hi]: float16 values rounded
    down/up, or float32 for every slice when float16 cannot hold the values (`float16_holds`)."""
    levels = float((1 << bits) - 1)
    offset16 = round_toward_f16(lo, -1.0)
    step = nextafter_f16(offset16, 1.0) - offset16
    scale16 = round_toward_f16(torch.maximum((hi - lo + step) / levels, step), 1.0)
    use16 = float16_holds(lo, hi)
    return torch.where(use16, offset16, lo), torch.where(use16, scale16, (hi - lo) / levels), use16


def _codes(x: Tensor, rows: Tensor, offset: Tensor, scale: Tensor, bits: int) -> Tensor:
    """Round-half-even codes of x on the grid offset + code * scale, clamped to the levels; 0 off `rows`."""
    levels = float((1 << bits) - 1)
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - offset) / step)
    codes = torch.minimum(torch.relu(codes), torch.full_like(codes, levels))  # clamp(0, levels)
    return torch.where(rows, codes, torch.zeros_like(codes))


def descending_ranks(scores: Tensor) -> Tensor:
    """Each element's place [..., N] in a descending order of its row (ties: lower index first):
    ``rank_i = #{j: s_j > s_i} + #{j < i: s_j == s_i}``. Comparisons and sums only: no sort or
    TopK, which NPU toolchains lack or (IREE, see export/decode_step.py) may get wrong."""
    idx = torch.arange(scores.shape[-1], device=scores.device)
    other, this = scores[..., None, :], scores[..., :, None]
    before = (other > this) | ((other == this) & (idx[None, :] < idx[:, None]))
    return before.long().sum(-1)


def select_kept(scores: Tensor, keep: Tensor) -> Tensor:
    """Indices [H, P] of the `keep` best tokens per row in ascending order (ties: lower index),
    slots >= keep hold 0. Comparisons and sums only (no TopK, static shapes)."""
    p = scores.shape[-1]
    idx = torch.arange(p, device=scores.device)
    kept = descending_ranks(scores) < keep  # [H, P]
    slot = kept.long().cumsum(-1) - 1
    onehot = kept[:, None, :] & (slot[:, None, :] == idx[None, :, None])  # [H, slot, token]
    return (onehot.long() * idx).sum(-1)


def gather_rows(x: Tensor, kept: Tensor) -> Tensor:
    """Rows kept [H, P] of x [H, P, D], per head."""
    return x.gather(1, kept[..., None].expand(-1, -1, x.shape[-1]))


class PageCompressor(nn.Module):
    """Exponential-free Mid-page encoder (see the module docstring for inputs and outputs)."""

    def __init__(self, bits: int, margin: float):
        super().__init__()
        if bits not in (2, 4, 8):
            raise ValueError(f"mid bits must be 2, 4 or 8, got {bits!r}")
        self.bits, self.margin = bits, float(margin)

    INPUTS = ("keys", "values", "queries", "num_queries", "keep", "scale",
              "key_vectors", "key_mean", "value_vectors", "value_mean")
    OUTPUTS = ("kept", "key_codes", "key_scale", "key_offset", "value_codes", "value_scale", "value_offset",
               "stats_f16")

    def forward(self, keys, values, queries, num_queries, keep, scale,
                key_vectors, key_mean, value_vectors, value_mean):
        kept, valid = self._select(keys, queries, num_queries, keep, scale)
        ck, k_scale, k_offset, k16 = self._code(keys, kept, valid, key_vectors, key_mean)
        cv, v_scale, v_offset, v16 = self._code(values, kept, valid, value_vectors, value_mean)
        return kept, ck, k_scale, k_offset, cv, v_scale, v_offset, torch.stack([k16, v16])

    def _select(self, keys, queries, num_queries, keep, scale):
        scores = topo_scores(queries, keys, scale, self.margin, num_queries)
        return select_kept(scores, keep), torch.arange(keys.shape[1], device=keys.device) < keep

    def _code(self, x, kept, valid, vectors, mean):
        rows = gather_rows(x, kept)
        codes, scale, offset, f16 = quantize_columns((rows - mean[:, None]) @ vectors, valid, self.bits)
        return pack_codes(codes, self.bits), scale, offset, f16


class UnprojectedPageCompressor(PageCompressor):
    """The Mid-page encoder of an unprojected Mid (topo without key/value energy, or kivi): the
    same exp-free selection, then KIVI-style codes of the kept tokens' own channels, as
    `runtime.codecs.MidSegment` codes them: keys per channel over the page's kept tokens
    (key_scale / key_offset [Hkv, dk]), values per token and head (value_scale / value_offset
    [Hkv, P], 0 past `keep`). Codes are packed along the channels (a last byte zero-padded), so
    key_codes is [Hkv, P, ceil(dk / (8 / bits))]. No bases."""

    INPUTS = ("keys", "values", "queries", "num_queries", "keep", "scale")
    OUTPUTS = PageCompressor.OUTPUTS

    def forward(self, keys, values, queries, num_queries, keep, scale):
        kept, valid = self._select(keys, queries, num_queries, keep, scale)
        ck, k_scale, k_offset, k16 = self._code_keys(keys, kept, valid)
        cv, v_scale, v_offset, v16 = quantize_rows(gather_rows(values, kept), valid, self.bits)
        return kept, ck, k_scale, k_offset, self._pack(cv), v_scale, v_offset, torch.stack([k16, v16])

    def _code_keys(self, keys, kept, valid):
        codes, scale, offset, f16 = quantize_columns(gather_rows(keys, kept), valid, self.bits)
        return self._pack(codes), scale, offset, f16

    def _pack(self, codes):
        pad = -codes.shape[-1] % (8 // self.bits)
        if pad:  # as kernels.quant.pack: zero codes fill the last byte
            codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], dim=-1)
        return pack_codes(codes, self.bits)


class SharedValuePageCompressor(PageCompressor):
    """The Mid-page encoder for MLA layers: values are the keys' leading dims, so only keys are coded."""

    INPUTS = ("keys", "queries", "num_queries", "keep", "scale", "key_vectors", "key_mean")
    OUTPUTS = ("kept", "key_codes", "key_scale", "key_offset", "stats_f16")

    def forward(self, keys, queries, num_queries, keep, scale, key_vectors, key_mean):
        kept, valid = self._select(keys, queries, num_queries, keep, scale)
        ck, k_scale, k_offset, k16 = self._code(keys, kept, valid, key_vectors, key_mean)
        return kept, ck, k_scale, k_offset, k16[None]


class SharedValueUnprojectedPageCompressor(UnprojectedPageCompressor):
    """The unprojected Mid-page encoder for MLA layers: only the keys ([latent ; RoPE key]) are
    coded, per channel; the values are their leading dims."""

    INPUTS = ("keys", "queries", "num_queries", "keep", "scale")
    OUTPUTS = SharedValuePageCompressor.OUTPUTS

    def forward(self, keys, queries, num_queries, keep, scale):
        kept, valid = self._select(keys, queries, num_queries, keep, scale)
        ck, k_scale, k_offset, k16 = self._code_keys(keys, kept, valid)
        return kept, ck, k_scale, k_offset, k16[None]


def compressor_class(layout) -> type[PageCompressor]:
    """The page compressor a layout's Mid needs: projected (per kv-head bases) or unprojected
    (KIVI-style codes of the tokens' channels), keys only for MLA layers."""
    if not layout.mid_projected:
        return SharedValueUnprojectedPageCompressor if layout.shared_value_dim else UnprojectedPageCompressor
    return SharedValuePageCompressor if layout.shared_value_dim else PageCompressor
