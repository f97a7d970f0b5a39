// kernels/quant.py's `quantize` in one call, for the store's page moves: a decode step that
// moves a page quantizes four small tensors (a Recent page's keys and values, a Mid page's), each
// about forty small torch ops in Python. Built at first use by torch.utils.cpp_extension
// (kernels/quant.py) with IEEE arithmetic (no -ffast-math, no contraction): every element is
// computed by the same operations, in the same order and rounding, as the torch version, so the
// codes and statistics are the same bits (tests/kernels/test_quantize_c.py compares them).
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor (lighter than torch/extension.h)

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

namespace {

const float HALF_MAX = 65504.f;

uint16_t half_bits(at::Half h) { return h.x; }
at::Half from_bits(uint16_t bits) { return at::Half(bits, at::Half::from_bits()); }

/* The float16 next to h toward +inf (up) or -inf (IEEE nextafter; h finite). */
at::Half next_half(at::Half h, bool up) {
    const uint16_t bits = half_bits(h);
    if ((bits & 0x7fff) == 0) return from_bits(up ? 0x0001 : 0x8001);  // from +-0: the smallest subnormal
    const bool positive = !(bits & 0x8000);
    return from_bits(positive == up ? bits + 1 : bits - 1);
}

/* float32 v as float16, rounded toward +inf (up) or -inf: to nearest, then one step back when
   that went past v (quant.py `_round_toward`). */
at::Half round_toward(float v, bool up) {
    const at::Half rounded(v);  // round to nearest even
    const float wide = static_cast<float>(rounded);
    return (up ? wide < v : wide > v) ? next_half(rounded, up) : rounded;
}

/* x's level: round((x - offset) / step) (half to even, as torch.round) within [0, levels]. */
inline uint8_t code(float x, float offset, float step, float levels) {
    const float c = rintf((x - offset) / step);
    return static_cast<uint8_t>(c < 0.f ? 0.f : c > levels ? levels : c);
}

/* One row of `length` codes packed `bits` wide into out: the first code in the low bits, a last
   byte only partly used zero-padded (quant.py `pack`). */
void pack(const uint8_t *in, int64_t length, int64_t bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, in, length);
        return;
    }
    const int64_t per_byte = 8 / bits, whole = length / per_byte;
    if (bits == 4)
        for (int64_t i = 0; i < whole; ++i) out[i] = in[2 * i] | in[2 * i + 1] << 4;
    else
        for (int64_t i = 0; i < whole; ++i)
            out[i] = in[4 * i] | in[4 * i + 1] << 2 | in[4 * i + 2] << 4 | in[4 * i + 3] << 6;
    if (whole * per_byte < length) {
        uint8_t last = 0;
        for (int64_t c = whole * per_byte; c < length; ++c) last |= in[c] << (bits * (c - whole * per_byte));
        out[whole] = last;
    }
}

/* (codes, scale, offset) as quant.py `quantize(x, bits, reduce_dim)` makes them, x seen as
   [A, R, B] with R the reduced dimension (one slice of statistics per (a, b)); None when x holds
   a value that is not finite (the caller takes the torch version, whose nan and inf handling
   this does not repeat). */
