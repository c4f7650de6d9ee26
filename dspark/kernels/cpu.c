/* The fast CPU path's fused kernels (kernels/cpu.py builds and loads this file): the decoder's small ops and the
 * attention of short queries (decode, verification) over the paged cache, each one pass instead of several torch ops.
 *
 * Every kernel takes fp32 or bf16 data (bf = 0 / 1) and computes in fp32, rounding to bf16 (nearest even) where the
 * torch formulas of models/llama.py round, in the same order of operations; built with -ffp-contract=off so that no
 * multiply-add is fused where torch computes two roundings. Rows are split over OpenMP threads (torch's own libgomp
 * runtime: the same soname resolves to the library torch already loaded).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef union {
    uint32_t u;
    float f;
} bits32;

static inline float bf2f(uint16_t h) {
    bits32 v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f2bf(float f) {
    bits32 v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) float ld(const void *p, int64_t i, const int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void st(void *p, int64_t i, float x, const int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f2bf(x);
    else
        ((float *)p)[i] = x;
}

/* e^x to about 2 ulp, in a form the compiler vectorises (libm's expf is a call per element): 2^(x log2 e) as 2^n
 * times Cephes' degree-6 minimax polynomial for 2^f on [-0.5, 0.5]. Clamped to fp32's finite range: e^-88 is
 * ~1e-38 where torch gives a denormal or 0, below anything a softmax or SiLU keeps. */
static inline __attribute__((always_inline)) float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float t = x * 1.44269504088896341f;
    const float n = nearbyintf(t), f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    bits32 scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* a . b over d floats: with AVX-512 one register of partial sums and one tree reduction (a plain loop's reduction
 * ends in 16 dependent scalar adds per dot, which made attention 4x slower) */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int64_t d) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < d; i++) sum += a[i] * b[i];
    return sum;
}

#ifdef __AVX512F__
/* 16 values from p + i as fp32 */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, const int bf) {
    if (!bf) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* row `row` of a cache as fp32: bf16 converted into buf, fp32 read in place */
static inline __attribute__((always_inline)) const float *as_f32(const void *cache, int64_t row, int64_t d, float *buf,
                                                                 const int bf) {
    if (!bf) return (const float *)cache + row;
    for (int64_t i = 0; i < d; i++) buf[i] = bf2f(((const uint16_t *)cache)[row + i]);
    return buf;
}

/* x rounded to the data type (what a torch op on bf16 tensors stores) */
static inline __attribute__((always_inline)) float rnd(float x, const int bf) { return bf ? bf2f(f2bf(x)) : x; }

/* Each kernel is a row function, inlined with bf a constant into one parallel loop per dtype (an OpenMP region
 * outlined from a shared body would take bf at run time and not vectorise). The count goes through a local: a macro
 * argument inside _Pragma's string is not substituted (it read a caller's `n`, so one request's attention ran on one
 * thread). nt is the callers' parameter of that name. */
#define PARALLEL_FOR(i, n, nt)                                                                                      \
    for (int64_t pf_count_ = (n), pf_once_ = 1; pf_once_; pf_once_ = 0)                                            \
    _Pragma("omp parallel for num_threads(nt) schedule(static) if (pf_count_ > 1)") for (int64_t i = 0; i < pf_count_; \
                                                                                          i++)

/* h = w * to_dtype(x * rsqrt(mean(x^2) + eps)) per row; with delta: x = x + delta first (rounded), written to x_out.
 * x, delta, h, x_out: [n, dim] rows at the given strides (elements); w: [dim]. */
static inline __attribute__((always_inline)) void rms_norm_row(const void *x, int64_t x_stride, const void *delta,
                                                               int64_t d_stride, const void *w, void *h, void *x_out,
                                                               int64_t r, int64_t dim, float eps, const int bf) {
    float *row = (float *)malloc(sizeof(float) * dim);
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) {
        float v = ld(x, r * x_stride + i, bf);
        if (delta) v = rnd(v + ld(delta, r * d_stride + i, bf), bf);
        row[i] = v;
        ss += v * v;
    }
    if (x_out)
        for (int64_t i = 0; i < dim; i++) st(x_out, r * dim + i, row[i], bf);
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++) st(h, r * dim + i, ld(w, i, bf) * rnd(row[i] * inv, bf), bf);
    free(row);
}

