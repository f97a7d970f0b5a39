// Fused decode attention over the stored segments of a decode batch (kernels/cpu_decode.py): Mid
// segments (projected coefficients, or unprojected keys/values: an identity basis, the caller
// skips the projections), Recent pages (codes, head-major) and exact tokens (float32, head-major,
// read as 32-bit "codes" with unit statistics, consecutive or in place in a page pool). Built at first use by torch.utils.cpp_extension.
// One call takes every segment of a decode batch and runs their splits of rows on torch's
// intra-op threads, with the GIL released.
//
// The arithmetic is written with GCC/Clang vector extensions (8 floats): the compiler maps them to
// AVX2/FMA under -march=native and to whatever the target has elsewhere, so there is one code path;
// the exceptions are the unpacking of long 4-bit rows, which has an AVX2 form beside the plain loop,
// and, under AVX-512, pass 2's weighted sums (16 columns per vector), its softmax weights (16 lanes
// per vector expf) and the key dots of heads of 128 columns (16 columns per vector).
// Measured slower and not used: 16-wide dots of shorter heads (64 columns: 2-5% slower; the 8x
// coding's rank 22), 16-wide unpacking of 8-bit codes.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor (lighter than torch/extension.h)

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

// glibc's vector expf (libmvec, linked by kernels/cpu_decode.py): <math.h> declares it only under
// -ffast-math, whose finite-math mode this kernel must not use. With it the softmax loop vectorizes.
#if defined(__x86_64__) && defined(__GLIBC__)
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4), __may_alias__));  // unaligned access

static inline v8f load8(const float *p) { return *(const v8f_u *)p; }
static inline void store8(float *p, v8f x) { *(v8f_u *)p = x; }
static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline int round8(int n) { return (n + 7) & ~7; }

#if defined(__AVX512F__)
typedef float v16f __attribute__((vector_size(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4), __may_alias__));
static inline v16f load16(const float *p) { return *(const v16f_u *)p; }
static inline void store16(float *p, v16f x) { *(v16f_u *)p = x; }
#endif

