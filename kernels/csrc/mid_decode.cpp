// Fused decode attention over a quantized Mid segment (kernels/cpu_decode.py): projected
// coefficients, or unprojected keys/values (an identity basis: the caller skips the projections).
// Built at first use by torch.utils.cpp_extension; the Python wrapper runs splits of the rows
// on several threads, so the entry point releases the GIL while it computes.
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor (lighter than torch/extension.h)

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// glibc's vector expf (libmvec, linked by kernels/cpu_decode.py): <math.h> declares it only under
// -ffast-math, whose finite-math mode this kernel must not use. With it the softmax loop vectorizes.
#if defined(__x86_64__) && defined(__GLIBC__)
extern "C" float expf(float) noexcept __attribute__((simd("notinbranch")));
#endif

/* All C codes of one row as floats (the row is short: sum of ranks codes). */
static inline void unpack_row(const uint8_t *row, int C, int bits, float *u) {
    if (bits == 8) {
        for (int c = 0; c < C; ++c) u[c] = (float)row[c];
    } else if (bits == 4) {
        int nb = (C + 1) / 2;
        for (int i = 0; i < nb; ++i) {
            uint8_t b = row[i];
            u[2 * i] = (float)(b & 15);
            u[2 * i + 1] = (float)(b >> 4);
        }
    } else {
        int nb = (C + 3) / 4;
        for (int i = 0; i < nb; ++i) {
            uint8_t b = row[i];
            u[4 * i] = (float)(b & 3);
            u[4 * i + 1] = (float)((b >> 2) & 3);
            u[4 * i + 2] = (float)((b >> 4) & 3);
            u[4 * i + 3] = (float)(b >> 6);
        }
    }
}

/* Splits [s0, s1) of the rows, every kv-head and query head at once. Key statistics are per page,
   so they are folded into the query:
     logit = q.mean_k + sum_r q_r off_r + sum_r (q_r scale_r) code_r
   Value statistics are per page (vrow == 0: [Pm, vC]), applied once per page to code sums,
     sum_n p_n c_n = sum_pages (scale * sum_n p_n code_n + off * sum_n p_n),
   or per row and kv-head (vrow != 0: [N, H], unprojected values quantized per token), folded
   into the weights:
     sum_n p_n c_n = sum_n (p_n scale_n) code_n + sum_n p_n off_n.
   Pass 1: logits of every row and query head, and their max; pass 2: softmax weights and
   the weighted value codes. Rows go 4 at a time (register blocking: each query/accumulator
   element loaded once per 4 rows); a block never crosses a page (rows past its end get zero
   codes and zero weight). Writes coef [S, H, G, RV] (normalised within the split, zero beyond
   each head's rank) and lse [S, H, G] (-inf and 0 for an empty split).
   cap > 0: every logit becomes cap * tanh(logit / cap) (logit softcapping) as soon as it is
   computed, before the max and the softmax; cap == 0: logits are used as they are. */