void rms_norm_f32(const void *x, int64_t xs, const void *d, int64_t ds, const void *w, void *h, void *xo, int64_t n,
                  int64_t dim, float eps, int nt) {
    PARALLEL_FOR(r, n, nt) rms_norm_row(x, xs, d, ds, w, h, xo, r, dim, eps, 0);
}

void rms_norm_bf16(const void *x, int64_t xs, const void *d, int64_t ds, const void *w, void *h, void *xo, int64_t n,
                   int64_t dim, float eps, int nt) {
    PARALLEL_FOR(r, n, nt) rms_norm_row(x, xs, d, ds, w, h, xo, r, dim, eps, 1);
}

/* Rotate-half RoPE in place over `heads` heads of head_dim d of row t (q and k side by side): with x1, x2 the halves,
 * (x1 * cos - x2 * sin, x2 * cos + x1 * sin) as torch computes x * cos + rotate_half(x) * sin. cos, sin: fp32
 * [n, d], the rows' positions' (Rotary.forward's). */
static inline __attribute__((always_inline)) void rotary_row(void *qk, int64_t stride, int64_t t, int64_t heads,
                                                             int64_t d, const float *cos_t, const float *sin_t,
                                                             const int bf) {
    const int64_t half = d / 2;
    const float *c = cos_t + t * d, *s = sin_t + t * d;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t base = t * stride + h * d;
        for (int64_t i = 0; i < half; i++) {
            float x1 = ld(qk, base + i, bf), x2 = ld(qk, base + half + i, bf);
            float a = x1 * c[i], b = -x2 * s[i];
            float e = x2 * c[half + i], f = x1 * s[half + i];
            st(qk, base + i, a + b, bf);
            st(qk, base + half + i, e + f, bf);
        }
    }
}

void rotary_f32(void *qk, int64_t stride, int64_t n, int64_t heads, int64_t d, const float *c, const float *s,
                int nt) {
    PARALLEL_FOR(t, n, nt) rotary_row(qk, stride, t, heads, d, c, s, 0);
}

void rotary_bf16(void *qk, int64_t stride, int64_t n, int64_t heads, int64_t d, const float *c, const float *s,
                 int nt) {
    PARALLEL_FOR(t, n, nt) rotary_row(qk, stride, t, heads, d, c, s, 1);
}

/* out = to_dtype(silu(gate)) * up, gate_up: [n, 2 * inter] (gate first), out: [n, inter] */
static inline __attribute__((always_inline)) void silu_mul_row(const void *gu, void *out, int64_t r, int64_t inter,
                                                               const int bf) {
    for (int64_t i = 0; i < inter; i++) {
        float g = ld(gu, r * 2 * inter + i, bf), u = ld(gu, r * 2 * inter + inter + i, bf);
        st(out, r * inter + i, rnd(g / (1.0f + exp_approx(-g)), bf) * u, bf);
    }
}

void silu_mul_f32(const void *gu, void *out, int64_t n, int64_t inter, int nt) {
    PARALLEL_FOR(r, n, nt) silu_mul_row(gu, out, r, inter, 0);
}

void silu_mul_bf16(const void *gu, void *out, int64_t n, int64_t inter, int nt) {
    PARALLEL_FOR(r, n, nt) silu_mul_row(gu, out, r, inter, 1);
}

/* Attention of request r's queries over kv head g (work item r * Hkv + g): its nq = qsl[r + 1] - qsl[r] queries are the
 * last nq of its seq_lens[r] positions (a decode step's one, or a verification's last token and drafts), each seeing
 * the keys up to its own position (causal), or every key of the request (not causal: a DSpark draft block); first its
 * own keys and values are written at their slots. q: [tokens, H, d] rows
 * at q_stride; k, v: [tokens, Hkv, d] at kv_stride; caches: [blocks, bs, Hkv, d]; slots: [tokens] flat cache slots
 * (-1: padding, not written); tables: [requests, mb] int32; out: [tokens, H * d]. Each key row is read once for all
 * the queries and the H / Hkv heads that share it (rows t = query * size + head); softmax in fp32 over each row's
 * keys (max first), the scores kept for the pass over the values. */