py::object quantize(const at::Tensor &input, int64_t bits, int64_t reduce_dim) {
    TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kFloat && input.is_contiguous(),
                "quantize: x must be a contiguous float32 CPU tensor");
    TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "quantize: bits must be 2, 4 or 8");
    const int64_t dims = input.dim();
    TORCH_CHECK(dims >= 1 && reduce_dim >= 0 && reduce_dim < dims, "quantize: reduce_dim out of range");
    const int64_t R = input.size(reduce_dim);
    TORCH_CHECK(R > 0, "quantize: empty reduced dimension");
    int64_t A = 1, B = 1;
    for (int64_t d = 0; d < reduce_dim; ++d) A *= input.size(d);
    for (int64_t d = reduce_dim + 1; d < dims; ++d) B *= input.size(d);
    const float *x = input.data_ptr<float>();
    const int64_t n = A * R * B, slices = A * B;
    uint32_t not_finite = 0;  // an all-ones exponent: inf or nan (integer ops: the loop vectorizes)
    for (int64_t i = 0; i < n; ++i) {
        uint32_t word;
        memcpy(&word, x + i, 4);
        not_finite |= (word & 0x7f800000u) == 0x7f800000u;
    }
    if (not_finite) return py::none();

    std::vector<float> lo(slices), hi(slices);
    for (int64_t a = 0; a < A; ++a) {
        const float *first = x + a * R * B;
        if (B == 1) {  // statistics per row: the row's min and max in registers
            float l = first[0], h = first[0];
            for (int64_t r = 1; r < R; ++r) {
                l = first[r] < l ? first[r] : l;
                h = first[r] > h ? first[r] : h;
            }
            lo[a] = l, hi[a] = h;
            continue;
        }
        float *__restrict l = lo.data() + a * B, *__restrict h = hi.data() + a * B;
        std::copy(first, first + B, l);
        std::copy(first, first + B, h);
        for (int64_t r = 1; r < R; ++r) {
            const float *p = first + r * B;
            for (int64_t b = 0; b < B; ++b) {
                l[b] = p[b] < l[b] ? p[b] : l[b];
                h[b] = p[b] > h[b] ? p[b] : h[b];
            }
        }
    }
    bool float16 = true;  // quant.py `float16_holds`
    for (int64_t s = 0; s < slices; ++s) float16 = float16 && lo[s] > -HALF_MAX && hi[s] < HALF_MAX;

    std::vector<int64_t> stat_shape(input.sizes().begin(), input.sizes().end());
    stat_shape[reduce_dim] = 1;
    const auto stat_type = float16 ? at::kHalf : at::kFloat;
    at::Tensor scale = at::empty(stat_shape, input.options().dtype(stat_type));
    at::Tensor offset = at::empty(stat_shape, input.options().dtype(stat_type));
    const float levels = static_cast<float>((1 << bits) - 1);
    std::vector<float> wide_offset(slices), step(slices);  // as `_encode` reads them: float32
    for (int64_t s = 0; s < slices; ++s) {
        if (float16) {  // quant.py `_statistics`
            const at::Half off = round_toward(lo[s], false);
            const float spacing = static_cast<float>(next_half(off, true)) - static_cast<float>(off);
            const float wanted = (hi[s] - lo[s] + spacing) / levels;
            const at::Half sc = round_toward(wanted > spacing ? wanted : spacing, true);
            offset.data_ptr<at::Half>()[s] = off;
            scale.data_ptr<at::Half>()[s] = sc;
            wide_offset[s] = static_cast<float>(off);
            step[s] = static_cast<float>(sc) > 0.f ? static_cast<float>(sc) : 1.f;
        } else {
            const float sc = (hi[s] - lo[s]) / levels;
            offset.data_ptr<float>()[s] = lo[s];
            scale.data_ptr<float>()[s] = sc;
            wide_offset[s] = lo[s];
            step[s] = sc > 0.f ? sc : 1.f;
        }
    }

    // Codes, then packed along the last dimension: 8 / bits codes per byte, the first in the low bits.
    std::vector<uint8_t> raw(n);
    for (int64_t a = 0; a < A; ++a) {
        const int64_t first = a * R * B;
        const float *offsets = wide_offset.data() + a * B, *steps = step.data() + a * B;
        if (B == 1) {  // statistics per row: one slice
            for (int64_t r = 0; r < R; ++r) raw[first + r] = code(x[first + r], offsets[0], steps[0], levels);
            continue;
        }
        for (int64_t r = 0; r < R; ++r)
            for (int64_t b = 0; b < B; ++b) raw[first + r * B + b] = code(x[first + r * B + b], offsets[b], steps[b], levels);
    }
    const int64_t length = input.size(dims - 1), per_byte = 8 / bits, packed = (length + per_byte - 1) / per_byte;
    std::vector<int64_t> code_shape(input.sizes().begin(), input.sizes().end());
    code_shape[dims - 1] = packed;
    at::Tensor codes = at::empty(code_shape, input.options().dtype(at::kByte));
    for (int64_t row = 0; row < n / length; ++row)
        pack(raw.data() + row * length, length, bits, codes.data_ptr<uint8_t>() + row * packed);
    return py::make_tuple(codes, scale, offset);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("quantize", &quantize, "kvtopo.kernels.quant.quantize for a float32 CPU tensor (None: a value is not finite)");
}