/* Lane i of the result: the sum of the 8 lanes of a[i] (three rounds of pairwise adds). */
static inline v8f sum_lanes(const v8f *a) {
    v8f h[4], g[2];
    for (int i = 0; i < 4; ++i)
        h[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    for (int i = 0; i < 2; ++i)
        g[i] = __builtin_shufflevector(h[2 * i], h[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
               __builtin_shufflevector(h[2 * i], h[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    return __builtin_shufflevector(g[0], g[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(g[0], g[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Lane j: q_j . u_j over NC chunks of 8 columns, for the 8 query heads of a block (q_j at
   q + j * stride, u_j at u + off[j]). NC and the group size G (query heads per kv-head, when
   it divides 8 or 8 divides it; 0: any) are template arguments, so that short head ranks run
   fully unrolled with the 8 sums in registers, and the G lanes of a kv-head load its codes
   once. */
template <int NC, int G>
static v8f dots8(const float *q, int stride, const float *u, const int *off, int nc) {
    v8f a[8] = {};
    if (G == 0) {  // any group size: each lane its own offset
        for (int j = 0; j < 8; ++j)
            for (int c = 0; c < (NC ? NC : nc); ++c) a[j] += load8(q + (size_t)j * stride + 8 * c) * load8(u + off[j] + 8 * c);
        return sum_lanes(a);
    }
#if defined(__AVX512F__)
    if (NC == 16) {
        v16f b[8] = {};
        for (int h = 0; h < 8 / G; ++h)
            for (int c = 0; c < NC / 2; ++c) {
                v16f x = load16(u + off[h * G] + 16 * c);
                for (int g = 0; g < G; ++g) b[h * G + g] += load16(q + (size_t)(h * G + g) * stride + 16 * c) * x;
            }
        for (int j = 0; j < 8; ++j)
            a[j] = __builtin_shufflevector(b[j], b[j], 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(b[j], b[j], 8, 9, 10, 11, 12, 13, 14, 15);
        return sum_lanes(a);
    }
#endif
    for (int h = 0; h < 8 / G; ++h)
        for (int c = 0; c < (NC ? NC : nc); ++c) {
            v8f x = load8(u + off[h * G] + 8 * c);
            for (int g = 0; g < G; ++g) a[h * G + g] += load8(q + (size_t)(h * G + g) * stride + 8 * c) * x;
        }
    return sum_lanes(a);
}

typedef v8f (*Dots)(const float *, int, const float *, const int *, int);
namespace {  // internal linkage: never bound to the table of another build of this file in the process
template <int G>
struct DotsTable {  // [NC] for NC = 0..16 (up to 128 columns per head), [17] any NC
    static constexpr Dots at[18] = {dots8<0, G>, dots8<1, G>, dots8<2, G>, dots8<3, G>, dots8<4, G>, dots8<5, G>,
                                    dots8<6, G>, dots8<7, G>, dots8<8, G>, dots8<9, G>, dots8<10, G>, dots8<11, G>,
                                    dots8<12, G>, dots8<13, G>, dots8<14, G>, dots8<15, G>, dots8<16, G>, dots8<0, G>};
};
}  // namespace

/* The dot routine for a block of NC chunks and group size G (kv-heads start at multiples of G). */
static Dots pick_dots(int G, int nc) {
    int i = nc <= 16 && nc > 0 ? nc : 17;
    if (G % 8 == 0) return DotsTable<8>::at[i];
    if (G == 4) return DotsTable<4>::at[i];
    if (G == 2) return DotsTable<2>::at[i];
    if (G == 1) return DotsTable<1>::at[i];
    return DotsTable<0>::at[i];
}

/* For GG query heads g of one kv-head: a[g * a_stride + (0 .. 8T)] += sum_i w[i * w_stride + g] *
   u[i * u_stride + (0 .. 8T)] over nb rows: the heads' weighted value codes of a block of rows.
   The heads share each loaded chunk of codes, and their GG * T sums, held in registers, are
   independent chains: one head alone (T sums) waits on the FMA latency every row. Under AVX-512
   pairs of chunks are one 16-float vector (an odd last chunk stays 8 wide): half the FMAs. */
template <int T, int GG>
static void weigh_rows(float *a, int a_stride, const float *u, int u_stride, const float *w, int w_stride, int nb) {
#if defined(__AVX512F__)
    if (T >= 2) {
        constexpr int W = T / 2;  // 16-wide sums per head; an odd T leaves one 8-wide (`rest`)
        v16f wide[GG][W] = {};
        v8f rest[GG] = {};
        for (int i = 0; i < nb; ++i) {
            const float *row = u + (size_t)i * u_stride;
            for (int g = 0; g < GG; ++g) {
                const float x = w[(size_t)i * w_stride + g];
                const v16f p = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
                for (int t = 0; t < W; ++t) wide[g][t] += p * load16(row + 16 * t);
                if (T % 2) rest[g] += splat(x) * load8(row + 16 * W);
            }
        }
        for (int g = 0; g < GG; ++g) {
            float *ag = a + (size_t)g * a_stride;
            for (int t = 0; t < W; ++t) store16(ag + 16 * t, load16(ag + 16 * t) + wide[g][t]);
            if (T % 2) store8(ag + 16 * W, load8(ag + 16 * W) + rest[g]);
        }
        return;
    }
#endif
    v8f acc[GG][T] = {};
    for (int i = 0; i < nb; ++i) {
        const float *row = u + (size_t)i * u_stride;
        for (int g = 0; g < GG; ++g) {
            v8f p = splat(w[(size_t)i * w_stride + g]);
            for (int t = 0; t < T; ++t) acc[g][t] += p * load8(row + 8 * t);
        }
    }
    for (int g = 0; g < GG; ++g)
        for (int t = 0; t < T; ++t) store8(a + (size_t)g * a_stride + 8 * t, load8(a + (size_t)g * a_stride + 8 * t) + acc[g][t]);
}

#if defined(__AVX512F__)
static const int WEIGH_CHUNKS = 8, SUM_REGISTERS = 24;  // of 32 vector registers
static constexpr int sum_vectors(int T) { return T / 2 + T % 2; }
#else
static const int WEIGH_CHUNKS = 4, SUM_REGISTERS = 12;  // of 16
static constexpr int sum_vectors(int T) { return T; }
#endif

/* weigh_rows for `heads` query heads of one kv-head, as many at a time as keep their sums within
   SUM_REGISTERS vector registers. */
template <int T>
static void weigh_heads(float *a, int a_stride, const float *u, int u_stride, const float *w, int w_stride, int nb,
                        int heads) {
    constexpr int most = SUM_REGISTERS / sum_vectors(T) < 4 ? SUM_REGISTERS / sum_vectors(T) : 4;
    for (int g = 0; g < heads;) {
        const int gg = std::min(most, heads - g);
        float *ag = a + (size_t)g * a_stride;
        if (gg == most) weigh_rows<T, most>(ag, a_stride, u, u_stride, w + g, w_stride, nb);
        else if (gg == 3) weigh_rows<T, 3>(ag, a_stride, u, u_stride, w + g, w_stride, nb);
        else if (gg == 2) weigh_rows<T, 2>(ag, a_stride, u, u_stride, w + g, w_stride, nb);
        else weigh_rows<T, 1>(ag, a_stride, u, u_stride, w + g, w_stride, nb);
        g += gg;
    }
}

static const int SHORT_ROW = 64;  // bytes
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));

/* 8 bytes as 8 ints (an unaligned load, widened in vector registers). */
static inline v8i widen8(const uint8_t *src) {
    v8u8 x;
    memcpy(&x, src, 8);
    return __builtin_convertvector(x, v8i);
}

/* C codes packed `bits` wide (first code in the low bits) as floats; 32 bits: float32 values;
   16 bits: bfloat16 values (the high half of a float32). Plain loops, which the loop vectorizer
   widens, except 2- and 4-bit codes: short rows (under SHORT_ROW bytes, e.g. a small model's Mid
   row) are left scalar by the vectorizer, so they are unpacked 8 bytes at a time with vector
   shuffles (measured: faster below, slower above); long 4-bit rows (the default Mid coding of a
   large head) are vectorized by the compiler with a float shuffle per 8 codes, so under AVX2 they
   interleave their nibbles as bytes first (16 bytes at a time: two byte unpacks, then 8 codes per
   widening). GCC scalarizes that byte shuffle written with vector extensions, hence intrinsics. */
static inline void unpack(const uint8_t *__restrict src, int C, int bits, float *__restrict u) {
    if (bits == 32) {
        memcpy(u, src, sizeof(float) * C);
    } else if (bits == 16) {
        for (int c = 0; c < C; ++c) {
            uint16_t half;
            memcpy(&half, src + 2 * c, 2);
            uint32_t word = (uint32_t)half << 16;
            memcpy(u + c, &word, 4);
        }
    } else if (bits == 8) {
        for (int c = 0; c < C; ++c) u[c] = (float)src[c];
    } else if (bits == 4) {
        int i = 0;
#if defined(__AVX2__)
        for (; C / 2 >= SHORT_ROW && i + 16 <= C / 2; i += 16) {  // 16 bytes: 32 codes, interleaved as bytes
            const __m128i x = _mm_loadu_si128((const __m128i *)(src + i)), nib = _mm_set1_epi8(15);
            const __m128i lo = _mm_and_si128(x, nib), hi = _mm_and_si128(_mm_srli_epi16(x, 4), nib);
            const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);
            float *o = u + 2 * i;
            _mm256_storeu_ps(o, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a)));
            _mm256_storeu_ps(o + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))));
            _mm256_storeu_ps(o + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
            _mm256_storeu_ps(o + 24, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))));
        }
#endif
        for (; C / 2 < SHORT_ROW && i + 8 <= C / 2; i += 8) {  // 8 bytes: 16 codes, low nibble first
            v8i x = widen8(src + i), lo = x & 15, hi = x >> 4;
            store8(u + 2 * i, __builtin_convertvector(__builtin_shufflevector(lo, hi, 0, 8, 1, 9, 2, 10, 3, 11), v8f));
            store8(u + 2 * i + 8, __builtin_convertvector(__builtin_shufflevector(lo, hi, 4, 12, 5, 13, 6, 14, 7, 15), v8f));
        }
        for (; i < C / 2; ++i) {
            u[2 * i] = (float)(src[i] & 15);
            u[2 * i + 1] = (float)(src[i] >> 4);
        }
        if (C & 1) u[C - 1] = (float)(src[C / 2] & 15);
    } else {
        int i = 0;
        for (; C / 4 < SHORT_ROW && i + 8 <= C / 4; i += 8) {  // 8 bytes: 32 codes, lowest bits first
            v8i x = widen8(src + i), c0 = x & 3, c1 = (x >> 2) & 3, c2 = (x >> 4) & 3, c3 = x >> 6;
            v8i a = __builtin_shufflevector(c0, c1, 0, 8, 1, 9, 2, 10, 3, 11);  // (c0, c1) of bytes 0-3
            v8i b = __builtin_shufflevector(c2, c3, 0, 8, 1, 9, 2, 10, 3, 11);  // (c2, c3) of bytes 0-3
            v8i e = __builtin_shufflevector(c0, c1, 4, 12, 5, 13, 6, 14, 7, 15);
            v8i f = __builtin_shufflevector(c2, c3, 4, 12, 5, 13, 6, 14, 7, 15);
            float *o = u + 4 * i;
            store8(o, __builtin_convertvector(__builtin_shufflevector(a, b, 0, 1, 8, 9, 2, 3, 10, 11), v8f));
            store8(o + 8, __builtin_convertvector(__builtin_shufflevector(a, b, 4, 5, 12, 13, 6, 7, 14, 15), v8f));
            store8(o + 16, __builtin_convertvector(__builtin_shufflevector(e, f, 0, 1, 8, 9, 2, 3, 10, 11), v8f));
            store8(o + 24, __builtin_convertvector(__builtin_shufflevector(e, f, 4, 5, 12, 13, 6, 7, 14, 15), v8f));
        }
        for (; i < C / 4; ++i) {
            u[4 * i] = (float)(src[i] & 3);
            u[4 * i + 1] = (float)((src[i] >> 2) & 3);
            u[4 * i + 2] = (float)((src[i] >> 4) & 3);
            u[4 * i + 3] = (float)(src[i] >> 6);
        }
        for (int c = C & ~3; c < C; ++c) u[c] = (float)((src[c / 4] >> (2 * (c & 3))) & 3);
    }
}

/* One side (keys or values) of a segment as stored. A row's codes are `parts` runs of
   `part_codes` codes (Mid: one run, every head side by side; Recent and exact tokens: one run
   per kv-head, each in its own [N, bytes] block), unpacked side by side into one float row; head h's columns
   are starts[h] .. starts[h] + ranks[h] of that row and lie within one run.
   Statistics per page (row_stat): page s, run p, column j at scale[s * stat_a + p * stat_b + j];
   per row and head (per_row, values only): row n, head h at scale[n * stat_a + h * stat_b].
   Statistics are read as the store keeps them, float32 or float16 (widened as they are read), so
   a step neither converts nor copies them. */
struct Side {
    const uint8_t *rows;
    int64_t row_stride, part_stride;  // bytes
    int parts, part_codes, bits;
    const float *scale, *offset;            // float32 statistics, or nullptr when float16:
    const at::Half *scale16, *offset16;     // float16 statistics, or nullptr when float32
    int64_t stat_a, stat_b;
    bool per_row;
    const int *starts, *ranks;
    // Paged (exact tokens read in place from a layer's page pool): row n is row n % page_rows of
    // pool slot slots[n / page_rows], slots slot_stride bytes apart. nullptr: rows are consecutive.
    const int *slots;
    int page_rows;
    int64_t slot_stride;

    int width() const { return parts * part_codes; }
    const uint8_t *row(int64_t n) const {
        return slots ? rows + slots[n / page_rows] * slot_stride + (n % page_rows) * row_stride : rows + n * row_stride;
    }
    void unpack_row(int64_t n, float *u) const {
        const uint8_t *r = row(n);
        for (int p = 0; p < parts; ++p) unpack(r + p * part_stride, part_codes, bits, u + (size_t)p * part_codes);
    }
    int64_t page_stat(int64_t page, int h) const {  // offset of head h's first statistic in a page
        int p = part_codes ? starts[h] / part_codes : 0;
        return page * stat_a + p * stat_b + (starts[h] - (int64_t)p * part_codes);
    }
    // n statistics from `at` as float32: in place, or widened into buf (room for n floats).
    const float *scales(int64_t at, int n, float *buf) const { return scale ? scale + at : widen(scale16 + at, n, buf); }
    const float *offsets(int64_t at, int n, float *buf) const { return offset ? offset + at : widen(offset16 + at, n, buf); }
    float scale_at(int64_t at) const { return scale ? scale[at] : static_cast<float>(scale16[at]); }
    float offset_at(int64_t at) const { return offset ? offset[at] : static_cast<float>(offset16[at]); }

  private:
    static const float *widen(const at::Half *h, int n, float *buf) {
        int r = 0;
#if defined(__F16C__)
        for (; r + 8 <= n; r += 8) _mm256_storeu_ps(buf + r, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + r))));