static inline __attribute__((always_inline)) void paged_attention_item(
    const void *q, int64_t q_stride, const void *k, const void *v, int64_t kv_stride, void *kc, void *vc,
    const int64_t *slots, const int32_t *qsl, const int32_t *tables, int64_t mb, const int32_t *seq_lens, void *out,
    int64_t item, int64_t H, int64_t Hkv, int64_t d, int64_t bs, float scale, int causal, const int bf) {
    const int64_t size = H / Hkv, r = item / Hkv, g = item % Hkv;
    const int64_t first_token = qsl[r], nq = qsl[r + 1] - qsl[r], rows = nq * size, len = seq_lens[r];
    const size_t es = bf ? 2 : 4;
    if (nq <= 0) return;
    for (int64_t j = 0; j < nq; j++) {
        const int64_t t = first_token + j;
        if (slots[t] < 0) continue;
        const int64_t dst = (slots[t] * Hkv + g) * d;
        memcpy((char *)kc + dst * es, (const char *)k + (t * kv_stride + g * d) * es, d * es);
        memcpy((char *)vc + dst * es, (const char *)v + (t * kv_stride + g * d) * es, d * es);
    }
    float *qf = (float *)malloc(sizeof(float) * (2 * rows * d + d + rows * (len > 0 ? len : 1)));
    float *acc = qf + rows * d, *key = acc + rows * d, *sc = key + d;
    for (int64_t j = 0; j < nq; j++)
        for (int64_t i = 0; i < size * d; i++) {
            qf[j * size * d + i] = ld(q, (first_token + j) * q_stride + g * size * d + i, bf) * scale;
            acc[j * size * d + i] = 0.0f;
        }
    const int32_t *table = tables + r * mb;
#ifdef __AVX512F__
    /* A head dim of up to 128 in 8 registers: each key row loaded once for every row, each row's values accumulated
     * in registers over all its keys (through memory, a chain of loads and stores per key). */
    const int wide = d % 16 == 0 && d <= 128;
#else
    const int wide = 0;
#endif
    for (int64_t b = 0, l = 0; l < len; b++) {
        const int64_t first = ((int64_t)table[b] * bs * Hkv + g) * d;
        for (int64_t o = 0; o < bs && l < len; o++, l++) {
            const int64_t row = first + o * Hkv * d;
            /* rows of queries before position l never read it: they start at query l - (len - nq) */
            const int64_t t0 = causal && l > len - nq ? (l - (len - nq)) * size : 0;
#ifdef __AVX512F__
            if (wide) {
                __m512 kv[8];
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    if (16 * j < d) kv[j] = load16(kc, row + 16 * j, bf);
                for (int64_t t = t0; t < rows; t++) {
                    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++)
                        if (16 * j < d) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + t * d + 16 * j), kv[j], a);
                    sc[t * len + l] = _mm512_reduce_add_ps(a);
                }
                continue;
            }
#endif
            const float *kr = as_f32(kc, row, d, key, bf); /* converted once for every row */
            for (int64_t t = t0; t < rows; t++) sc[t * len + l] = dot(qf + t * d, kr, d);
        }
    }
    for (int64_t t = 0; t < rows; t++) {
        const int64_t lim = causal ? len - nq + t / size + 1 : len; /* causal: up to the query's own position */
        float m = -INFINITY, sum = 0.0f;
        for (int64_t l = 0; l < lim; l++) m = sc[t * len + l] > m ? sc[t * len + l] : m;
        for (int64_t l = 0; l < lim; l++) {
            float e = exp_approx(sc[t * len + l] - m);
            sc[t * len + l] = e;
            sum += e;
        }
        const float inv = 1.0f / sum;
        for (int64_t l = 0; l < lim; l++) sc[t * len + l] *= inv;
    }
