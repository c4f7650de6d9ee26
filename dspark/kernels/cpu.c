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
 * outlined from a shared body would take bf at run time and not vectorise). */
#define PARALLEL_FOR(i, n, nt) _Pragma("omp parallel for num_threads(nt) schedule(static) if (n > 1)") \
    for (int64_t i = 0; i < (n); i++)

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
 * the keys up to its own position; first its own keys and values are written at their slots. q: [tokens, H, d] rows
 * at q_stride; k, v: [tokens, Hkv, d] at kv_stride; caches: [blocks, bs, Hkv, d]; slots: [tokens] flat cache slots
 * (-1: padding, not written); tables: [requests, mb] int32; out: [tokens, H * d]. Each key row is read once for all
 * the queries and the H / Hkv heads that share it (rows t = query * size + head); softmax in fp32 over each row's
 * keys (max first), the scores kept for the pass over the values. */
static inline __attribute__((always_inline)) void paged_attention_item(
    const void *q, int64_t q_stride, const void *k, const void *v, int64_t kv_stride, void *kc, void *vc,
    const int64_t *slots, const int32_t *qsl, const int32_t *tables, int64_t mb, const int32_t *seq_lens, void *out,
    int64_t item, int64_t H, int64_t Hkv, int64_t d, int64_t bs, float scale, const int bf) {
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
            const int64_t t0 = l > len - nq ? (l - (len - nq)) * size : 0;
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
        const int64_t lim = len - nq + t / size + 1; /* causal: keys up to the query's own position */
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
        const int64_t lim = len - nq + t / size + 1;
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
            const int64_t t0 = l > len - nq ? (l - (len - nq)) * size : 0;
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
                                  int64_t d, int64_t bs, float scale, int nt) {                                     \
        PARALLEL_FOR(item, n * Hkv, nt)                                                                             \
        paged_attention_item(q, qs, k, v, kvs, kc, vc, slots, qsl, tables, mb, lens, out, item, H, Hkv, d, bs,    \
                             scale, BF);                                                                            \
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