#endif
        for (; r < n; ++r) buf[r] = static_cast<float>(h[r]);
        return buf;
    }
};

/* One segment of one sequence: its query terms, codes and outputs. */
struct Segment {
    const float *qp, *qb;  // [H, G, RK] (zero beyond each head's rank), [H, G]
    Side k, v;
    const int *row_stat;  // [N] page of each row
    float *out, *lse;     // [H, G, RV], [H, G]
    int H, G, RK, RV, N, S;
    std::vector<float> coef, split_lse;  // [S, H, G, RV], [S, H, G]: each split's result
};

/* A page's key statistics folded into one query head: qs[r] = q[r] * scale[r] for r < n; returns
   q . offset. Runs once per page and query head: written in vectors, as the compiler cannot prove
   the output apart from the inputs. */
static inline float fold_key_stats(float *__restrict qs, const float *__restrict q, const float *__restrict scale,
                                   const float *__restrict offset, int n) {
    v8f acc = splat(0.f);
    int r = 0;
    for (; r + 8 <= n; r += 8) {
        store8(qs + r, load8(q + r) * load8(scale + r));
        acc += load8(q + r) * load8(offset + r);
    }
    float b = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    for (; r < n; ++r) {
        qs[r] = q[r] * scale[r];
        b += q[r] * offset[r];
    }
    return b;
}