#ifdef __AVX512F__
    for (int64_t t = 0; t < rows && wide; t++) {
        const int64_t lim = causal ? len - nq + t / size + 1 : len;
        __m512 a[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
        const float *ps = sc + t * len;
        for (int64_t b = 0, l = 0; l < lim; b++) {
            const int64_t first = ((int64_t)table[b] * bs * Hkv + g) * d;
            for (int64_t o = 0; o < bs && l < lim; o++, l++) {
                const __m512 pv = _mm512_set1_ps(ps[l]);
                const int64_t row = first + o * Hkv * d;
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    if (16 * j < d) a[j] = _mm512_fmadd_ps(pv, load16(vc, row + 16 * j, bf), a[j]);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            if (16 * j < d) _mm512_storeu_ps(acc + t * d + 16 * j, a[j]);
    }
#endif
    for (int64_t b = 0, l = 0; l < len && !wide; b++) {
        const int64_t first = ((int64_t)table[b] * bs * Hkv + g) * d;
        for (int64_t o = 0; o < bs && l < len; o++, l++) {
            const int64_t row = first + o * Hkv * d;
            const float *vr = as_f32(vc, row, d, key, bf);
            const int64_t t0 = causal && l > len - nq ? (l - (len - nq)) * size : 0;
            for (int64_t t = t0; t < rows; t++) {
                const float p = sc[t * len + l];
#pragma omp simd
                for (int64_t i = 0; i < d; i++) acc[t * d + i] += p * vr[i];
            }
        }
    }
    for (int64_t j = 0; j < nq; j++)
        for (int64_t i = 0; i < size * d; i++)
            st(out, (first_token + j) * H * d + g * size * d + i, acc[j * size * d + i], bf);
    free(qf);
}

#define PAGED_ATTENTION(SUFFIX, BF)                                                                                  \
    void paged_attention_##SUFFIX(const void *q, int64_t qs, const void *k, const void *v, int64_t kvs, void *kc,   \
                                  void *vc, const int64_t *slots, const int32_t *qsl, const int32_t *tables,        \
                                  int64_t mb, const int32_t *lens, void *out, int64_t n, int64_t H, int64_t Hkv,    \
                                  int64_t d, int64_t bs, float scale, int causal, int nt) {                         \
        PARALLEL_FOR(item, n * Hkv, nt)                                                                             \
        paged_attention_item(q, qs, k, v, kvs, kc, vc, slots, qsl, tables, mb, lens, out, item, H, Hkv, d, bs,    \
                             scale, causal, BF);                                                                    \
    }
PAGED_ATTENTION(f32, 0)
PAGED_ATTENTION(bf16, 1)

/* The index of row r's largest value (the first of equal ones, as torch.argmax; a NaN counts as the largest): the
 * maximum and whether a NaN is there in one vectorised pass, then the first index holding it. */
static inline __attribute__((always_inline)) void argmax_row(const void *x, int64_t stride, int64_t r, int64_t m,
                                                             int64_t *out, const int bf) {
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < m; i++) {
        float v = ld(x, r * stride + i, bf);
        nan |= v != v;
        best = v > best ? v : best;
    }
    int64_t at = 0;
    for (int64_t i = 0; i < m; i++) {
        float v = ld(x, r * stride + i, bf);
        if (nan ? v != v : v == best) {
            at = i;
            break;
        }
    }
    out[r] = at;
}

void argmax_f32(const void *x, int64_t stride, int64_t n, int64_t m, int64_t *out, int nt) {
    PARALLEL_FOR(r, n, nt) argmax_row(x, stride, r, m, out, 0);
}

void argmax_bf16(const void *x, int64_t stride, int64_t n, int64_t m, int64_t *out, int nt) {
    PARALLEL_FOR(r, n, nt) argmax_row(x, stride, r, m, out, 1);
}

/* Causal attention of one request's prompt chunk in bf16 (prefill), over the paged cache: the chunk's n queries are
 * positions prefix..prefix+n-1 (their keys already written), query p sees keys 0..p. Flash attention on AVX512-BF16's
 * pair dot products (vdpbf16ps: fp32 accumulators, two bf16 products an instruction), which torch's CPU flash kernel
 * does not use: it reached ~120 GFLOP/s here against ~370 for a bf16 GEMM, and made 57% of an 8,000-token prefill.
 *
 * First every key and value of the call is packed once, per kv head and tile of PF_BK keys, into the layouts the pair
 * products read: keys as [d/2][PF_BK] words (a word: a key's dims 2j, 2j+1), values as [PF_BK/2][d] words (a word: one
 * dim of keys 2p, 2p+1). Then each work item (a kv head and PF_BQ query positions, with the H / Hkv heads sharing
 * it: rows m = position * size + head) walks its key tiles in order, PF_RM rows at a time: scores in registers, an
 * online softmax in fp32 (max, rescale, sum), the probabilities rounded to bf16 (as torch's flash kernel rounds them
 * for its second GEMM), and the output accumulated in fp32. */
#ifdef __AVX512BF16__
#define PF_BK 64
#define PF_BQ 32
#define PF_RM 4

