// Fused decode attention over a quantized Mid segment (kernels/cpu_decode.py): projected
// coefficients, or unprojected keys/values (an identity basis: the caller skips the projections).
// Built at first use by torch.utils.cpp_extension. One call takes every Mid segment of a decode
// batch and runs their splits of rows on its own threads, with the GIL released.
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor (lighter than torch/extension.h)

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

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

/* One Mid segment of one sequence: its query terms, codes and split outputs, checked. */
struct MidSegment {
    const float *qp, *qb, *ks, *ko, *vs, *vo;
    const uint8_t *kr, *vr;
    const int *kst, *krk, *vst, *vrk, *stat;
    float *coef, *lse;
    int H, G, RK, RV, N, S, kbytes, vbytes, kC, vC, kbits, vbits, vrow;
};

// Per segment, 15 tensors: qp [H, G, RK], qb [H, G], k_rows [N, kbytes] uint8, k_scale/k_offset
// [Pm, kC], k_starts/k_ranks [H] int32, v_rows, v_scale/v_offset ([Pm, vC], or [N, H] with per-row
// value statistics), v_starts/v_ranks, row_stat [N] int32, coef [S, H, G, RV] and lse [S, H, G]
// (both written); and 3 ints: k_bits, v_bits, per-row value statistics (0/1). kC/vC, the codes per
// row, are the last head's start + rank.
static MidSegment check_segment(const at::Tensor *t, const int64_t *flags) {
    const at::Tensor &qp = t[0], &k_rows = t[2], &k_scale = t[3], &v_rows = t[7], &v_scale = t[8];
    const at::Tensor &coef = t[13], &lse = t[14];
    MidSegment m;
    m.qp = input<float>(qp, "qp"); m.qb = input<float>(t[1], "qb");
    m.kr = input<uint8_t>(k_rows, "k_rows"); m.ks = input<float>(k_scale, "k_scale"); m.ko = input<float>(t[4], "k_offset");
    m.kst = input<int>(t[5], "k_starts"); m.krk = input<int>(t[6], "k_ranks");
    m.vr = input<uint8_t>(v_rows, "v_rows"); m.vs = input<float>(v_scale, "v_scale"); m.vo = input<float>(t[9], "v_offset");
    m.vst = input<int>(t[10], "v_starts"); m.vrk = input<int>(t[11], "v_ranks");
    m.stat = input<int>(t[12], "row_stat");
    TORCH_CHECK(coef.is_contiguous() && lse.is_contiguous(), "coef and lse must be contiguous");
    m.coef = coef.data_ptr<float>(); m.lse = lse.data_ptr<float>();
    m.H = qp.size(0); m.G = qp.size(1); m.RK = qp.size(2); m.RV = coef.size(3);
    m.N = k_rows.size(0); m.S = coef.size(0);
    m.kbytes = k_rows.size(1); m.vbytes = v_rows.size(1);
    m.kbits = flags[0]; m.vbits = flags[1]; m.vrow = flags[2];
    m.kC = m.kst[m.H - 1] + m.krk[m.H - 1]; m.vC = m.vst[m.H - 1] + m.vrk[m.H - 1];
    TORCH_CHECK(k_scale.size(1) == m.kC && k_rows.size(1) * 8 >= m.kC * m.kbits, "key codes/statistics do not match the ranks");
    TORCH_CHECK(m.vrow ? v_scale.size(0) == m.N && v_scale.size(1) == m.H : v_scale.size(1) == m.vC,
                "value statistics do not match their mode");
    TORCH_CHECK(v_rows.size(1) * 8 >= m.vC * m.vbits, "value codes do not match the ranks");
    TORCH_CHECK(lse.size(0) == m.S && t[12].size(0) == m.N, "split outputs or row index do not match");
    return m;
}

static void run_splits(const MidSegment &m, int s0, int s1, float cap) {
    mid_decode_splits(m.qp, m.qb, m.H, m.G, m.RK, m.RV, m.N, m.S, s0, s1, cap,
                      m.kr, m.kbytes, m.ks, m.ko, m.kC, m.kst, m.krk, m.kbits,
                      m.vr, m.vbytes, m.vs, m.vo, m.vC, m.vst, m.vrk, m.vbits, m.vrow, m.stat, m.coef, m.lse);
}

// Every split of every Mid segment of a decode batch (each segment one sequence's Mid or Mid
// epoch): work items are (segment, split of rows), all kv-heads of a split at once; `threads`
// threads take contiguous runs of items holding about equal numbers of rows. cap: logit softcap,
// 0 for none.
void mid_decode_batch(const std::vector<at::Tensor> &tensors, const std::vector<int64_t> &flags,
                      int64_t threads, double cap) {
    TORCH_CHECK(tensors.size() % 15 == 0 && flags.size() * 5 == tensors.size(),
                "15 tensors and 3 flags per segment");
    std::vector<MidSegment> segs;
    std::vector<std::pair<int, int>> items;  // (segment, split)
    std::vector<int64_t> first_row;  // rows before each item
    int64_t rows = 0;
    for (size_t i = 0; i * 15 < tensors.size(); ++i) {
        segs.push_back(check_segment(&tensors[i * 15], &flags[i * 3]));
        const MidSegment &m = segs.back();
        int per = (m.N + m.S - 1) / m.S;
        for (int s = 0; s < m.S; ++s) {
            items.emplace_back((int)i, s);
            first_row.push_back(rows);
            int n0 = s * per, n1 = n0 + per < m.N ? n0 + per : m.N;
            rows += n1 > n0 ? n1 - n0 : 0;
        }
    }
    int workers = (int)std::max<int64_t>(1, std::min<int64_t>(threads, (int64_t)items.size()));
    float capf = (float)cap;
    auto run = [&](int w) {  // the items whose first row lies in worker w's share of all rows
        for (size_t j = 0; j < items.size(); ++j) {
            int owner = rows ? (int)std::min<int64_t>(workers - 1, first_row[j] * workers / rows) : 0;
            if (owner == w) run_splits(segs[items[j].first], items[j].second, items[j].second + 1, capf);
        }
    };
    pybind11::gil_scoped_release no_gil;
    std::vector<std::thread> pool;
    for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
    run(0);
    for (auto &t : pool) t.join();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("mid_decode_batch", &mid_decode_batch, "Fused Mid-segment decode attention over a batch of segments");
}