/* A page's sums of one query head into its output: o[r] += scale[r] * a[r] + offset[r] * p for
   r < n (scale nullptr: per-row statistics, already in the weights: o[r] += a[r] + p), then the
   sums a are zeroed for the next page. Runs once per page and query head: written in vectors,
   as the compiler cannot prove o, a and the statistics apart. */
static inline void flush_sums(float *__restrict o, float *__restrict a, const float *__restrict scale,
                              const float *__restrict offset, float p, int n) {
    const v8f pv = splat(p);
    int r = 0;
    if (scale) {
        for (; r + 8 <= n; r += 8) store8(o + r, load8(o + r) + load8(scale + r) * load8(a + r) + load8(offset + r) * pv);
        for (; r < n; ++r) o[r] += scale[r] * a[r] + offset[r] * p;
    } else {
        for (; r + 8 <= n; r += 8) store8(o + r, load8(o + r) + load8(a + r) + pv);
        for (; r < n; ++r) o[r] += a[r] + p;
    }
    for (r = 0; r < round8(n); r += 8) store8(a + r, splat(0.f));
}

/* w[j] = exp(lg[j] - m[j]) for j < n: under AVX-512, 16 lanes per call of the vector expf. */
#if defined(__AVX512F__)
__attribute__((target("prefer-vector-width=512"), noinline))
#endif
static void softmax_weights(float *__restrict w, const float *__restrict lg, const float *__restrict m, int n) {
    for (int j = 0; j < n; ++j) w[j] = expf(lg[j] - m[j]);
}

/* Splits [s0, s1) of a segment's rows, every kv-head and query head at once. Key statistics are
   per page, so they are folded into the query when the page changes:
     logit = qb + q . (scale * code + offset) = (qb + q . offset) + (q * scale) . code
   Value statistics per page are applied once per page to code sums,
     sum_n p_n value_n = scale * sum_n p_n code_n + offset * sum_n p_n,
   per row they are folded into the weights (p_n * scale_n, and p_n * offset_n summed), so the
   sums run over the whole split with no flush per page (a Mid page keeps only its survivors:
   a few rows, against a flush of every query head's columns).
   Pass 1: logits of every row (8 query heads at a time: eight dots reduced together) and their
   max; pass 2: softmax weights and the weighted value codes, a block of rows at a time (within
   one page when value statistics are per page; a kv-head's query heads weigh each loaded chunk
   of its codes together, their sums held in registers over the block). Each head's dots run
   over whole 8-column chunks: the query is zero beyond the head's rank, and value columns beyond
   it are never read back.
   cap > 0: every logit becomes cap * tanh(logit / cap) before the max and the softmax. */