int prefill_attention_available(void) { return 1; }

/* e^x for 16 lanes, exp_approx's polynomial; the caller zeroes masked lanes */
static inline __attribute__((always_inline)) __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* rows m0..m0+rb-1 of an item against key tile t: scores, online softmax, and their share of the output O */
static inline __attribute__((always_inline)) void prefill_rows(const uint32_t *const *qw, const int64_t *lim,
                                                               const uint32_t *kp, const uint32_t *vp, float *O,
                                                               float *mx, float *l, int64_t rb, int64_t t, int64_t d,
                                                               float scale) {
    __m512 s[PF_RM][4];
#pragma GCC unroll 4
    for (int r = 0; r < PF_RM; r++)
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < d / 2; j++) {
        __m512i kv[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) kv[c] = _mm512_loadu_si512(kp + j * PF_BK + 16 * c);
#pragma GCC unroll 4
        for (int r = 0; r < PF_RM; r++) {
            const __m512i b = _mm512_set1_epi32((int)qw[r][j]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) s[r][c] = dp(s[r][c], kv[c], b);
        }
    }
    uint32_t pw[PF_RM][PF_BK / 2];
    float alpha[PF_RM];
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#pragma GCC unroll 4
    for (int r = 0; r < PF_RM; r++) {
        __mmask16 keep[4];
        __m512 tmax = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i key = _mm512_add_epi32(iota, _mm512_set1_epi32((int)(t * PF_BK + 16 * c)));
            keep[c] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32((int)lim[r]));
            s[r][c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep[c], s[r][c], _mm512_set1_ps(scale));
            tmax = _mm512_max_ps(tmax, s[r][c]);
        }
        const float tm = _mm512_reduce_max_ps(tmax);
        /* a NaN score (NaN or inf in q or k) makes the row NaN, as in torch: max_ps drops NaN by lane order */
        __mmask16 nan = 0;
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) nan |= _mm512_mask_cmp_ps_mask(keep[c], s[r][c], s[r][c], _CMP_UNORD_Q);
        const float m_new = nan ? NAN : (tm > mx[r] ? tm : mx[r]);
        alpha[r] = nan ? NAN : (mx[r] == -INFINITY ? 0.0f : expf(mx[r] - m_new));
        mx[r] = m_new;
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            s[r][c] = _mm512_maskz_mov_ps(keep[c], exp512(_mm512_sub_ps(s[r][c], _mm512_set1_ps(m_new))));
            sum = _mm512_add_ps(sum, s[r][c]);
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
        _mm512_storeu_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(s[r][1], s[r][0]));
        _mm512_storeu_si512(pw[r] + 16, (__m512i)_mm512_cvtne2ps_pbh(s[r][3], s[r][2]));
    }
    for (int64_t cc = 0; cc < d; cc += 64) {
        __m512 o[PF_RM][4];
#pragma GCC unroll 4
        for (int r = 0; r < PF_RM; r++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                o[r][v] = _mm512_mul_ps(_mm512_loadu_ps(O + r * d + cc + 16 * v), _mm512_set1_ps(alpha[r]));
        for (int p = 0; p < PF_BK / 2; p++) {
            __m512i vv[4];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) vv[v] = _mm512_loadu_si512(vp + p * d + cc + 16 * v);
#pragma GCC unroll 4
            for (int r = 0; r < PF_RM; r++) {
                const __m512i b = _mm512_set1_epi32((int)pw[r][p]);
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) o[r][v] = dp(o[r][v], vv[v], b);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < PF_RM; r++)
            if (r < rb)
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) _mm512_storeu_ps(O + r * d + cc + 16 * v, o[r][v]);
    }
}