#define RB 4
static void mid_decode_splits(const float *qp, const float *qb, int H, int G, int RK, int RV, int N, int S,
                              int s0, int s1, float cap,
                              const uint8_t *krows, int kbytes, const float *kscale, const float *koff, int kC,
                              const int *kstarts, const int *kranks, int kbits,
                              const uint8_t *vrows, int vbytes, const float *vscale, const float *voff, int vC,
                              const int *vstarts, const int *vranks, int vbits, int vrow,
                              const int *row_stat, float *coef, float *lse) {
    int HG = H * G;
    int per = (N + S - 1) / S;
    int CM = ((kC > vC ? kC : vC) + 15) & ~7;
    float *u = (float *)calloc((size_t)RB * CM, sizeof(float));
    float *qs = (float *)malloc(sizeof(float) * (size_t)HG * (RK > 0 ? RK : 1));
    float *bias = (float *)malloc(sizeof(float) * HG * 4);
    float *m = bias + HG, *l = bias + 2 * HG, *P = bias + 3 * HG;
    float *A = (float *)malloc(sizeof(float) * (size_t)HG * (RV > 0 ? RV : 1));
    float *pb = (float *)malloc(sizeof(float) * (size_t)RB * HG);
    float *rs = (float *)malloc(sizeof(float) * (size_t)RB * H * 2), *ro = rs + RB * H;  /* vrow: a block's stats */
    for (int s = s0; s < s1; ++s) {
        int n0 = s * per, n1 = n0 + per < N ? n0 + per : N;
        float *acc = coef + (size_t)s * HG * RV;
        float *out_lse = lse + (size_t)s * HG;
        memset(acc, 0, sizeof(float) * (size_t)HG * RV);
        if (n1 <= n0) {
            for (int i = 0; i < HG; ++i) out_lse[i] = -INFINITY;
            continue;
        }
        float *logits = (float *)malloc(sizeof(float) * (size_t)(n1 - n0 + RB) * HG);
        for (int i = 0; i < HG; ++i) m[i] = -INFINITY;
        int cur = -1;
        for (int n = n0; n < n1;) {
            int st = row_stat[n];
            int nb = 1;
            while (nb < RB && n + nb < n1 && row_stat[n + nb] == st) ++nb;
            if (st != cur) {
                cur = st;
                for (int h = 0; h < H; ++h) {
                    const float *sc = kscale + (size_t)st * kC + kstarts[h];
                    const float *of = koff + (size_t)st * kC + kstarts[h];
                    int rk = kranks[h];
                    for (int g = 0; g < G; ++g) {
                        int hg = h * G + g;
                        const float *q = qp + (size_t)hg * RK;
                        float b = qb[hg];
                        for (int r = 0; r < rk; ++r) {
                            qs[(size_t)hg * RK + r] = q[r] * sc[r];
                            b += q[r] * of[r];
                        }
                        bias[hg] = b;
                    }
                }
            }
            for (int i = 0; i < RB; ++i) {
                if (i < nb) unpack_row(krows + (size_t)(n + i) * kbytes, kC, kbits, u + (size_t)i * CM);
                else memset(u + (size_t)i * CM, 0, sizeof(float) * CM);
            }
            float *lg = logits + (size_t)(n - n0) * HG;
            for (int h = 0; h < H; ++h) {
                const float *u0 = u + kstarts[h], *u1 = u0 + CM, *u2 = u1 + CM, *u3 = u2 + CM;
                int rk = kranks[h];
                for (int g = 0; g < G; ++g) {
                    int hg = h * G + g;
                    const float *q = qs + (size_t)hg * RK;
                    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
                    for (int r = 0; r < rk; ++r) {
                        float qv = q[r];
                        d0 += qv * u0[r]; d1 += qv * u1[r]; d2 += qv * u2[r]; d3 += qv * u3[r];
                    }
                    float bb = bias[hg];
                    lg[hg] = bb + d0; lg[HG + hg] = bb + d1; lg[2 * HG + hg] = bb + d2; lg[3 * HG + hg] = bb + d3;
                }
            }
            if (cap > 0.f)
                for (int i = 0; i < nb * HG; ++i) lg[i] = cap * tanhf(lg[i] / cap);
            for (int i = 0; i < nb; ++i)
                for (int j = 0; j < HG; ++j) m[j] = lg[i * HG + j] > m[j] ? lg[i * HG + j] : m[j];
            n += nb;
        }
        for (int i = 0; i < HG; ++i) { l[i] = 0.f; P[i] = 0.f; }
        memset(A, 0, sizeof(float) * (size_t)HG * RV);
        cur = row_stat[n0];
        for (int n = n0; n <= n1;) {
            int st = n < n1 ? row_stat[n] : -1;
            if (st != cur) {  /* flush the page's sums (through its statistics when per page) */
                for (int h = 0; h < H; ++h) {
                    int rv = vranks[h];
                    for (int g = 0; g < G; ++g) {
                        int hg = h * G + g;
                        float *a = A + (size_t)hg * RV, *o = acc + (size_t)hg * RV;
                        float pp = P[hg];
                        if (vrow) {
                            for (int r = 0; r < rv; ++r) { o[r] += a[r] + pp; a[r] = 0.f; }
                        } else {
                            const float *sc = vscale + (size_t)cur * vC + vstarts[h];
                            const float *of = voff + (size_t)cur * vC + vstarts[h];
                            for (int r = 0; r < rv; ++r) { o[r] += sc[r] * a[r] + of[r] * pp; a[r] = 0.f; }
                        }
                        P[hg] = 0.f;
                    }
                }
                cur = st;
            }
            if (n == n1) break;
            int nb = 1;
            while (nb < RB && n + nb < n1 && row_stat[n + nb] == st) ++nb;
            for (int i = 0; i < RB; ++i) {
                if (i < nb) unpack_row(vrows + (size_t)(n + i) * vbytes, vC, vbits, u + (size_t)i * CM);
                else memset(u + (size_t)i * CM, 0, sizeof(float) * CM);
            }
            const float *lg = logits + (size_t)(n - n0) * HG;
            for (int i = 0; i < nb; ++i)
                for (int j = 0; j < HG; ++j) pb[i * HG + j] = expf(lg[i * HG + j] - m[j]);
            for (int i = nb * HG; i < RB * HG; ++i) pb[i] = 0.f;
            for (int i = 0; i < nb; ++i)
                for (int j = 0; j < HG; ++j) l[j] += pb[i * HG + j];
            if (vrow) {
                for (int i = 0; i < RB * H; ++i) { rs[i] = 0.f; ro[i] = 0.f; }
                memcpy(rs, vscale + (size_t)n * H, sizeof(float) * nb * H);
                memcpy(ro, voff + (size_t)n * H, sizeof(float) * nb * H);
            } else {
                for (int i = 0; i < nb; ++i)
                    for (int j = 0; j < HG; ++j) P[j] += pb[i * HG + j];
            }
            for (int h = 0; h < H; ++h) {
                const float *u0 = u + vstarts[h], *u1 = u0 + CM, *u2 = u1 + CM, *u3 = u2 + CM;
                int rv = vranks[h];
                for (int g = 0; g < G; ++g) {
                    int hg = h * G + g;
                    float p0 = pb[hg], p1 = pb[HG + hg], p2 = pb[2 * HG + hg], p3 = pb[3 * HG + hg];
                    if (vrow) {
                        P[hg] += p0 * ro[h] + p1 * ro[H + h] + p2 * ro[2 * H + h] + p3 * ro[3 * H + h];
                        p0 *= rs[h]; p1 *= rs[H + h]; p2 *= rs[2 * H + h]; p3 *= rs[3 * H + h];
                    }
                    float *a = A + (size_t)hg * RV;
                    for (int r = 0; r < rv; ++r) a[r] += p0 * u0[r] + p1 * u1[r] + p2 * u2[r] + p3 * u3[r];
                }
            }
            n += nb;
        }
        for (int i = 0; i < HG; ++i) {
            float inv = 1.f / l[i];
            for (int r = 0; r < RV; ++r) acc[(size_t)i * RV + r] *= inv;
            out_lse[i] = m[i] + logf(l[i]);
        }
        free(logits);
    }
    free(u); free(qs); free(bias); free(A); free(pb); free(rs);
}