static void run_splits(Segment &sg, int s0, int s1, float cap) {
    const int H = sg.H, G = sg.G, HG = H * G, RKp = round8(sg.RK), RVp = round8(sg.RV);
    // Query head (h, g) is lane h * Gp + g of pass 1's blocks of 8. Gp = G, unless G neither
    // divides 8 nor is a multiple of it (SmolLM2: 3) and padding each kv-head to the next divisor
    // of 8 adds no block: then every block starts at a kv-head and loads its codes once per
    // kv-head (the lanes beyond G have a zero query). Pass 2 works in head order.
    int Gp = G;
    if (8 % G && G % 8 && G < 8) {
        int padded = G <= 4 ? 4 : 8;
        if (round8(H * padded) == round8(HG)) Gp = padded;
    }
    const int HGp = round8(H * Gp);  // lanes
    std::vector<int> lane(HG);
    for (int hg = 0; hg < HG; ++hg) lane[hg] = hg / G * Gp + hg % G;
    const Side &k = sg.k, &v = sg.v;
    const int per = (sg.N + sg.S - 1) / sg.S;
    const int UW = std::max(k.width(), v.width()) + std::max(RKp, RVp) + 8;  // room for the last chunks
    std::vector<float> qs((size_t)HGp * RKp, 0.f), bias(HGp, 0.f), m(HGp), l(HG), P(HG), A((size_t)HG * RVp);
    const int rb = std::max(4, std::min(32, 8192 / UW));  // pass 2's rows per block: their codes stay in L1
    std::vector<float> U((size_t)rb * UW, 0.f), w((size_t)rb * HGp);
    std::unique_ptr<float[]> logits(new float[(size_t)per * HGp]);  // every row written before it is read: no zeroing
    std::vector<int> koff(HGp, 0), kchunks(HGp / 8, 0), voff(H), vchunks(H);
    std::vector<float> wide_scale(std::max(RKp, RVp)), wide_offset(std::max(RKp, RVp));  // float16 statistics, widened
    for (int x = 0; x < H * Gp; ++x) {  // padding lanes read their kv-head's codes too
        koff[x] = k.starts[x / Gp];
        kchunks[x / 8] = std::max(kchunks[x / 8], (k.ranks[x / Gp] + 7) / 8);
    }
    for (int h = 0; h < H; ++h) {
        voff[h] = v.starts[h];
        vchunks[h] = (v.ranks[h] + 7) / 8;
    }
    for (int s = s0; s < s1; ++s) {
        const int n0 = s * per, n1 = std::min(n0 + per, sg.N);
        float *coef = sg.coef.data() + (size_t)s * HG * sg.RV, *out_lse = sg.split_lse.data() + (size_t)s * HG;
        memset(coef, 0, sizeof(float) * (size_t)HG * sg.RV);
        if (n1 <= n0) {
            for (int i = 0; i < HG; ++i) out_lse[i] = -INFINITY;
            continue;
        }
        std::fill(m.begin(), m.end(), -INFINITY);
        int cur = -1;
        for (int n = n0; n < n1; ++n) {
            if (sg.row_stat[n] != cur) {
                cur = sg.row_stat[n];
                for (int h = 0; h < H; ++h) {
                    const int rk = k.ranks[h];
                    const int64_t at = k.page_stat(cur, h);
                    const float *sc = k.scales(at, rk, wide_scale.data()), *of = k.offsets(at, rk, wide_offset.data());
                    for (int hg = h * G; hg < (h + 1) * G; ++hg) {
                        const float *q = sg.qp + (size_t)hg * sg.RK;
                        bias[lane[hg]] = sg.qb[hg] + fold_key_stats(qs.data() + (size_t)lane[hg] * RKp, q, sc, of, rk);
                    }
                }
            }
            float *u = U.data();
            k.unpack_row(n, u);
            float *lg = logits.get() + (size_t)(n - n0) * HGp;
            for (int b = 0; b < HGp; b += 8) {
                int nc = kchunks[b / 8];
                v8f dots = pick_dots(Gp, nc)(qs.data() + (size_t)b * RKp, RKp, u, koff.data() + b, nc);
                store8(lg + b, dots + load8(bias.data() + b));
            }
            if (cap > 0.f)
                for (int i = 0; i < HGp; ++i) lg[i] = cap * tanhf(lg[i] / cap);
            for (int i = 0; i < HGp; ++i) m[i] = lg[i] > m[i] ? lg[i] : m[i];
        }
        std::fill(l.begin(), l.end(), 0.f);
        std::fill(P.begin(), P.end(), 0.f);
        std::fill(A.begin(), A.end(), 0.f);
        cur = sg.row_stat[n0];
        for (int n = n0; n <= n1;) {
            int st = n < n1 ? sg.row_stat[n] : -1;
            // Flush a page's sums through its statistics; per-row ones: once, at the split's end.
            if (st != cur && (!v.per_row || n == n1)) {
                for (int h = 0; h < H; ++h) {
                    const int rv = v.ranks[h];
                    const float *sc = nullptr, *of = nullptr;  // per-row statistics: already in the weights
                    if (!v.per_row) {
                        const int64_t at = v.page_stat(cur, h);
                        sc = v.scales(at, rv, wide_scale.data()), of = v.offsets(at, rv, wide_offset.data());
                    }
                    for (int hg = h * G; hg < (h + 1) * G; ++hg) {
                        flush_sums(coef + (size_t)hg * sg.RV, A.data() + (size_t)hg * RVp, sc, of, P[hg], rv);
                        P[hg] = 0.f;
                    }
                }
            }
            cur = st;
            if (n == n1) break;
            int nb = 1;
            while (nb < rb && n + nb < n1 && (v.per_row || sg.row_stat[n + nb] == st)) ++nb;
            const float *lg = logits.get() + (size_t)(n - n0) * HGp;
            for (int i = 0; i < nb; ++i) softmax_weights(w.data() + (size_t)i * HGp, lg + (size_t)i * HGp, m.data(), HGp);
            if (Gp != G)  // lanes to head order: query head hg's weight at hg
                for (int i = 0; i < nb; ++i)
                    for (int h = 1; h < H; ++h) memmove(&w[i * HGp + h * G], &w[i * HGp + h * Gp], sizeof(float) * G);
            for (int i = 0; i < nb; ++i) {
                for (int j = 0; j < HG; ++j) l[j] += w[i * HGp + j];
                if (v.per_row) {  // the row's statistics of each kv-head, folded into its heads' weights
                    for (int h = 0; h < H; ++h) {
                        const int64_t at = (n + i) * v.stat_a + h * v.stat_b;
                        for (int j = h * G; j < (h + 1) * G; ++j) {
                            P[j] += w[i * HGp + j] * v.offset_at(at);
                            w[i * HGp + j] *= v.scale_at(at);
                        }
                    }
                } else {
                    for (int j = 0; j < HG; ++j) P[j] += w[i * HGp + j];
                }
                v.unpack_row(n + i, U.data() + (size_t)i * UW);
            }
            for (int h = 0; h < H; ++h) {
                float *a = A.data() + (size_t)h * G * RVp;
                const float *u = U.data() + voff[h], *wh = w.data() + h * G;
                for (int c = 0, nc = vchunks[h]; c < nc; c += WEIGH_CHUNKS) {
                    switch (std::min(WEIGH_CHUNKS, nc - c)) {
                        case 1: weigh_heads<1>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G); break;
                        case 2: weigh_heads<2>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G); break;
                        case 3: weigh_heads<3>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G); break;
#if defined(__AVX512F__)
                        case 4: weigh_heads<4>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G); break;
                        case 5: weigh_heads<5>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G); break;
                        case 6: weigh_heads<6>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G); break;
                        case 7: weigh_heads<7>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G); break;
                        default: weigh_heads<8>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G);
#else
                        default: weigh_heads<4>(a + 8 * c, RVp, u + 8 * c, UW, wh, HGp, nb, G);