/* q: [n, H, d] bf16 rows at q_stride; caches [blocks, bs, Hkv, d] bf16; table: the request's blocks; out: [n, H, d].
 * d: a multiple of 64. Returns 0, or -1 if out of memory (nothing written). */
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                           const int32_t *table, int64_t n, int64_t prefix, int64_t H, int64_t Hkv, int64_t d,
                           int64_t bs, float scale, uint16_t *out, int nt) {
    const int64_t L = prefix + n, ntiles = (L + PF_BK - 1) / PF_BK, size = H / Hkv;
    const int64_t tile_words = PF_BK * d / 2, nqb = (n + PF_BQ - 1) / PF_BQ;
    uint32_t *Kp = (uint32_t *)malloc(sizeof(uint32_t) * Hkv * ntiles * tile_words * 2);
    if (!Kp) return -1;
    uint32_t *Vp = Kp + Hkv * ntiles * tile_words;
    PARALLEL_FOR(item, Hkv * ntiles, nt) {
        const int64_t g = item / ntiles, t = item % ntiles;
        uint32_t *kp = Kp + item * tile_words;
        uint16_t *vp = (uint16_t *)(Vp + item * tile_words);
        for (int64_t c = 0; c < PF_BK; c++) {
            const int64_t key = t * PF_BK + c;
            if (key >= L) {
                for (int64_t j = 0; j < d / 2; j++) kp[j * PF_BK + c] = 0;
                for (int64_t i = 0; i < d; i++) vp[((c / 2) * d + i) * 2 + (c & 1)] = 0;
                continue;
            }
            const int64_t row = (((int64_t)table[key / bs] * bs + key % bs) * Hkv + g) * d;
            const uint32_t *kw = (const uint32_t *)(kc + row);
            for (int64_t j = 0; j < d / 2; j++) kp[j * PF_BK + c] = kw[j];
            for (int64_t i = 0; i < d; i++) vp[((c / 2) * d + i) * 2 + (c & 1)] = vc[row + i];
        }
    }
    int failed = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic) if (nqb * Hkv > 1)
    for (int64_t item = 0; item < nqb * Hkv; item++) {
        /* the last query blocks first: they see the most keys */
        const int64_t qb = nqb - 1 - item / Hkv, g = item % Hkv;
        const int64_t p0 = qb * PF_BQ, np = n - p0 < PF_BQ ? n - p0 : PF_BQ, M = np * size;
        float *O = (float *)calloc(M * d + 2 * M, sizeof(float));
        const uint32_t **qw = (const uint32_t **)malloc(sizeof(uint32_t *) * M);
        int64_t *lim = (int64_t *)malloc(sizeof(int64_t) * M);
        if (!O || !qw || !lim) {
            failed = 1;
            free(O), free(qw), free(lim);
            continue;
        }
        float *mx = O + M * d, *l = mx + M;
        for (int64_t m = 0; m < M; m++) {
            qw[m] = (const uint32_t *)(q + (p0 + m / size) * q_stride + (g * size + m % size) * d);
            lim[m] = prefix + p0 + m / size;
            mx[m] = -INFINITY;
        }
        const int64_t last_tile = (prefix + p0 + np - 1) / PF_BK;
        for (int64_t t = 0; t <= last_tile; t++) {
            const uint32_t *kp = Kp + (g * ntiles + t) * tile_words, *vp = Vp + (g * ntiles + t) * tile_words;
            for (int64_t m0 = 0; m0 < M; m0 += PF_RM) {
                const int64_t rb = M - m0 < PF_RM ? M - m0 : PF_RM;
                if (rb == PF_RM) {
                    prefill_rows(qw + m0, lim + m0, kp, vp, O + m0 * d, mx + m0, l + m0, rb, t, d, scale);
                } else { /* the last rows: padded with copies of the last, whose results are dropped */
                    const uint32_t *qpad[PF_RM];
                    int64_t lpad[PF_RM];
                    float mpad[PF_RM], lsum[PF_RM], Opad[PF_RM * 256];
                    for (int r = 0; r < PF_RM; r++) {
                        const int64_t src = m0 + (r < rb ? r : rb - 1);
                        qpad[r] = qw[src], lpad[r] = lim[src], mpad[r] = mx[src], lsum[r] = l[src];
                        memcpy(Opad + r * d, O + src * d, sizeof(float) * d);
                    }
                    prefill_rows(qpad, lpad, kp, vp, Opad, mpad, lsum, rb, t, d, scale);
                    for (int r = 0; r < rb; r++) {
                        mx[m0 + r] = mpad[r], l[m0 + r] = lsum[r];
                        memcpy(O + (m0 + r) * d, Opad + r * d, sizeof(float) * d);
                    }
                }
            }
        }
        for (int64_t m = 0; m < M; m++) {
            const float inv = 1.0f / l[m];
            uint16_t *dst = out + ((p0 + m / size) * H + g * size + m % size) * d;
            for (int64_t i = 0; i < d; i++) dst[i] = f2bf(O[m * d + i] * inv);
        }
        free(O), free(qw), free(lim);
    }
    free(Kp);
    return failed ? -1 : 0;
}
#else
int prefill_attention_available(void) { return 0; }