template <typename T>
static const T *input(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
    return t.data_ptr<T>();
}

// Splits [s0, s1) of the S = coef.size(0) splits. Shapes: qp [H, G, RK], qb [H, G], k_rows [N, kbytes]
// uint8, k_scale/k_offset [Pm, kC], k_starts/k_ranks [H] int32, values alike (v_row_stats: v_scale/
// v_offset [N, H] instead), row_stat [N] int32, coef [S, H, G, RV], lse [S, H, G] (both written).
// kC/vC, the codes per row, are the last head's start + rank. cap: logit softcap, 0 for none.
void mid_decode(const at::Tensor &qp, const at::Tensor &qb, int64_t s0, int64_t s1, double cap,
                const at::Tensor &k_rows, const at::Tensor &k_scale, const at::Tensor &k_offset,
                const at::Tensor &k_starts, const at::Tensor &k_ranks, int64_t k_bits,
                const at::Tensor &v_rows, const at::Tensor &v_scale, const at::Tensor &v_offset,
                const at::Tensor &v_starts, const at::Tensor &v_ranks, int64_t v_bits, bool v_row_stats,
                const at::Tensor &row_stat, const at::Tensor &coef, const at::Tensor &lse) {
    TORCH_CHECK(coef.is_contiguous() && lse.is_contiguous(), "coef and lse must be contiguous");
    int H = qp.size(0), G = qp.size(1), RK = qp.size(2), RV = coef.size(3);
    int N = k_rows.size(0), S = coef.size(0);
    const float *q = input<float>(qp, "qp"), *qbias = input<float>(qb, "qb");
    const uint8_t *kr = input<uint8_t>(k_rows, "k_rows"), *vr = input<uint8_t>(v_rows, "v_rows");
    const float *ks = input<float>(k_scale, "k_scale"), *ko = input<float>(k_offset, "k_offset");
    const float *vs = input<float>(v_scale, "v_scale"), *vo = input<float>(v_offset, "v_offset");
    const int *kst = input<int>(k_starts, "k_starts"), *krk = input<int>(k_ranks, "k_ranks");
    const int *vst = input<int>(v_starts, "v_starts"), *vrk = input<int>(v_ranks, "v_ranks");
    const int *stat = input<int>(row_stat, "row_stat");
    int kC = kst[H - 1] + krk[H - 1], vC = vst[H - 1] + vrk[H - 1];
    TORCH_CHECK(k_scale.size(1) == kC && k_rows.size(1) * 8 >= kC * k_bits, "key codes/statistics do not match the ranks");
    TORCH_CHECK(v_row_stats ? v_scale.size(0) == N && v_scale.size(1) == H : v_scale.size(1) == vC,
                "value statistics do not match their mode");
    TORCH_CHECK(v_rows.size(1) * 8 >= vC * v_bits, "value codes do not match the ranks");
    float *c = coef.data_ptr<float>(), *l = lse.data_ptr<float>();
    pybind11::gil_scoped_release no_gil;
    mid_decode_splits(q, qbias, H, G, RK, RV, N, S, s0, s1, (float)cap,
                      kr, k_rows.size(1), ks, ko, kC, kst, krk, k_bits,
                      vr, v_rows.size(1), vs, vo, vC, vst, vrk, v_bits, v_row_stats, stat, c, l);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("mid_decode", &mid_decode, "Fused Mid-segment decode attention over splits [s0, s1)");
}