#endif
                    }
                }
            }
            n += nb;
        }
        for (int i = 0; i < HG; ++i) {
            float inv = 1.f / l[i];
            for (int r = 0; r < sg.RV; ++r) coef[(size_t)i * sg.RV + r] *= inv;
            out_lse[i] = m[lane[i]] + logf(l[i]);
        }
    }
}

/* The segment's splits merged by log-sum-exp into out [H, G, RV] and lse [H, G]. */
static void merge_splits(Segment &sg) {
    const int HG = sg.H * sg.G, RV = sg.RV;
    for (int i = 0; i < HG; ++i) {
        float mx = -INFINITY, total = 0.f;
        for (int s = 0; s < sg.S; ++s) mx = std::max(mx, sg.split_lse[(size_t)s * HG + i]);
        float *o = sg.out + (size_t)i * RV;
        memset(o, 0, sizeof(float) * RV);
        if (mx == -INFINITY) {
            sg.lse[i] = -INFINITY;
            continue;
        }
        for (int s = 0; s < sg.S; ++s) {
            float wgt = expf(sg.split_lse[(size_t)s * HG + i] - mx);
            const float *c = sg.coef.data() + ((size_t)s * HG + i) * RV;
            for (int r = 0; r < RV; ++r) o[r] += wgt * c[r];
            total += wgt;
        }
        for (int r = 0; r < RV; ++r) o[r] /= total;
        sg.lse[i] = mx + logf(total);
    }
}

template <typename T>
static const T *input(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == c10::CppTypeToScalarType<T>::value,
                name, " must be a contiguous CPU tensor of the expected dtype");
    return t.data_ptr<T>();
}

// Statistics as stored: float32 (into f32) or float16 (into f16); the other stays nullptr.
static void statistics(const at::Tensor &t, const char *name, const float *&f32, const at::Half *&f16) {
    if (t.scalar_type() == at::kHalf)
        f16 = input<at::Half>(t, name);
    else
        f32 = input<float>(t, name);
}

static Side side(const at::Tensor *t, const int64_t *f, int H, int N, const char *name) {
    // t: rows, scale, offset, starts, ranks, slots (empty: not paged); f: bits, parts, part_codes,
    // row_stride, part_stride, stat_a, stat_b, per_row, page_rows, slot_stride
    Side s;
    s.rows = input<uint8_t>(t[0], name);
    s.scale = s.offset = nullptr;
    s.scale16 = s.offset16 = nullptr;
    statistics(t[1], name, s.scale, s.scale16);
    statistics(t[2], name, s.offset, s.offset16);
    s.starts = input<int>(t[3], name); s.ranks = input<int>(t[4], name);
    s.bits = f[0]; s.parts = f[1]; s.part_codes = f[2]; s.row_stride = f[3]; s.part_stride = f[4];
    s.stat_a = f[5]; s.stat_b = f[6]; s.per_row = f[7];
    s.slots = t[5].numel() ? input<int>(t[5], name) : nullptr;
    s.page_rows = f[8]; s.slot_stride = f[9];
    TORCH_CHECK(s.bits == 2 || s.bits == 4 || s.bits == 8 || s.bits == 16 || s.bits == 32, name,
                ": bits must be 2, 4, 8, 16 (bfloat16) or 32 (float32)");
    TORCH_CHECK(t[3].numel() == H && t[4].numel() == H, name, ": one start and rank per kv-head");
    const int64_t row_bytes = (s.parts - 1) * s.part_stride + ((int64_t)s.part_codes * s.bits + 7) / 8;
    TORCH_CHECK((int64_t)s.part_codes * s.bits <= s.row_stride * 8 && s.parts >= 1, name, ": codes do not fit their rows");
    if (s.slots) {
        TORCH_CHECK(s.page_rows >= 1 && (int64_t)N <= t[5].numel() * s.page_rows &&
                        (s.page_rows - 1) * s.row_stride + row_bytes <= s.slot_stride,
                    name, ": paged rows do not fit their pages");
        for (int64_t i = 0; i < t[5].numel(); ++i)
            TORCH_CHECK(s.slots[i] >= 0 && (s.slots[i] + 1) * s.slot_stride <= t[0].numel(), name,
                        ": a page slot lies outside the pool");
    } else {
        TORCH_CHECK(N == 0 || t[0].numel() >= (N - 1) * s.row_stride + row_bytes, name, ": codes do not fit their rows");
    }
    for (int h = 0; h < H; ++h) {
        int p = s.part_codes ? s.starts[h] / s.part_codes : 0;
        TORCH_CHECK(s.ranks[h] == 0 || (s.starts[h] >= 0 && p < s.parts && s.starts[h] + s.ranks[h] <= (p + 1) * s.part_codes),
                    name, ": a head's columns must lie within one run of codes");
    }
    return s;
}

static const int SEGMENT_TENSORS = 17, SEGMENT_INTS = 22;