int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                           const int32_t *table, int64_t n, int64_t prefix, int64_t H, int64_t Hkv, int64_t d,
                           int64_t bs, float scale, uint16_t *out, int nt) {
    return -1;
}
#endif

/* One row's greedy draft at one position with its Markov correction, over vocabulary v0..v1 (a thread's part): the
 * largest base[v] + to_dtype(e . W2[v]) and its index (the first of equal ones; a NaN counts as the largest, as
 * torch.argmax), in one pass over w2t ([rank, V], the correction's weight transposed at load) instead of a [V] GEMM
 * output, an add and an argmax. rank <= 256. */
#define MK_CHUNK 512
static inline __attribute__((always_inline)) void markov_argmax_range(const float *base, const void *w2t,
                                                                      const void *e, int64_t rank, int64_t V,
                                                                      int64_t v0, int64_t v1, float *best_out,
                                                                      int64_t *at_out, const int bf) {
    float ev[256], buf[MK_CHUNK];
    for (int64_t i = 0; i < rank; i++) ev[i] = ld(e, i, bf);
    float best = -INFINITY;
    int64_t at = v0 < v1 ? v0 : -1;
    for (int64_t v = v0; v < v1; v += MK_CHUNK) {
        const int64_t n = v1 - v < MK_CHUNK ? v1 - v : MK_CHUNK;
        for (int64_t j = 0; j < n; j++) buf[j] = 0.0f;
        for (int64_t i = 0; i < rank; i++) {
            const float a = ev[i];
#pragma omp simd
            for (int64_t j = 0; j < n; j++) buf[j] += a * ld(w2t, i * V + v + j, bf);
        }
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t j = 0; j < n; j++) {
            const float x = base[v + j] + rnd(buf[j], bf);
            buf[j] = x;
            nan |= x != x;
            m = x > m ? x : m;
        }
        if (nan || m > best) {
            for (int64_t j = 0; j < n; j++)
                if (nan ? buf[j] != buf[j] : buf[j] == m) {
                    at = v + j;
                    break;
                }
            best = nan ? NAN : m;
            if (nan) break;
        }
    }
    *best_out = best, *at_out = at;
}


/* A whole DSpark block's greedy drafts in one call: for each row r and position j, e = W1[prev] (read in place of an
 * embedding op), the token markov_argmax_range picks with the row's vocabulary split over threads, and with a
 * confidence head (cw != NULL: [hidden + rank], cb its bias) the logit to_dtype(cw . [h[r][j]; e] + cb), summed in
 * fp32; prev = the token, from the anchor on. At batch 1 the per-position torch ops (embedding, cat, the head's GEMV,
 * argmax, cat) took ~1.4 ms of a ~7 ms drafting pass on the 2-vCPU machine.
 * base: [R, k, V] fp32 contiguous; h: [R, k, hidden] contiguous; w1: [V, rank]; w2t: [rank, V]. */
#define MARKOV_BLOCK(SUFFIX, BF)                                                                                     \
    void markov_block_##SUFFIX(const float *base, const void *h, int64_t hidden, const void *w1, const void *w2t,    \
                               const void *cw, float cb, const int64_t *anchors, int64_t R, int64_t k, int64_t rank, \
                               int64_t V, int64_t *tokens, float *conf, int nt) {                                    \
        const int parts = nt < 1 ? 1 : (nt > 64 ? 64 : nt);                                                         \
        const int64_t es = rank * (BF ? 2 : 4);                                                                     \
        for (int64_t r = 0; r < R; r++) {                                                                           \
            int64_t prev = anchors[r];                                                                              \
            for (int64_t j = 0; j < k; j++) {                                                                       \
                const void *e = (const char *)w1 + prev * es;                                                       \
                if (cw) {                                                                                           \
                    const int64_t hr = (r * k + j) * hidden;                                                        \
                    float acc = 0.0f;                                                                               \
                    for (int64_t i = 0; i < hidden; i++) acc += ld(cw, i, BF) * ld(h, hr + i, BF);                  \
                    for (int64_t i = 0; i < rank; i++) acc += ld(cw, hidden + i, BF) * ld(e, i, BF);                \
                    conf[r * k + j] = rnd(acc + cb, BF);                                                            \
                }                                                                                                   \
                const float *row = base + (r * k + j) * V;                                                          \
                float best[64];                                                                                     \
                int64_t at[64];                                                                                     \
                _Pragma("omp parallel for num_threads(parts) schedule(static)") for (int p = 0; p < parts; p++)    \
                    markov_argmax_range(row, w2t, e, rank, V, V * p / parts, V * (p + 1) / parts, best + p, at + p, \
                                        BF);                                                                        \
                int64_t win = -1;                                                                                   \
                float top = -INFINITY;                                                                              \
                for (int p = 0; p < parts && top == top; p++)                                                       \
                    if (at[p] >= 0 && (win < 0 || best[p] != best[p] || best[p] > top)) top = best[p], win = at[p]; \
                prev = tokens[r * k + j] = win < 0 ? 0 : win;                                                       \
            }                                                                                                       \
        }                                                                                                           \
    }