// Per segment, 17 tensors: qp [H, G, RK], qb [H, G], then for keys and for values: rows (uint8),
// scale, offset (float32 or float16), starts, ranks (int32 [H]), slots (int32, empty unless paged); row_stat
// [N] int32 (or longer: rows past N are not read; a paged segment's covers its pages' capacity),
// out [H, G, RV] and lse [H, G] (both written). And 22 ints: N, then 10 per side (see `side`),
// then the number of splits of the rows, or -r for splits of at most r rows (as many as N needs,
// at least one: a caller that grows N between calls need not recount them).
static Segment segment(const at::Tensor *t, const int64_t *f) {
    Segment sg;
    const at::Tensor &qp = t[0], &out = t[15], &lse = t[16];
    sg.qp = input<float>(qp, "qp"); sg.qb = input<float>(t[1], "qb");
    sg.H = qp.size(0); sg.G = qp.size(1); sg.RK = qp.size(2); sg.RV = out.size(2);
    sg.N = f[0];
    sg.S = f[21] >= 0 ? (int)f[21] : std::max(1, (int)((sg.N - f[21] - 1) / -f[21]));  // -r: splits of r rows
    sg.k = side(t + 2, f + 1, sg.H, sg.N, "keys");
    sg.v = side(t + 8, f + 11, sg.H, sg.N, "values");
    sg.row_stat = input<int>(t[14], "row_stat");
    TORCH_CHECK(t[14].numel() >= sg.N && sg.S >= 1, "row_stat must have N rows (or more), splits >= 1");
    sg.out = const_cast<float *>(input<float>(out, "out")); sg.lse = const_cast<float *>(input<float>(lse, "lse"));
    TORCH_CHECK(out.size(0) == sg.H && out.size(1) == sg.G && lse.numel() == sg.H * sg.G, "out/lse shapes");
    for (int h = 0; h < sg.H; ++h)
        TORCH_CHECK(sg.k.ranks[h] <= sg.RK && sg.v.ranks[h] <= sg.RV, "a rank exceeds the query or output width");
    sg.coef.resize((size_t)sg.S * sg.H * sg.G * sg.RV);
    sg.split_lse.resize((size_t)sg.S * sg.H * sg.G);
    return sg;
}

// Every split of every segment of a decode batch: work items are (segment, split of rows), all
// kv-heads of a split at once; `threads` workers, on torch's intra-op threads, take contiguous
// runs of items holding about equal numbers of rows; then each segment's splits are merged. cap: logit softcap, 0 for none.
static void attend_segments(const std::vector<at::Tensor> &tensors, const int64_t *ints, size_t n_ints,
                            int64_t threads, double cap) {
    TORCH_CHECK(tensors.size() % SEGMENT_TENSORS == 0 && n_ints * SEGMENT_TENSORS == tensors.size() * SEGMENT_INTS,
                "17 tensors and 22 ints per segment");
    std::vector<Segment> segs;
    for (size_t i = 0; i * SEGMENT_TENSORS < tensors.size(); ++i)
        segs.push_back(segment(&tensors[i * SEGMENT_TENSORS], &ints[i * SEGMENT_INTS]));
    std::vector<std::pair<int, int>> items;  // (segment, split)
    std::vector<int64_t> first_row;          // rows before each item
    int64_t rows = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
        const Segment &sg = segs[i];
        int per = (sg.N + sg.S - 1) / sg.S;
        for (int s = 0; s < sg.S; ++s) {
            items.emplace_back((int)i, s);
            first_row.push_back(rows);
            rows += std::max(0, std::min(sg.N, (s + 1) * per) - s * per);
        }
    }
    int workers = (int)std::max<int64_t>(1, std::min<int64_t>(threads, (int64_t)items.size()));
    float capf = (float)cap;
    auto run = [&](int wk) {  // the items whose first row lies in worker wk's share of all rows
        for (size_t j = 0; j < items.size(); ++j) {
            int owner = rows ? (int)std::min<int64_t>(workers - 1, first_row[j] * workers / rows) : 0;
            if (owner == wk) run_splits(segs[items[j].first], items[j].second, items[j].second + 1, capf);
        }
    };
    pybind11::gil_scoped_release no_gil;
    // torch's own intra-op threads: after a torch op they spin a while waiting for work, so
    // threads of the kernel's own would share the cores with them.
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
        for (int64_t wk = begin; wk < end; ++wk) run((int)wk);
    });
    for (Segment &sg : segs) merge_splits(sg);
}

void decode_segments(const std::vector<at::Tensor> &tensors, const std::vector<int64_t> &ints, int64_t threads,
                     double cap) {
    attend_segments(tensors, ints.data(), ints.size(), threads, cap);
}

// The same, the ints as a contiguous int64 tensor (a decode batch keeps them in one).
void decode_segments_held(const std::vector<at::Tensor> &tensors, const at::Tensor &ints, int64_t threads,
                          double cap) {
    TORCH_CHECK(ints.scalar_type() == at::kLong && ints.is_contiguous() && ints.dim() == 1, "ints: int64 [n]");
    attend_segments(tensors, ints.const_data_ptr<int64_t>(), (size_t)ints.numel(), threads, cap);
}

// The partial results of a decode batch merged by log-sum-exp into merged [R, dv] (R = batch *
// query heads): part i, out [rows_i, dv] and lse [rows_i], covers merged rows first[i] ..
// first[i] + rows_i - 1. Rows that no part sees (every lse -inf) come out zero. One call in place
// of the torch merge's stack / logsumexp / exp / product / sum per layer and step.
void merge_parts(const std::vector<at::Tensor> &outs, const std::vector<at::Tensor> &lses,
                 const std::vector<int64_t> &first, at::Tensor merged) {
    TORCH_CHECK(outs.size() == lses.size() && outs.size() == first.size() && !outs.empty(),
                "one lse and one first row per part, at least one part");
    float *m = const_cast<float *>(input<float>(merged, "merged"));
    TORCH_CHECK(merged.dim() == 2, "merged must be [rows, dv]");
    const int64_t R = merged.size(0), dv = merged.size(1);
    std::vector<const float *> o(outs.size()), l(outs.size());
    std::vector<int64_t> n(outs.size());
    for (size_t i = 0; i < outs.size(); ++i) {
        o[i] = input<float>(outs[i], "part out");
        l[i] = input<float>(lses[i], "part lse");
        n[i] = lses[i].numel();
        TORCH_CHECK(outs[i].numel() == n[i] * dv && first[i] >= 0 && first[i] + n[i] <= R,
                    "a part's out must be [rows, dv] with its rows inside merged");
    }
    std::vector<float> mx((size_t)R, -INFINITY), total((size_t)R, 0.f);
    for (size_t i = 0; i < outs.size(); ++i)
        for (int64_t r = 0; r < n[i]; ++r) mx[first[i] + r] = std::max(mx[first[i] + r], l[i][r]);
    memset(m, 0, sizeof(float) * R * dv);
    for (size_t i = 0; i < outs.size(); ++i)
        for (int64_t r = 0; r < n[i]; ++r) {
            const int64_t row = first[i] + r;
            if (l[i][r] == -INFINITY) continue;  // an empty part (its out may be anything)
            const float w = expf(l[i][r] - mx[row]);
            total[row] += w;
            float *dst = m + row * dv;
            const float *src = o[i] + r * dv;
            for (int64_t c = 0; c < dv; ++c) dst[c] += w * src[c];
        }
    for (int64_t row = 0; row < R; ++row)
        if (total[row] > 0.f) {
            const float inv = 1.f / total[row];
            for (int64_t c = 0; c < dv; ++c) m[row * dv + c] *= inv;
        }
}