MARKOV_BLOCK(f32, 0)
MARKOV_BLOCK(bf16, 1)

/* A few rows through a large bf16 weight: out[M][N] fp32 = x[M][K] . W[N][K]^T, for the DSpark drafter's logits (a
 * block's k <= 8 rows through the target's lm_head). oneDNN's kernel took ~2x its one-row time for 7 rows on the
 * default model's lm_head (57 MB): a pass over the weight per few rows. Here the weight is read once for all rows, at
 * memory speed: it is packed once as [N/16][K/2][16] words (a word: dims 2j, 2j+1 of one output's weight row), each
 * block of 16 outputs one stream of 64-byte loads, and each row's pair product takes its x word by broadcast. The
 * sums are fp32 pair products in order of j (no rounding to bf16). N % 16 == 0, K % 2 == 0. */
#ifdef __AVX512BF16__
int small_linear_available(void) { return 1; }

void small_linear_pack(const uint16_t *w, int64_t N, int64_t K, uint32_t *out, int nt) {
    const int64_t kh = K / 2;
    PARALLEL_FOR(nb, N / 16, nt) {
        for (int64_t j = 0; j < kh; j++)
            for (int64_t c = 0; c < 16; c++) {
                const uint16_t *row = w + (nb * 16 + c) * K;
                out[(nb * kh + j) * 16 + c] = (uint32_t)row[2 * j] | ((uint32_t)row[2 * j + 1] << 16);
            }
    }
}

static inline __attribute__((always_inline)) void small_linear_block(const uint32_t *wp, const uint32_t *const *xw,
                                                                     int64_t kh, float *out, int64_t ldo, const int M) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kh; j++) {
        const __m512i w = _mm512_loadu_si512(wp + j * 16);
#pragma GCC unroll 8
        for (int m = 0; m < M; m++) acc[m] = dp(acc[m], _mm512_set1_epi32((int)xw[m][j]), w);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; m++) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

#define SMALL_LINEAR_CASE(MM)                                                                                       \
    case MM:                                                                                                        \
        small_linear_block(wp, xw, kh, o, N, MM);                                                                   \
        break;

void small_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint32_t *packed, int64_t N, int64_t K,
                       float *out, int nt) {
    const int64_t kh = K / 2;
    const uint32_t *xw[8];
    for (int64_t m = 0; m < M && m < 8; m++) xw[m] = (const uint32_t *)(x + m * x_stride);
    PARALLEL_FOR(nb, N / 16, nt) {
        const uint32_t *wp = packed + nb * kh * 16;
        float *o = out + nb * 16;
        switch (M) {
            SMALL_LINEAR_CASE(1)
            SMALL_LINEAR_CASE(2)
            SMALL_LINEAR_CASE(3)
            SMALL_LINEAR_CASE(4)
            SMALL_LINEAR_CASE(5)
            SMALL_LINEAR_CASE(6)
            SMALL_LINEAR_CASE(7)
            SMALL_LINEAR_CASE(8)
        }
    }
}
#else
int small_linear_available(void) { return 0; }
void small_linear_pack(const uint16_t *w, int64_t N, int64_t K, uint32_t *out, int nt) {}
void small_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, const uint32_t *packed, int64_t N, int64_t K,
                       float *out, int nt) {}
#endif