// Where token (b, h, 0, :) of a [B, H, 1, C] tensor with a contiguous last dimension starts, as
// T (elements of `size` T each: bytes of any dtype as char).
template <typename T>
static const T *token(const at::Tensor &t, int64_t b, int64_t h, int64_t size = 1) {
    return static_cast<const T *>(t.const_data_ptr()) + (b * t.stride(0) + h * t.stride(1)) * size;
}

// The writes of a decode step of a batch whose every sequence's token lands in place
// (runtime/decode_batch.py `DecodeBatch.step`), in one call in place of ~12 small torch ops: each
// sequence's new key and value (k, v [B, Hkv, 1, d]) copied into its Terminal page's next pool
// rows (row next_rows[b, h] of pool_k / pool_v [rows, d], then advanced), its exact count
// ints[exact_at[b]] advanced, and its query (q [B, Hq, 1, d]) scaled into qs [B, Hq, d] float32
// and, when `ring` is given, kept in it as float16 [B, Hq, d]. The same conversions as the torch
// ops it replaces: float32(q) * float32(scale); float16 rounded to nearest even.
void begin_step(const at::Tensor &q, double scale, at::Tensor qs, const at::Tensor &k, const at::Tensor &v,
                at::Tensor pool_k, at::Tensor pool_v, at::Tensor next_rows, at::Tensor ints,
                const at::Tensor &exact_at, std::optional<at::Tensor> ring) {
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 && k.size(2) == 1 && v.size(2) == 1,
                "q [B, Hq, 1, d], k and v [B, Hkv, 1, d]");
    const int64_t B = q.size(0), Hq = q.size(1), d = q.size(3), Hkv = k.size(1);
    TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv, "q, k and v of one batch and k, v of one head count");
    TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "q, k and v need a contiguous last dimension");
    TORCH_CHECK(k.scalar_type() == pool_k.scalar_type() && v.scalar_type() == pool_v.scalar_type() &&
                    pool_k.is_contiguous() && pool_v.is_contiguous() && pool_k.dim() == 2 && pool_v.dim() == 2 &&
                    pool_k.size(1) == k.size(3) && pool_v.size(1) == v.size(3),
                "pool rows [rows, d] of the tokens' dtype");
    TORCH_CHECK(next_rows.scalar_type() == at::kLong && next_rows.is_contiguous() && next_rows.numel() == B * Hkv &&
                    exact_at.scalar_type() == at::kLong && exact_at.is_contiguous() && exact_at.numel() == B &&
                    ints.scalar_type() == at::kLong && ints.is_contiguous(),
                "next_rows [B, Hkv], exact_at [B] and ints: contiguous int64");
    float *scaled = const_cast<float *>(input<float>(qs, "qs"));
    TORCH_CHECK(qs.numel() == B * Hq * d, "qs holds [B, Hq, d]");
    at::Half *kept = nullptr;
    if (ring) {
        TORCH_CHECK(ring->scalar_type() == at::kHalf && ring->is_contiguous() && ring->numel() == B * Hq * d,
                    "ring: float16 [B, Hq, d]");
        kept = ring->data_ptr<at::Half>();
    }
    int64_t *rows = next_rows.data_ptr<int64_t>(), *counts = ints.data_ptr<int64_t>();
    const int64_t *at = exact_at.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {  // every index checked before anything is written
        TORCH_CHECK(at[b] >= 0 && at[b] < ints.numel(), "an exact count outside ints");
        for (int64_t h = 0; h < Hkv; ++h)
            TORCH_CHECK(rows[b * Hkv + h] >= 0 && rows[b * Hkv + h] < std::min(pool_k.size(0), pool_v.size(0)),
                        "a token's row outside the pool");
    }
    const int64_t ksize = k.size(3) * k.element_size(), vsize = v.size(3) * v.element_size();
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < Hkv; ++h) {
            int64_t &row = rows[b * Hkv + h];
            memcpy((char *)pool_k.data_ptr() + row * ksize, token<char>(k, b, h, k.element_size()), ksize);
            memcpy((char *)pool_v.data_ptr() + row * vsize, token<char>(v, b, h, v.element_size()), vsize);
            ++row;
        }
        ++counts[at[b]];
    }
    const float s = (float)scale;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "begin_step", [&] {
        for (int64_t b = 0; b < B; ++b)
            for (int64_t h = 0; h < Hq; ++h) {
                const scalar_t *src = token<scalar_t>(q, b, h);
                float *dst = scaled + (b * Hq + h) * d;
                for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]) * s;
                if (kept)
                    for (int64_t c = 0; c < d; ++c) kept[(b * Hq + h) * d + c] = at::Half(static_cast<float>(src[c]));
            }
    });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("begin_step", &begin_step, "A decode batch's step: its tokens written, counts advanced, queries scaled");
    // The tensor overload first: pybind would take a tensor as a sequence of ints, element by element.
    m.def("decode_segments", &decode_segments_held, "decode_segments with its ints in an int64 tensor");
    m.def("decode_segments", &decode_segments, "Fused decode attention over a batch of quantized segments");
    m.def("merge_parts", &merge_parts, "Log-sum-exp merge of a decode batch's partial results");
}
