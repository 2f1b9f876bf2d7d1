/* CPU kernels of the decoding step (workers/model/cpu/kernels.py builds them for the host's CPU and
   loads them).

   attend_*: attention of a step's query rows, one after another (workers/model/cpu/attention.py). Row
   r is a decoding sequence's token or a prompt chunk's: its queries attend to positions 0..limits[r]
   of slot slots[r] (a limit below 0: the row's output is zeros). The queries of one key head's group
   share each key and value as it is read; scores, softmax and sums are float32 whatever the
   cache's dtype (float32, bfloat16, or float16: half a float32 cache's bytes, see from_f16). A
   prompt chunk's rows attend as blocks (below, "Blocks"). Returns 0; -1 for a group, head size or
   limit it does not take; -2 where memory for a block's work ran out.

   int8_*: a product with weights in 8-bit groups as GGUF's Q8_0 holds them (a code from -127 to 127
   per weight, a float16 scale per 32), the output layer's (workers/model/lmhead.py); int4_product: one
   with 4-bit groups as Q4_1 holds them (w = code * d + m, codes 0..15, d and m in float16), the
   layers' (workers/model/cpu/groups.py).
   The inputs are quantised to 8 bits per 32 (int8_quantize, as llama.cpp does), so that AVX512-VNNI
   (else AVX2's byte products) multiplies the codes as integers.

   rms_norm_f32: the RMS norm of float32 rows (the decoder's residual stream); rope_store_*: the
   rotation of a step's queries and keys and the writing of its keys and values into the cache;
   silu_mul_f32: the MLP's activation; top_k_f32: where a row's largest values are (the logits the
   decoder refines).

   layers_*: a step's layers in one call, each layer's parts through the functions above
   (workers/model/cpu/layerstep.py).

   One call at a time per model thread; attend_* hands the key heads of long decoding rows to a second
   thread where helper_configure turns it on (below, "The helper"). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
/* The products multiply codes as integers with AVX512-VNNI where the CPU has it, else with AVX2's
   byte products (maddubs: unsigned by signed bytes, pairs summed into 16 bits, as llama.cpp does on
   such CPUs), else in plain C (slower than torch's kernels: not used). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define PRODUCTS_VNNI 1
#define PRODUCTS_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PRODUCTS_VNNI 0
#define PRODUCTS_AVX2 1
#else
#define PRODUCTS_VNNI 0
#define PRODUCTS_AVX2 0
#endif
#define INT8_VECTORISED (PRODUCTS_VNNI || PRODUCTS_AVX2)

#define MAX_GROUP 16
#define BLOCK_ROWS 16 /* a prompt chunk's rows attending as one block, at most */
#define MAX_DIM 256

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFF + ((u >> 16) & 1); /* round to nearest even, as torch does (finite values) */
    return (uint16_t)(u >> 16);
}

static inline float from_f32(float f) { return f; }
static inline float to_f32(float f) { return f; }

/* float16, a float32 model's cache where F16C converts it (workers/model/build.py): half the bytes a
   long row reads, with 11 significant bits against bfloat16's 8 (llama.cpp's default cache). Values
   beyond float16's range are stored as its largest (an infinity would make a row's scores NaN). */
#define F16_MAX 65504.0f
#if defined(__F16C__)
#define F16_FAST 1
static inline float from_f16(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t to_f16(float f) {
    return (uint16_t)_cvtss_sh(fminf(fmaxf(f, -F16_MAX), F16_MAX), _MM_FROUND_TO_NEAREST_INT);
}
#elif defined(__FLT16_MAX__)
#if defined(__aarch64__)
#define F16_FAST 1
#else
#define F16_FAST 0
#endif
static inline float from_f16(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}
static inline uint16_t to_f16(float f) {
    _Float16 x = (_Float16)fminf(fmaxf(f, -F16_MAX), F16_MAX);
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
}
#else
#define F16_FAST 0
static inline float from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    float f = exponent == 0 ? ldexpf((float)mantissa, -24)
              : exponent == 31 ? (mantissa ? NAN : INFINITY) : ldexpf((float)(mantissa | 0x400), (int)exponent - 25);
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u |= sign;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t to_f16(float f) { /* round to nearest even through float's own rounding */
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    float a = fminf(fabsf(f), F16_MAX);
    if (isnan(f)) return 0x7E00;
    if (a < 6.103515625e-05f) return sign | (uint16_t)lrintf(a * 16777216.0f); /* subnormal: units of 2^-24 */
    int e;
    float m = frexpf(a, &e);                                    /* a = m 2^e, m in [0.5, 1) */
    uint32_t bits = (uint32_t)lrintf(ldexpf(m, 11));            /* 11 significant bits, may round to 2^11 */
    if (bits == 2048) bits = 1024, e++;
    return sign | (uint16_t)(((uint32_t)(e + 14) << 10) | (bits & 0x3FF));
}
#endif
int f16_fast(void) { return F16_FAST; }

/* A float16 row of n as float32: 8 at a time with F16C (gcc converts one element at a time). */
static inline __attribute__((always_inline)) void row_f16(float *row, const uint16_t *src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(row + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) row[i] = from_f16(src[i]);
}
#define ROW_EACH(row, src, n, LOAD) for (int64_t e_ = 0; e_ < (n); e_++) (row)[e_] = LOAD((src)[e_])
#define ROW_F16(row, src, n, LOAD) row_f16(row, src, n)

#if defined(__AVX512F__)
/* e^x of 16 x <= 0 at once: 2^n e^f, n the integer nearest x log2(e) and e^f (|f| <= ln(2) / 2) by its
   Taylor series to the 6th power (relative error about 1e-7, float32's own rounding): cheaper than
   glibc's vectorised expf, which made the exponentials a large part of a block's attention
   (docs/performance.md, "CPU kernels"). */
static inline __m512 exp16(__m512 x) {
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* e^(s[t] - top) in place; returns 1 / their sum. */
static float exponentiate(float *s, int64_t length, float top) {
    __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(top);
    for (int64_t t = 0; t < length; t += 16) {
        __mmask16 mask = (__mmask16)(length - t >= 16 ? 0xFFFF : (1u << (length - t)) - 1);
        __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), m)));
        _mm512_mask_storeu_ps(s + t, mask, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}
#else
static float exponentiate(float *s, int64_t length, float top) {
    float sum = 0.0f;
    for (int64_t t = 0; t < length; t++) {
        s[t] = expf(s[t] - top);
        sum += s[t];
    }
    return 1.0f / sum;
}
#endif

static void softmax(float *s, int64_t length) {
    float top = -INFINITY;
    for (int64_t t = 0; t < length; t++) top = fmaxf(top, s[t]);
    float inv = exponentiate(s, length, top);
    for (int64_t t = 0; t < length; t++) s[t] *= inv;
}

#define PREFETCH_AHEAD 32 /* keys fetched this many positions ahead of the one being read */

/* Every cache line of a row of `bytes` (a prefetch never faults: past a slot's end it reads nothing). */
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b);
}

/* Whether a head's keys and values (`bytes` of both) fit in half this core's L2 (sysconf; 0 where
   it does not say), so that values fetched while the keys are read are still there for the sums. */
static int values_early(int64_t bytes) {
    static int64_t l2 = -1; /* a race between threads writes the same value */
    if (l2 < 0) {
        long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = size > 0 ? size : 0;
    }
    return bytes <= l2 / 2;
}

/* One key head: its GRP queries against `length` keys and values (DIM apart). GRP and DIM constant
   let the compiler keep a row and the sums of every query in registers; the last variant takes both
   as variables. Each key and value is read once for all queries of the head. A long sequence's keys
   and values come from memory, which two streams at once read faster than one: while the keys are
   read, the keys PREFETCH_AHEAD positions on are fetched too, and so are the values of the same
   positions where keys and values fit in half the L2 together (values_early). Where they do not,
   values fetched early would be gone again by the sums pass and read from memory twice: there the
   values are fetched ahead in that pass instead (docs/performance.md, "CPU kernels"). */
#define DEFINE_HEAD(NAME, T, LOAD, STORE, ROW, DIM, DIMS, GRP, GRPS)                                 \
    /* unused where the AVX2 heads replace them */                                               \
    __attribute__((unused)) static void NAME(const T *q, const T *k, const T *v, int64_t length,   \
                                             int64_t group, int64_t d, float scale, float *scores, \
                                             int64_t stride, T *out) {                            \
        (void)d;                                                                                   \
        (void)group;                                                                               \
        float qf[GRPS][DIMS];                                                                      \
        for (int64_t g = 0; g < GRP; g++)                                                          \
            for (int64_t i = 0; i < DIM; i++) qf[g][i] = LOAD(q[g * DIM + i]) * scale;              \
        int early = values_early(2 * length * DIM * (int64_t)sizeof(T));                           \
        for (int64_t t = 0; t < length; t++) {                                                     \
            float row[DIMS];                                                                       \
            if (early) prefetch_row(v + t * DIM, DIM * (int64_t)sizeof(T));                         \
            prefetch_row(k + (t + PREFETCH_AHEAD) * DIM, DIM * (int64_t)sizeof(T));                 \
            ROW(row, k + t * DIM, DIM, LOAD);                                                      \
            for (int64_t g = 0; g < GRP; g++) {                                                    \
                float s = 0.0f;                                                                    \
                for (int64_t i = 0; i < DIM; i++) s += qf[g][i] * row[i];                          \
                scores[g * stride + t] = s;                                                        \
            }                                                                                      \
        }                                                                                          \
        for (int64_t g = 0; g < GRP; g++) softmax(scores + g * stride, length);                    \
        float acc[GRPS][DIMS];                                                                     \
        for (int64_t g = 0; g < GRP; g++)                                                          \
            for (int64_t i = 0; i < DIM; i++) acc[g][i] = 0.0f;                                    \
        for (int64_t t = 0; t < length; t++) {                                                     \
            float row[DIMS];                                                                       \
            if (!early) prefetch_row(v + (t + PREFETCH_AHEAD) * DIM, DIM * (int64_t)sizeof(T));     \
            ROW(row, v + t * DIM, DIM, LOAD);                                                      \
            for (int64_t g = 0; g < GRP; g++) {                                                    \
                float p = scores[g * stride + t];                                                  \
                for (int64_t i = 0; i < DIM; i++) acc[g][i] += p * row[i];                         \
            }                                                                                      \
        }                                                                                          \
        for (int64_t g = 0; g < GRP; g++)                                                          \
            for (int64_t i = 0; i < DIM; i++) out[g * DIM + i] = STORE(acc[g][i]);                 \
    }

#define DEFINE_HEADS(SUFFIX, T, LOAD, STORE, ROW, DIM)                                                \
    DEFINE_HEAD(head##DIM##_1_##SUFFIX, T, LOAD, STORE, ROW, DIM, DIM, 1, 1)                         \
    DEFINE_HEAD(head##DIM##_2_##SUFFIX, T, LOAD, STORE, ROW, DIM, DIM, 2, 2)                         \
    DEFINE_HEAD(head##DIM##_3_##SUFFIX, T, LOAD, STORE, ROW, DIM, DIM, 3, 3)                         \
    DEFINE_HEAD(head##DIM##_4_##SUFFIX, T, LOAD, STORE, ROW, DIM, DIM, 4, 4)                         \
    DEFINE_HEAD(head##DIM##_n_##SUFFIX, T, LOAD, STORE, ROW, DIM, DIM, group, MAX_GROUP)

/* Blocks: a prompt chunk's rows (consecutive rows of one slot), with AVX512. Their queries share each
   key and value as it is read, as the per-row heads do for one row's group, and the arithmetic is
   blocked for the vector units. Scores run against a tile of 16 keys transposed once for every query
   of the block (16 keys' element i in one vector): with AVX512-BF16, a bfloat16 cache's pairs of
   elements as they are (vdpbf16ps, exact products, float32 sums); else converted to float32 (FMA).
   The values are summed in float32 for up to six queries at a time, a bfloat16 cache's with the
   probabilities rounded to bfloat16 (two positions a vdpbf16ps, as torch's own CPU attention rounds
   them). Rows of a block attend to positions up to their own limits; the block runs to the longest.
   Faster than the per-row heads and than torch's attention (docs/performance.md, "CPU kernels"). */
#if defined(__AVX512F__)
#define BLOCKS 1
#define TILE 16
#define VALUE_QUERIES 6

/* r[j] lane i -> r[i] lane j (16 x 16 elements of 32 bits). */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], s[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* s[4i + k], lane L: column 4L + k of rows 4i..4i+3 */
        s[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        s[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        s[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        s[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) { /* the 128-bit lanes of s[k], s[4+k], s[8+k], s[12+k], transposed */
        __m512i x0 = _mm512_shuffle_i32x4(s[k], s[4 + k], 0x44), x1 = _mm512_shuffle_i32x4(s[k], s[4 + k], 0xEE);
        __m512i y0 = _mm512_shuffle_i32x4(s[8 + k], s[12 + k], 0x44);
        __m512i y1 = _mm512_shuffle_i32x4(s[8 + k], s[12 + k], 0xEE);
        r[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
        r[4 + k] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
        r[8 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
    }
}

static inline __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline __m512 load16_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

/* Keys 0..count-1 (count <= 16; the rest as zeros), d apart, each 16 of its elements at once (as
   float32, or 32 bfloat16 as pairs): out[i] lane j = key j's element (or pair) i. */
#define DEFINE_TILE(NAME, T, LOAD16, PER_VECTOR)                                                    \
    static void NAME(const T *k, int64_t count, int64_t d, __m512 *out) {                           \
        for (int64_t c = 0; c < d; c += PER_VECTOR) {                                               \
            __m512i r[TILE];                                                                        \
            for (int j = 0; j < TILE; j++)                                                          \
                r[j] = j < count ? _mm512_castps_si512(LOAD16(k + j * d + c)) : _mm512_setzero_si512(); \
            transpose16(r);                                                                         \
            for (int j = 0; j < TILE; j++) out[c / (PER_VECTOR / 16) + j] = _mm512_castsi512_ps(r[j]); \
        }                                                                                           \
    }
DEFINE_TILE(tile_f32, float, load16_f32, 16)

/* scores[q * stride + t0 + j] (j < count) = scale * (query q . key j) for queries qf [nq, d] float32. */
static void tile_scores_f32(const __m512 *kt, const float *qf, int64_t nq, int64_t d, float scale, float *scores,
                            int64_t stride, __mmask16 mask) {
    for (int64_t q = 0; q < nq; q++) {
        const float *x = qf + q * d;
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 4) {
            a0 = _mm512_fmadd_ps(kt[i], _mm512_set1_ps(x[i]), a0);
            a1 = _mm512_fmadd_ps(kt[i + 1], _mm512_set1_ps(x[i + 1]), a1);
            a2 = _mm512_fmadd_ps(kt[i + 2], _mm512_set1_ps(x[i + 2]), a2);
            a3 = _mm512_fmadd_ps(kt[i + 3], _mm512_set1_ps(x[i + 3]), a3);
        }
        __m512 sum = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + q * stride, mask, sum);
    }
}

#if defined(__AVX512BF16__)
static inline __m512 load32_bf16_pairs(const uint16_t *p) { return _mm512_loadu_ps((const float *)p); }
DEFINE_TILE(tile_bf16_pairs, uint16_t, load32_bf16_pairs, 32)

/* As tile_scores_f32, for queries in bfloat16 (pairs of elements as 32-bit words, d / 2 of them). */
static void tile_scores_bf16(const __m512 *kt, const uint32_t *q2, int64_t nq, int64_t d, float scale,
                             float *scores, int64_t stride, __mmask16 mask) {
    for (int64_t q = 0; q < nq; q++) {
        const uint32_t *x = q2 + q * (d / 2);
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        for (int64_t p = 0; p < d / 2; p += 2) {
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)kt[p], (__m512bh)_mm512_set1_epi32((int)x[p]));
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)kt[p + 1], (__m512bh)_mm512_set1_epi32((int)x[p + 1]));
        }
        _mm512_mask_storeu_ps(scores + q * stride, mask, _mm512_mul_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(scale)));
    }
}
#endif

/* NAME for up to VALUE_QUERIES queries, through NAME_n with the count a constant: with it a variable,
   gcc kept the sums on the stack. */
#define DEFINE_BY_COUNT(NAME, T)                                                                    \
    static void NAME(const T *v, int64_t d, int64_t c, const float *p, int64_t stride, int64_t nq,      \
                     int64_t length, float *out, int64_t out_stride) {                              \
        switch (nq < VALUE_QUERIES ? nq : VALUE_QUERIES) {                                          \
        case 1: NAME##_n(v, d, c, p, stride, 1, length, out, out_stride); break;                   \
        case 2: NAME##_n(v, d, c, p, stride, 2, length, out, out_stride); break;                   \
        case 3: NAME##_n(v, d, c, p, stride, 3, length, out, out_stride); break;                   \
        case 4: NAME##_n(v, d, c, p, stride, 4, length, out, out_stride); break;                   \
        case 5: NAME##_n(v, d, c, p, stride, 5, length, out, out_stride); break;                   \
        default: NAME##_n(v, d, c, p, stride, VALUE_QUERIES, length, out, out_stride); break;      \
        }                                                                                           \
    }

/* out[q][c] (64 elements from c) = sum over t < length of p[q * stride + t] * v[t * d + c], for up to
   VALUE_QUERIES queries: their sums stay in registers while each value is read once. */
#define DEFINE_VALUES(NAME, T, LOAD16)                                                              \
    static inline __attribute__((always_inline)) void NAME##_n(const T *v, int64_t d, int64_t c,      \
            const float *p, int64_t stride, const int nq, int64_t length, float *out, int64_t out_stride) { \
        __m512 acc[VALUE_QUERIES][4];                                                               \
        for (int q = 0; q < VALUE_QUERIES; q++)                                                     \
            for (int i = 0; i < 4; i++) acc[q][i] = _mm512_setzero_ps();                            \
        for (int64_t t = 0; t < length; t++) {                                                      \
            const T *row = v + t * d + c;                                                           \
            __m512 x0 = LOAD16(row), x1 = LOAD16(row + 16), x2 = LOAD16(row + 32), x3 = LOAD16(row + 48); \
            for (int q = 0; q < VALUE_QUERIES; q++) {                                               \
                if (q >= nq) break;                                                                 \
                __m512 w = _mm512_set1_ps(p[q * stride + t]);                                       \
                acc[q][0] = _mm512_fmadd_ps(w, x0, acc[q][0]);                                      \
                acc[q][1] = _mm512_fmadd_ps(w, x1, acc[q][1]);                                      \
                acc[q][2] = _mm512_fmadd_ps(w, x2, acc[q][2]);                                      \
                acc[q][3] = _mm512_fmadd_ps(w, x3, acc[q][3]);                                      \
            }                                                                                       \
        }                                                                                           \
        for (int q = 0; q < nq && q < VALUE_QUERIES; q++)                                           \
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + q * out_stride + c + 16 * i, acc[q][i]); \
    }                                                                                               \
    DEFINE_BY_COUNT(NAME, T)
DEFINE_VALUES(values_f32, float, load16_f32)
#if defined(__AVX512BF16__)
/* The probabilities of a row rounded to bfloat16 in place (the first half of its bytes), zero past
   length up to an even count, for values_bf16_pairs. */
static void probabilities_bf16(float *p, int64_t length) {
    uint16_t *h = (uint16_t *)p;
    int64_t t = 0;
    for (; t + 16 <= length; t += 16) _mm256_storeu_si256((__m256i *)(h + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + t)));
    for (; t < length; t++) h[t] = to_bf16(p[t]);
    if (length & 1) h[length] = 0;
}

/* As values_f32 for a bfloat16 cache, with the probabilities in bfloat16 (probabilities_bf16) and the values of two
   positions at once (vdpbf16ps: exact products, float32 sums), as torch's own CPU attention rounds
   them for its second product. A pair of rows interleaved (within 128-bit lanes) gives, per 32 of
   their elements, two vectors of 16 pairs: elements 8L..8L+3 and 8L+4..8L+7 of each lane L. */
static inline __attribute__((always_inline)) void values_bf16_pairs_n(const uint16_t *v, int64_t d, int64_t c,
        const float *probabilities, int64_t stride, const int nq, int64_t length, float *out, int64_t out_stride) {
    const uint32_t *p = (const uint32_t *)probabilities; /* p[q * stride + t / 2]: positions t and t + 1 */
    __m512 acc[VALUE_QUERIES][4];
    for (int q = 0; q < VALUE_QUERIES; q++)
        for (int i = 0; i < 4; i++) acc[q][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t += 2) {
        const uint16_t *a = v + t * d + c, *b = a + d;
        __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
        __m512i b0 = t + 1 < length ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
        __m512i b1 = t + 1 < length ? _mm512_loadu_si512(b + 32) : _mm512_setzero_si512();
        __m512bh x[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                         (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
        for (int q = 0; q < VALUE_QUERIES; q++) {
            if (q >= nq) break;
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)p[q * stride + t / 2]);
            for (int i = 0; i < 4; i++) acc[q][i] = _mm512_dpbf16_ps(acc[q][i], x[i], w);
        }
    }
    for (int q = 0; q < nq && q < VALUE_QUERIES; q++) {
        float lanes[64];
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(lanes + 16 * i, acc[q][i]);
        for (int i = 0; i < 4; i++) /* vector i: elements 32 * (i / 2) + 8L + 4 * (i % 2) + j, lane 4L + j */
            for (int lane = 0; lane < 16; lane++)
                out[q * out_stride + c + 32 * (i / 2) + 8 * (lane / 4) + 4 * (i % 2) + lane % 4] = lanes[16 * i + lane];
    }
}
DEFINE_BY_COUNT(values_bf16_pairs, uint16_t)
#endif
#else
#define BLOCKS 0
#endif

#if BLOCKS

static void softmax_to(float *s, int64_t length, int64_t width) {
    if (length > 0) softmax(s, length);
    for (int64_t t = length < 0 ? 0 : length; t < width; t++) s[t] = 0.0f;
}

/* One key head of a block of `rows` rows of one slot: row r's `group` queries at q + r * q_stride (d
   apart), its output at out + r * out_stride, lengths[r] keys (<= 0: zeros). work: 64-byte aligned,
   (TILE + 2 * rows * group) * d + rows * group * stride floats, stride >= the longest rounded up to TILE. */
#define DEFINE_BLOCK(SUFFIX, T, STORE, QUERY_T, PREP, TILE_FN, SCORES_FN, PROBABILITIES, VALUES_FN)                  \
    static void block_##SUFFIX(const T *q, int64_t q_stride, const T *k, const T *v, const int64_t *lengths, \
                               int64_t rows, int64_t group, int64_t d, float scale, int64_t stride,        \
                               float *work, T *out, int64_t out_stride) {                                  \
        int64_t nq = rows * group, longest = 0;                                                            \
        for (int64_t r = 0; r < rows; r++) longest = lengths[r] > longest ? lengths[r] : longest;          \
        __m512 *tile = (__m512 *)work;                                                                     \
        QUERY_T *queries = (QUERY_T *)(work + TILE * d);                                                   \
        float *sums = work + TILE * d + nq * d, *scores = sums + nq * d;                                   \
        for (int64_t r = 0; r < rows; r++)                                                                 \
            for (int64_t g = 0; g < group; g++) PREP(queries, (r * group + g), q + r * q_stride + g * d, d); \
        for (int64_t t0 = 0; t0 < longest; t0 += TILE) {                                                   \
            int64_t count = longest - t0 < TILE ? longest - t0 : TILE;                                     \
            TILE_FN(k + t0 * d, count, d, tile);                                                           \
            SCORES_FN(tile, queries, nq, d, scale, scores + t0, stride, (__mmask16)((1u << count) - 1));    \
        }                                                                                                  \
        for (int64_t i = 0; i < nq; i++) {                                                                 \
            softmax_to(scores + i * stride, lengths[i / group], longest);                                  \
            PROBABILITIES(scores + i * stride, longest);                                                   \
        }                                                                                                  \
        for (int64_t c = 0; c < d; c += 64)                                                                \
            for (int64_t i = 0; i < nq; i += VALUE_QUERIES)                                                \
                VALUES_FN(v, d, c, scores + i * stride, stride, nq - i, longest, sums + i * d, d);         \
        for (int64_t r = 0; r < rows; r++)                                                                 \
            for (int64_t j = 0; j < group * d; j++) out[r * out_stride + j] = STORE(sums[r * group * d + j]); \
    }

#define PREP_F32(queries, i, src, d) for (int64_t e = 0; e < (d); e++) (queries)[(i) * (d) + e] = from_f32((src)[e])
#define PREP_BF16_AS_F32(queries, i, src, d) for (int64_t e = 0; e < (d); e++) (queries)[(i) * (d) + e] = from_bf16((src)[e])
#define PREP_F16_AS_F32(queries, i, src, d) row_f16((queries) + (i) * (d), (src), (d))
#define KEEP_FLOAT32(p, length) (void)0
#define PREP_PAIRS(queries, i, src, d) memcpy((queries) + (i) * ((d) / 2), (src), (size_t)(d) * sizeof(uint16_t))

DEFINE_BLOCK(f32, float, to_f32, float, PREP_F32, tile_f32, tile_scores_f32, KEEP_FLOAT32, values_f32)
#if defined(__AVX512BF16__)
DEFINE_BLOCK(bf16, uint16_t, to_bf16, uint32_t, PREP_PAIRS, tile_bf16_pairs, tile_scores_bf16, probabilities_bf16, \
             values_bf16_pairs)
#else
DEFINE_VALUES(values_bf16, uint16_t, load16_bf16)
DEFINE_TILE(tile_bf16_as_f32, uint16_t, load16_bf16, 16)
DEFINE_BLOCK(bf16, uint16_t, to_bf16, float, PREP_BF16_AS_F32, tile_bf16_as_f32, tile_scores_f32, KEEP_FLOAT32, \
             values_bf16)
#endif
DEFINE_VALUES(values_f16, uint16_t, load16_f16)
DEFINE_TILE(tile_f16_as_f32, uint16_t, load16_f16, 16)
DEFINE_BLOCK(f16, uint16_t, to_f16, float, PREP_F16_AS_F32, tile_f16_as_f32, tile_scores_f32, KEEP_FLOAT32, values_f16)
#endif

/* How many rows from row r attend as one block (consecutive rows of one slot: a prompt chunk's), or 1
   where they attend one at a time. */
static int64_t block_rows(const int64_t *slots, int64_t r, int64_t rows, int64_t d) {
    int64_t m = 1;
    if (!BLOCKS || d % 64) return 1;
    while (r + m < rows && m < BLOCK_ROWS && slots[r + m] == slots[r]) m++;
    return m;
}

#if BLOCKS
/* Rows r..r+m-1 (one slot) as a block, every key head; -1 where memory for its work ran out. */
#define DEFINE_ATTEND_BLOCK(SUFFIX, T)                                                               \
    static int attend_block_##SUFFIX(const T *q, int64_t q_stride, const T *keys, const T *values,   \
                                     const int64_t *slots, const int64_t *limits, int64_t r, int64_t m, \
                                     int64_t kv, int64_t group, int64_t d, int64_t positions, float scale, \
                                     T *out) {                                                       \
        int64_t lengths[BLOCK_ROWS], longest = 0;                                                    \
        for (int64_t i = 0; i < m; i++) {                                                            \
            lengths[i] = limits[r + i] + 1;                                                          \
            longest = lengths[i] > longest ? lengths[i] : longest;                                   \
        }                                                                                            \
        int64_t stride = (longest + TILE - 1) / TILE * TILE, nq = m * group;                         \
        size_t floats = (size_t)((TILE + 2 * nq) * d + nq * stride);                                 \
        float *work = aligned_alloc(64, floats * sizeof(float));                                     \
        if (work == NULL) return -1;                                                                 \
        for (int64_t h = 0; h < kv; h++) {                                                           \
            int64_t at = (slots[r] * kv + h) * positions * d;                                        \
            block_##SUFFIX(q + r * q_stride + h * group * d, q_stride, keys + at, values + at, lengths, m, \
                           group, d, scale, stride, work, out + (r * kv + h) * group * d, kv * group * d); \
        }                                                                                            \
        free(work);                                                                                  \
        return 0;                                                                                    \
    }
DEFINE_ATTEND_BLOCK(f32, float)
DEFINE_ATTEND_BLOCK(bf16, uint16_t)
DEFINE_ATTEND_BLOCK(f16, uint16_t)
#define ATTEND_BLOCK(SUFFIX, ...) attend_block_##SUFFIX(__VA_ARGS__)
#else
#define ATTEND_BLOCK(SUFFIX, ...) 0 /* never: block_rows is 1 without AVX512 */
#endif

typedef void (*head_fn_u16)(const uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, int64_t,
                            float, float *, int64_t, uint16_t *); /* a bfloat16 or float16 cache */
typedef void (*head_fn_f32)(const float *, const float *, const float *, int64_t, int64_t, int64_t, float,
                            float *, int64_t, float *);

/* The helper: a second thread for long decoding rows (attend_*, once helper_configure turns it on).

   A decoding row reads every key and value of its sequence once a layer, a long one's from memory,
   which one core reads slowly enough that a long generation's last tokens came markedly slower than
   its first (docs/performance.md, "CPU kernels"). Where torch's threads leave a core, a step's long
   rows are split into items (a row's key head): the calling thread claims them from the front, the
   helper from the back. While the caller runs a layer's products, the helper reads the next layer's
   items it will likely take into its own L2, so that it computes them from its cache. An item's
   arithmetic is the same whoever runs it.

   Nothing waits for the helper but items it has claimed: asleep, late or gone (in a forked child),
   the caller does every item itself. One caller at a time (two models' threads: the second attends
   alone). Jobs come a layer apart: after one the helper naps through most of the last gap, then
   spins until the next (helper_next); after a step's last layer, or HELPER_SPIN_NS without a job,
   it sleeps on a futex. Before a step's last layer returns, the helper has stopped reading the
   cache, so that a cache freed after a step is never read. */
#if defined(__linux__)
#include <linux/futex.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#define HELPER 1
#else
#define HELPER 0
#endif
#define HELPER_ITEMS 1024 /* 64 rows of 16 key heads */
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() (void)0
#endif
#define HELPER_SPIN_NS 2000000

/* What a layer's attention reads and writes (attend_*'s arguments). */
typedef struct {
    int64_t q_stride, kv, group, d, positions, elem;
    const char *q, *keys, *values, *next_keys, *next_values; /* next_*: the next layer's cache, or NULL */
    char *out;
    float scale;
    head_fn_u16 head_u16; /* one of the two */
    head_fn_f32 head_f32;
} helper_layer;

typedef struct {
    helper_layer layer;
    int64_t count, min_length, rows_until; /* the items; rows long enough before rows_until are items */
    int64_t row[HELPER_ITEMS], head[HELPER_ITEMS], length[HELPER_ITEMS];
    int64_t at[HELPER_ITEMS]; /* elements from the cache's start to the item's keys */
} helper_job;

static struct {
    helper_job jobs[2];          /* job n in jobs[n % 2]: written while the helper may read the other */
    _Atomic uint64_t claims;     /* the job's number << 32 | items taken from the back << 16 | front */
    _Atomic int64_t done;        /* the job's items finished */
    _Atomic uint32_t posted;     /* the last job's number; the futex the helper sleeps on */
    _Atomic uint32_t holding;    /* the job the helper works on (0: none) */
    _Atomic int reading, sleeping, caller;
    _Atomic int64_t min_length;  /* rows at least this long become items; 0: off */
    int64_t ahead_bytes;         /* the next layer's items read ahead, at most (most of the L2) */
    pid_t pid;                   /* where the thread runs (0: none; -1: it could not start) */
} helper;

static volatile uint8_t helper_sink;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Claim item of job `number`, from the front or the back; -1 when none is left. */
static int64_t claim(uint32_t number, int64_t count, int front) {
    uint64_t c = atomic_load(&helper.claims);
    for (;;) {
        uint64_t f = c & 0xFFFF, b = (c >> 16) & 0xFFFF;
        if ((uint32_t)(c >> 32) != number || (int64_t)(f + b) >= count) return -1;
        if (atomic_compare_exchange_weak(&helper.claims, &c, c + (front ? 1 : (uint64_t)1 << 16)))
            return front ? (int64_t)f : count - 1 - (int64_t)b;
    }
}

static void run_item(const helper_job *j, int64_t i, float *scores) {
    const helper_layer *l = &j->layer;
    int64_t at = j->at[i] * l->elem, row = j->row[i], h = j->head[i];
    const char *q = l->q + (row * l->q_stride + h * l->group * l->d) * l->elem;
    char *out = l->out + (row * l->kv + h) * l->group * l->d * l->elem;
    if (l->head_u16)
        l->head_u16((const uint16_t *)q, (const uint16_t *)(l->keys + at), (const uint16_t *)(l->values + at),
                     j->length[i], l->group, l->d, l->scale, scores, l->positions, (uint16_t *)out);
    else
        l->head_f32((const float *)q, (const float *)(l->keys + at), (const float *)(l->values + at), j->length[i],
                    l->group, l->d, l->scale, scores, l->positions, (float *)out);
    atomic_fetch_add_explicit(&helper.done, 1, memory_order_release);
}

/* The next layer's items from the back, as many as fit in `ahead_bytes`: one byte a cache line, until
   job `number` is no longer the last one posted. The new position of each row (written by the next
   layer before it attends) is left alone. */
static void read_ahead(const helper_job *j, uint32_t number) {
    uint8_t sum = 0;
    int64_t left = helper.ahead_bytes;
    const helper_layer *l = &j->layer;
    for (int64_t i = j->count - 1; i >= 0 && left > 0; i--) {
        int64_t at = j->at[i] * l->elem, bytes = (j->length[i] - 1) * l->d * l->elem;
        for (int part = 0; part < 2; part++) {
            const char *p = (part ? l->next_values : l->next_keys) + at;
            for (int64_t b = 0; b < bytes; b += 64) {
                if (!(b & 4095) && atomic_load_explicit(&helper.posted, memory_order_relaxed) != number) {
                    helper_sink = sum;
                    return;
                }
                sum += *(const volatile uint8_t *)(p + b);
            }
        }
        left -= 2 * bytes;
    }
    helper_sink = sum;
}

#if HELPER
/* Asleep on the futex until a job after `seen` is posted, or until `deadline` (CLOCK_MONOTONIC ns; 0:
   none) with main waking it where a job comes first. */
static void helper_sleep(uint32_t seen, int64_t deadline) {
    atomic_store(&helper.sleeping, 1);
    if (atomic_load(&helper.posted) == seen) {
        struct timespec wait, *timeout = NULL;
        if (deadline) {
            int64_t left = deadline - now_ns();
            if (left <= 0) goto done;
            wait.tv_sec = left / 1000000000, wait.tv_nsec = left % 1000000000;
            timeout = &wait;
        }
        syscall(SYS_futex, &helper.posted, FUTEX_WAIT_PRIVATE, seen, timeout, NULL, 0);
    }
done:
    atomic_store(&helper.sleeping, 0);
}

/* The next job after `seen` (posted at `seen_at`, `period` after the one before). Jobs come a layer
   apart within a step: the helper naps through most of the gap the last one left, spins until the
   job comes, and sleeps once none has come for HELPER_SPIN_NS; after a step's last layer it sleeps
   at once (the next step's first layer is never read ahead). Spinning through every gap took the
   second core whole, from the API and Redis too. */
static uint32_t helper_next(uint32_t seen, int64_t seen_at, int64_t period, int last_layer) {
    uint32_t number;
    if (last_layer) {
        helper_sleep(seen, 0);
    } else if (period < HELPER_SPIN_NS) {
        helper_sleep(seen, seen_at + period * 3 / 4);
    }
    for (int spins = 0; (number = atomic_load(&helper.posted)) == seen; spins++) {
        cpu_relax();
        if ((spins & 255) == 255 && now_ns() - seen_at > HELPER_SPIN_NS) helper_sleep(seen, 0);
    }
    return number;
}

static void *helper_main(void *unused) {
    (void)unused;
    sigset_t every;
    sigfillset(&every); /* signals go to the process's own threads (Python's handlers) */
    pthread_sigmask(SIG_SETMASK, &every, NULL);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* naps end within a microsecond or so, not 50 */
    uint32_t seen = 0;
    float *scores = NULL;
    int last_layer = 1;
    int64_t room = 0, seen_at = now_ns(), period = HELPER_SPIN_NS;
    for (;;) {
        uint32_t number = helper_next(seen, seen_at, period, last_layer);
        int64_t at = now_ns();
        period = at - seen_at, seen_at = at;
        seen = number;
        atomic_store(&helper.holding, number);
        if (atomic_load(&helper.posted) != number) { /* a later job already: its slot may be written */
            atomic_store(&helper.holding, 0);
            continue;
        }
        helper_job *job = &helper.jobs[number % 2]; /* not written again while this thread holds it (helper_post) */
        if (job->layer.positions > room) { /* its scores: a row's every position for each query */
            free(scores);
            room = job->layer.positions;
            scores = aligned_alloc(64, (size_t)(MAX_GROUP * room) * sizeof(float));
            if (scores == NULL) room = 0;
        }
        for (int64_t i; room && (i = claim(number, job->count, 0)) >= 0;) run_item(job, i, scores);
        last_layer = job->layer.next_keys == NULL;
        if (!last_layer) {
            atomic_store(&helper.reading, 1);
            read_ahead(job, number);
            atomic_store(&helper.reading, 0);
        }
        atomic_store(&helper.holding, 0);
    }
    return NULL;
}

/* The thread, started in this process (a forked child starts its own); 0 where it could not be. */
static int helper_running(void) {
    pid_t pid = getpid();
    if (helper.pid == pid) return 1;
    atomic_store(&helper.holding, 0); /* in a child: the parent's helper is not here */
    atomic_store(&helper.reading, 0);
    atomic_store(&helper.sleeping, 0);
    long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    helper.ahead_bytes = l2 > 0 ? l2 * 3 / 4 : 1 << 20;
    pthread_t thread;
    pthread_attr_t attributes;
    pthread_attr_init(&attributes);
    pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
    int started = pthread_create(&thread, &attributes, helper_main, NULL) == 0;
    pthread_attr_destroy(&attributes);
    helper.pid = started ? pid : -1;
    if (!started) atomic_store(&helper.min_length, 0); /* attend alone from now on */
    return started;
}
#else
static int helper_running(void) {
    return 0;
}
#endif

/* Rows at least `min_length` long attend with the helper from now on (0: off); returns whether it
   can run here. */
int helper_configure(int64_t min_length) {
    atomic_store(&helper.min_length, min_length > 0 ? min_length : 0);
    return HELPER;
}

/* Post the long rows of a step's layer as a job's items; the job, or NULL where the caller attends
   alone (the helper off, another caller on it, no long row, or the helper still on a job two back). */
static helper_job *helper_post(const helper_layer *layer, const int64_t *slots, const int64_t *limits, int64_t rows) {
    int64_t min_length = atomic_load(&helper.min_length);
    if (!min_length || atomic_exchange(&helper.caller, 1)) return NULL;
    uint32_t number = atomic_load(&helper.posted) + 1;
    number += number == 0; /* 0 means none */
    uint32_t held = atomic_load(&helper.holding);
    if ((held != 0 && held != number - 1) || !helper_running()) {
        atomic_store(&helper.caller, 0);
        return NULL;
    }
    helper_job *job = &helper.jobs[number % 2];
    {
        job->count = 0;
        job->layer = *layer;
        job->min_length = min_length;
        int64_t r = 0;
        for (int64_t m; r < rows && job->count + layer->kv <= HELPER_ITEMS; r += m) {
            m = block_rows(slots, r, rows, layer->d);
            for (int64_t h = 0; m == 1 && limits[r] + 1 >= min_length && h < layer->kv; h++) {
                int64_t i = job->count++;
                job->row[i] = r, job->head[i] = h, job->length[i] = limits[r] + 1;
                job->at[i] = (slots[r] * layer->kv + h) * layer->positions * layer->d;
            }
        }
        job->rows_until = r;
    }
    if (job->count == 0) {
        atomic_store(&helper.caller, 0);
        return NULL;
    }
    atomic_store(&helper.done, 0);
    atomic_store(&helper.claims, (uint64_t)number << 32);
    atomic_store(&helper.posted, number);
#if HELPER
    if (atomic_load(&helper.sleeping)) syscall(SYS_futex, &helper.posted, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#endif
    return job;
}

/* Whether row r (of `length` keys) is an item of `job` (NULL: none is). */
static inline int posted_row(const helper_job *job, int64_t r, int64_t length) {
    return job != NULL && r < job->rows_until && length >= job->min_length;
}

/* Wait until the helper reads no cache ahead (a step's last layer, where the caller attended alone). */
static void helper_settle(void) {
    while (helper.pid == getpid() && atomic_load(&helper.reading)) cpu_relax();
}

/* The caller's part of a posted job: its items from the front, then the wait for the helper's; at a
   step's last layer, also for the helper to stop reading ahead. */
static void helper_finish(helper_job *job, float *scores) {
    uint32_t number = (uint32_t)(atomic_load(&helper.claims) >> 32);
    for (int64_t i; (i = claim(number, job->count, 1)) >= 0;) run_item(job, i, scores);
    while (atomic_load_explicit(&helper.done, memory_order_acquire) < job->count) cpu_relax();
    if (job->layer.next_keys == NULL)
        while (atomic_load(&helper.reading)) cpu_relax();
    atomic_store(&helper.caller, 0);
}

/* The heads on AVX2 without AVX512 (the per-row heads above leave their vectorising to gcc, which summed
   each score's products in one chain of dependent FMAs and then across the vector). Here the scores of 8
   keys are summed at once: two keys' products in 2 * G independent chains, then the 8 keys' sums of each
   query gathered into one vector (hadd). The values are summed 32 elements at a time (16 for a group of
   4), the sums of every query of the group in registers (AVX2 has 16; docs/performance.md, "CPU kernels").
   Same arithmetic order for every call, whichever thread runs it. */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
enum { AS_F32, AS_F16, AS_BF16 };
#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE __m256 load8_as(const char *base, int64_t i, const int kind) {
    if (kind == AS_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (kind == AS_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ALWAYS_INLINE void store8_as(char *base, int64_t i, __m256 x, const int kind) {
    if (kind == AS_F32) {
        _mm256_storeu_ps((float *)base + i, x);
    } else if (kind == AS_F16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    } else {
        float f[8];
        _mm256_storeu_ps(f, x);
        for (int j = 0; j < 8; j++) ((uint16_t *)base)[i + j] = to_bf16(f[j]);
    }
}

ALWAYS_INLINE float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* scores[g * stride + t + j] for keys t..t+7 (D apart) and the G queries qf (float32, scaled). */
ALWAYS_INLINE void key_tile8(const char *k, int64_t t, const float *qf, float *scores, int64_t stride, const int G,
                  const int D, const int kind) {
    __m256 pairs[4][4];
    for (int j = 0; j < 8; j += 2) {
        __m256 a[4], b[4];
        for (int g = 0; g < G; g++) a[g] = b[g] = _mm256_setzero_ps();
        for (int c = 0; c < D; c += 8) {
            __m256 x = load8_as(k, (t + j) * D + c, kind), y = load8_as(k, (t + j + 1) * D + c, kind);
            for (int g = 0; g < G; g++) {
                __m256 w = _mm256_load_ps(qf + g * D + c);
                a[g] = _mm256_fmadd_ps(x, w, a[g]);
                b[g] = _mm256_fmadd_ps(y, w, b[g]);
            }
        }
        for (int g = 0; g < G; g++) pairs[j / 2][g] = _mm256_hadd_ps(a[g], b[g]);
    }
    for (int g = 0; g < G; g++) {
        __m256 low = _mm256_hadd_ps(pairs[0][g], pairs[1][g]), high = _mm256_hadd_ps(pairs[2][g], pairs[3][g]);
        _mm256_storeu_ps(scores + g * stride + t, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                                                _mm256_permute2f128_ps(low, high, 0x31)));
    }
}

ALWAYS_INLINE void head8(const char *q, const char *k, const char *v, int64_t length, float scale, float *scores,
              int64_t stride, char *out, const int G, const int D, const int kind) {
    float qf[4 * 128] __attribute__((aligned(32)));
    const int64_t row_bytes = D * (kind == AS_F32 ? 4 : 2);
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D; c += 8)
            _mm256_store_ps(qf + g * D + c, _mm256_mul_ps(load8_as(q, g * D + c, kind), _mm256_set1_ps(scale)));
    int early = values_early(2 * length * row_bytes);
    int64_t t = 0;
    for (; t + 8 <= length; t += 8) {
        prefetch_row(k + (t + PREFETCH_AHEAD) * row_bytes, 8 * row_bytes);
        if (early) prefetch_row(v + t * row_bytes, 8 * row_bytes);
        key_tile8(k, t, qf, scores, stride, G, D, kind);
    }
    for (; t < length; t++) {
        __m256 a[4];
        for (int g = 0; g < G; g++) a[g] = _mm256_setzero_ps();
        for (int c = 0; c < D; c += 8) {
            __m256 x = load8_as(k, t * D + c, kind);
            for (int g = 0; g < G; g++) a[g] = _mm256_fmadd_ps(x, _mm256_load_ps(qf + g * D + c), a[g]);
        }
        for (int g = 0; g < G; g++) scores[g * stride + t] = hsum8(a[g]);
    }
    for (int g = 0; g < G; g++) softmax(scores + g * stride, length);
    const int width = G < 4 ? 32 : 16; /* elements summed per pass: their sums stay in registers */
    for (int c0 = 0; c0 < D; c0 += width) {
        __m256 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < width / 8; i++) acc[g][i] = _mm256_setzero_ps();
        for (t = 0; t < length; t++) {
            if (!early && c0 == 0) prefetch_row(v + (t + PREFETCH_AHEAD) * row_bytes, row_bytes);
            __m256 p[4];
            for (int g = 0; g < G; g++) p[g] = _mm256_broadcast_ss(scores + g * stride + t);
            for (int i = 0; i < width / 8; i++) {
                __m256 x = load8_as(v, t * D + c0 + 8 * i, kind);
                for (int g = 0; g < G; g++) acc[g][i] = _mm256_fmadd_ps(p[g], x, acc[g][i]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < width / 8; i++) store8_as(out, g * D + c0 + 8 * i, acc[g][i], kind);
    }
}

#define DEFINE_HEAD8(SUFFIX, T, KIND_ID, D, G)                                                          \
    static void head8_##D##_##G##_##SUFFIX(const T *q, const T *k, const T *v, int64_t length, int64_t group, \
                                           int64_t d, float scale, float *scores, int64_t stride, T *out) { \
        (void)group;                                                                                   \
        (void)d;                                                                                       \
        head8((const char *)q, (const char *)k, (const char *)v, length, scale, scores, stride, (char *)out, \
              G, D, KIND_ID);                                                                          \
    }
#define DEFINE_HEADS8(SUFFIX, T, KIND_ID)                                                               \
    DEFINE_HEAD8(SUFFIX, T, KIND_ID, 64, 1) DEFINE_HEAD8(SUFFIX, T, KIND_ID, 64, 2)                     \
    DEFINE_HEAD8(SUFFIX, T, KIND_ID, 64, 3) DEFINE_HEAD8(SUFFIX, T, KIND_ID, 64, 4)                     \
    DEFINE_HEAD8(SUFFIX, T, KIND_ID, 128, 1) DEFINE_HEAD8(SUFFIX, T, KIND_ID, 128, 2)                   \
    DEFINE_HEAD8(SUFFIX, T, KIND_ID, 128, 3) DEFINE_HEAD8(SUFFIX, T, KIND_ID, 128, 4)
#define BY64(SUFFIX) {head8_64_1_##SUFFIX, head8_64_2_##SUFFIX, head8_64_3_##SUFFIX, head8_64_4_##SUFFIX}
#define BY128(SUFFIX) {head8_128_1_##SUFFIX, head8_128_2_##SUFFIX, head8_128_3_##SUFFIX, head8_128_4_##SUFFIX}
#else
#define DEFINE_HEADS8(SUFFIX, T, KIND_ID)
#define BY64(SUFFIX) {head64_1_##SUFFIX, head64_2_##SUFFIX, head64_3_##SUFFIX, head64_4_##SUFFIX}
#define BY128(SUFFIX) {head128_1_##SUFFIX, head128_2_##SUFFIX, head128_3_##SUFFIX, head128_4_##SUFFIX}
#endif

/* The decoding heads of a bfloat16 cache with AVX512-BF16. The per-row heads above spend most of a
   long row's time on arithmetic: each score's products summed across a vector on its own, every key
   converted to float32 first. Here a key's pairs of bfloat16 elements are multiplied by the query's as
   they are (vdpbf16ps: exact products, float32 sums), then 16 keys' partial sums added in one tree
   (sums16); the values are summed in float32 with every query's sums in registers. Probabilities
   rounded to bfloat16 for the values (two positions a vdpbf16ps, as the chunk blocks take them) were
   faster still, but moved greedy answers further from the float32 model's
   (docs/performance.md, "CPU kernels"). Same arithmetic order for every call, whichever thread runs it. */
#define NO_DP_HEAD(SUFFIX, KIND) /* dp_head_SUFFIX: none of this cache's dtype here */                     \
    static head_fn_##KIND dp_head_##SUFFIX(int64_t group, int64_t d) {                                      \
        (void)group;                                                                                       \
        (void)d;                                                                                           \
        return NULL;                                                                                       \
    }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DP_INLINE static inline __attribute__((always_inline))

/* lane j = the sum of a[j]'s lanes */
DP_INLINE __m512 sums16(const __m512 a[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* 128 bits each: [2i, 2i + 1, 2i, 2i + 1] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* 128 bits each: [4i .. 4i + 3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* 128 bits each: 8i .. 8i + 3 (two halves of it), then 8i + 4 .. 8i + 7 */
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

/* A key's products with a query (D / 32 vectors of pairs), summed within a vector's lanes. */
DP_INLINE __m512 dp_key(const uint16_t *k, const __m512bh *q, const int D) {
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; c++) s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(k + 32 * c), q[c]);
    return s;
}

DP_INLINE void dp_head(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t length, float scale,
                       float *scores, int64_t stride, uint16_t *out, const int G, const int D) {
    __m512bh qv[4][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 32; c++) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
    const int64_t row_bytes = D * 2;
    int early = values_early(2 * length * row_bytes);
    int64_t t = 0;
    for (; t + 16 <= length; t += 16) {
        prefetch_row(k + (t + PREFETCH_AHEAD) * D, 16 * row_bytes);
        if (early) prefetch_row(v + t * D, 16 * row_bytes);
        for (int g = 0; g < G; g++) {
            __m512 a[16];
            for (int j = 0; j < 16; j++) a[j] = dp_key(k + (t + j) * D, qv[g], D);
            _mm512_storeu_ps(scores + g * stride + t, _mm512_mul_ps(sums16(a), _mm512_set1_ps(scale)));
        }
    }
    for (; t < length; t++)
        for (int g = 0; g < G; g++)
            scores[g * stride + t] = _mm512_reduce_add_ps(dp_key(k + t * D, qv[g], D)) * scale;
    for (int g = 0; g < G; g++) softmax(scores + g * stride, length);
    __m512 acc[4][8]; /* each query's sums in registers, 16 elements a vector */
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 16; c++) acc[g][c] = _mm512_setzero_ps();
    for (t = 0; t < length; t++) {
        if (!early) prefetch_row(v + (t + PREFETCH_AHEAD) * D, row_bytes);
        __m512 p[4];
        for (int g = 0; g < G; g++) p[g] = _mm512_set1_ps(scores[g * stride + t]);
        for (int c = 0; c < D / 16; c++) {
            __m512 x = load16_bf16(v + t * D + 16 * c);
            for (int g = 0; g < G; g++) acc[g][c] = _mm512_fmadd_ps(p[g], x, acc[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < D / 16; c++)
            _mm256_storeu_si256((__m256i *)(out + g * D + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[g][c]));
}

#define DEFINE_DP_HEAD(D, G)                                                                                \
    static void dp_head_##D##_##G(const uint16_t *q, const uint16_t *k, const uint16_t *v, int64_t length,   \
                                  int64_t group, int64_t d, float scale, float *scores, int64_t stride,     \
                                  uint16_t *out) {                                                         \
        (void)group;                                                                                       \
        (void)d;                                                                                           \
        dp_head(q, k, v, length, scale, scores, stride, out, G, D);                                        \
    }
DEFINE_DP_HEAD(64, 1) DEFINE_DP_HEAD(64, 2) DEFINE_DP_HEAD(64, 3) DEFINE_DP_HEAD(64, 4)
DEFINE_DP_HEAD(128, 1) DEFINE_DP_HEAD(128, 2) DEFINE_DP_HEAD(128, 3) DEFINE_DP_HEAD(128, 4)

/* A bfloat16 cache's head of this group and head size; NULL where the per-row heads take it. */
static head_fn_u16 dp_head_bf16(int64_t group, int64_t d) {
    static const head_fn_u16 by64[] = {dp_head_64_1, dp_head_64_2, dp_head_64_3, dp_head_64_4};
    static const head_fn_u16 by128[] = {dp_head_128_1, dp_head_128_2, dp_head_128_3, dp_head_128_4};
    if (group > 4) return NULL;
    return d == 64 ? by64[group - 1] : d == 128 ? by128[group - 1] : NULL;
}
#else
NO_DP_HEAD(bf16, u16)
#endif
NO_DP_HEAD(f16, u16)
NO_DP_HEAD(f32, f32)

#define DEFINE_ATTEND(SUFFIX, T, LOAD, STORE, ROW, KIND, KIND_ID)                                      \
    DEFINE_HEADS(SUFFIX, T, LOAD, STORE, ROW, 64)                                                    \
    DEFINE_HEADS(SUFFIX, T, LOAD, STORE, ROW, 128)                                                   \
    DEFINE_HEAD(head_any_##SUFFIX, T, LOAD, STORE, ROW, d, MAX_DIM, group, MAX_GROUP)                \
    DEFINE_HEADS8(SUFFIX, T, KIND_ID)                                                                \
    static head_fn_##KIND pick_##SUFFIX(int64_t group, int64_t d) {                                  \
        head_fn_##KIND dp = dp_head_##SUFFIX(group, d);                                              \
        if (dp != NULL) return dp;                                                                   \
        static const head_fn_##KIND by64[] = BY64(SUFFIX);                                           \
        static const head_fn_##KIND by128[] = BY128(SUFFIX);                                         \
        if (d == 64) return group <= 4 ? by64[group - 1] : head64_n_##SUFFIX;                        \
        if (d == 128) return group <= 4 ? by128[group - 1] : head128_n_##SUFFIX;                     \
        return head_any_##SUFFIX;                                                                    \
    }                                                                                                \
    int attend_##SUFFIX(const T *q, int64_t q_stride, const T *keys, const T *values,                \
                        const int64_t *slots, const int64_t *limits, int64_t rows, int64_t kv,       \
                        int64_t group, int64_t d, int64_t positions, float scale, float *scores,     \
                        T *out, const T *next_keys, const T *next_values) {                          \
        if (group < 1 || group > MAX_GROUP || d > MAX_DIM) return -1;                                \
        for (int64_t r = 0; r < rows; r++)                                                           \
            if (limits[r] + 1 > positions) return -1;                                                \
        head_fn_##KIND head = pick_##SUFFIX(group, d);                                               \
        helper_layer layer = {q_stride, kv, group, d, positions, (int64_t)sizeof(T), (const char *)q, \
                              (const char *)keys, (const char *)values, (const char *)next_keys,     \
                              (const char *)next_values, (char *)out, scale, NULL, NULL};            \
        layer.head_##KIND = head;                                                                    \
        helper_job *job = helper_post(&layer, slots, limits, rows);                                  \
        for (int64_t r = 0; r < rows;) {                                                             \
            int64_t m = block_rows(slots, r, rows, d);                                               \
            if (m > 1) {                                                                             \
                if (ATTEND_BLOCK(SUFFIX, q, q_stride, keys, values, slots, limits, r, m, kv, group, d, \
                                 positions, scale, out) != 0)                                        \
                    return -2;                                                                       \
                r += m;                                                                              \
                continue;                                                                            \
            }                                                                                        \
            int64_t length = limits[r] + 1;                                                          \
            for (int64_t h = 0; h < kv && !posted_row(job, r, length); h++) {                        \
                const T *qh = q + r * q_stride + h * group * d;                                      \
                T *o = out + (r * kv + h) * group * d;                                               \
                if (length <= 0) {                                                                   \
                    memset(o, 0, (size_t)(group * d) * sizeof(T));                                   \
                    continue;                                                                        \
                }                                                                                    \
                int64_t at = (slots[r] * kv + h) * positions * d;                                    \
                head(qh, keys + at, values + at, length, group, d, scale, scores, positions, o);     \
            }                                                                                        \
            r++;                                                                                     \
        }                                                                                            \
        if (job != NULL)                                                                             \
            helper_finish(job, scores);                                                              \
        else if (next_keys == NULL)                                                                  \
            helper_settle();                                                                         \
        return 0;                                                                                    \
    }

DEFINE_ATTEND(bf16, uint16_t, from_bf16, to_bf16, ROW_EACH, u16, AS_BF16)
DEFINE_ATTEND(f16, uint16_t, from_f16, to_f16, ROW_F16, u16, AS_F16)
DEFINE_ATTEND(f32, float, from_f32, to_f32, ROW_EACH, f32, AS_F32)

/* A step's queries, keys and values after their product (qkv [rows, (heads + 2 kv) * d] float32):
   queries and keys rotated as transformers does (x * cos + rotate_half(x) * sin at the row's
   position; `sin` holds rotate_half's negation: its first half negated), the queries into q [rows,
   heads, d], the keys and values into the cache [slot_count, kv, slot_positions, d] at the row's slot
   and position, all in the cache's dtype: the eleven operators of the rotation and the cache writes
   in one call, the rotation in float32 rounded once. Returns -1 for a position or slot outside the
   cache (nothing of that row or later is written). */
#define DEFINE_ROPE_STORE(SUFFIX, T, STORE)                                                            \
    int rope_store_##SUFFIX(const float *qkv, int64_t rows, int64_t heads, int64_t kv, int64_t d,       \
                            const float *cos, const float *sin, const int64_t *positions,                \
                            const int64_t *slots, int64_t slot_count, int64_t slot_positions, T *keys,   \
                            T *values, T *q) {                                                         \
        int64_t half = d / 2, width = (heads + 2 * kv) * d;                                            \
        for (int64_t r = 0; r < rows; r++) {                                                           \
            int64_t p = positions[r], s = slots[r];                                                    \
            if (p < 0 || p >= slot_positions || s < 0 || s >= slot_count) return -1;                  \
            const float *x = qkv + r * width, *c = cos + p * d, *sn = sin + p * d;                     \
            for (int64_t h = 0; h < heads + kv; h++) {                                                 \
                const float *xh = x + h * d;                                                           \
                T *o = h < heads ? q + (r * heads + h) * d : keys + ((s * kv + h - heads) * slot_positions + p) * d; \
                for (int64_t i = 0; i < half; i++) o[i] = STORE(xh[i] * c[i] + xh[i + half] * sn[i]);   \
                for (int64_t i = half; i < d; i++) o[i] = STORE(xh[i] * c[i] + xh[i - half] * sn[i]);   \
            }                                                                                          \
            for (int64_t h = 0; h < kv; h++) {                                                         \
                const float *xh = x + (heads + kv + h) * d;                                            \
                T *o = values + ((s * kv + h) * slot_positions + p) * d;                               \
                for (int64_t i = 0; i < d; i++) o[i] = STORE(xh[i]);                                   \
            }                                                                                          \
        }                                                                                              \
        return 0;                                                                                      \
    }
DEFINE_ROPE_STORE(bf16, uint16_t, to_bf16)
DEFINE_ROPE_STORE(f16, uint16_t, to_f16)
DEFINE_ROPE_STORE(f32, float, to_f32)

#define MAX_TOP 64

/* The k largest of a row of n into vals/idx (k slots, holding the row's first k on entry): each
   later element above the smallest kept replaces it. After the first few thousand of a row of
   logits, almost none is, so with AVX512 16 elements are compared at once. */
static void top_k_scan(const float *row, int64_t n, int64_t k, float *vals, int64_t *idx) {
    int64_t low = 0;
    for (int64_t j = 1; j < k; j++) low = vals[j] < vals[low] ? j : low;
    int64_t i = k;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), _mm512_set1_ps(vals[low]), _CMP_GT_OQ);
        while (above) {
            int lane = __builtin_ctz(above);
            above &= above - 1;
            if (row[i + lane] <= vals[low]) continue; /* the threshold rose within this block */
            vals[low] = row[i + lane];
            idx[low] = i + lane;
            for (int64_t j = 0; j < k; j++) low = vals[j] < vals[low] ? j : low;
        }
    }
#endif
    for (; i < n; i++) {
        if (!(row[i] > vals[low])) continue;
        vals[low] = row[i];
        idx[low] = i;
        for (int64_t j = 0; j < k; j++) low = vals[j] < vals[low] ? j : low;
    }
}

/* indices [rows, k]: where the k largest of each float32 row x [rows, n] are, in no order (of equal
   ones, any; a row with NaN: any k): one scan, far cheaper than torch's topk on one thread
   (docs/performance.md, "The output layer"). Returns -1 for a k it does not take (k < 1, k > n or
   k > MAX_TOP). */
int top_k_f32(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *indices) {
    if (k < 1 || k > n || k > MAX_TOP) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float vals[MAX_TOP];
        int64_t *idx = indices + r * k;
        for (int64_t j = 0; j < k; j++) {
            vals[j] = row[j];
            idx[j] = j;
        }
        top_k_scan(row, n, k, vals, idx);
    }
    return 0;
}

/* out [rows, n] = silu(gate) * up for float32 rows x [rows, 2 n] (gate: a row's first n, up: the
   rest), in float32: the MLP's activation of the fused product, which torch ran as a cast, a split
   and two operators (and the next product's cast back to float32). exp's argument is kept below
   its overflow, so a gate far below zero gives -0 times up, as torch gives. */
int silu_mul_f32(const float *x, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = gate[i] / (1.0f + expf(fminf(-gate[i], 88.0f))) * up[i];
    }
    return 0;
}

/* out [rows, n] = x * (1 / sqrt(mean(x^2) + eps)) * weight per row, all float32: torch's rms_norm of the
   float32 residual, which on a CPU ran as seven operators, twice a layer
   (docs/performance.md, "CPU kernels"). */
int rms_norm_f32(const float *x, int64_t rows, int64_t n, const float *weight, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t i = 0; i < n; i++) out[r * n + i] = xr[i] * inv * weight[i];
    }
    return 0;
}

#define GROUP 32

int int8_vectorised(void) { return INT8_VECTORISED; }

#if PRODUCTS_AVX2
/* The blocks: both products take their codes in blocks of PRODUCT_BLOCK weight rows rather than a row
   at a time (Python lays them out: workers/model/cpu/groups.py), so that one byte product multiplies a
   block's rows' codes at once, each row's sums in its own lanes, and each group is scaled once for the
   whole block, the results a vector of outputs. A row at a time, each row's group cost its own conversion,
   scaling and, at the end, a horizontal sum. In a block's group, step s holds 4 codes of each row (the
   4-bit ones two such sets, in the low and high nibbles): byte 4 r + t for row r, to multiply the 4
   inputs of the step broadcast to all lanes. Each row's scales (and minimums) are [blocks, groups,
   PRODUCT_BLOCK], in float16 as Q8_0 and Q4_1 hold them: fewer bytes a step than float32 scales. The
   last block of a weight whose rows are not a multiple of the block is padded with zeros. On AVX2,
   blocks of 8 rows (maddubs); on AVX512-VNNI, of 16 (vpdpbusd, its sums in 32 bits). The 8-bit
   products gain less than the 4-bit ones, their sums widened to 32 bits at every step
   (docs/performance.md, "Weights in 4-bit and 8-bit groups"). */
#define PRODUCT_BLOCK 8

/* A block's 8 results of one input row into out's `width` (up to 8) columns. */
static inline void store_block(float *out, __m256 sums, int64_t width) {
    if (width == PRODUCT_BLOCK) {
        _mm256_storeu_ps(out, sums);
        return;
    }
    float lanes[PRODUCT_BLOCK];
    _mm256_storeu_ps(lanes, sums);
    memcpy(out, lanes, (size_t)width * sizeof(float));
}

/* Broadcast the 4 inputs at x to every lane. */
static inline __m256i four_inputs(const int8_t *x) {
    int32_t word;
    memcpy(&word, x, sizeof(word));
    return _mm256_set1_epi32(word);
}
#elif PRODUCTS_VNNI
#define PRODUCT_BLOCK 16 /* the blocks (above), a row's 4 codes to each of a vector's 16 lanes */
/* The 4-bit codes fetched this many bytes ahead of those being read, their scales as many groups
   ahead: a step's layers are read from memory, beyond the caches. The 8-bit output layer gained
   nothing from it, so not there (docs/performance.md, "Weights in 4-bit and 8-bit groups"). */
#define CODES_AHEAD 1024

static inline void store_block(float *out, __m512 sums, int64_t width) {
    _mm512_mask_storeu_ps(out, (__mmask16)((1u << width) - 1), sums);
}

static inline __m512i four_inputs(const int8_t *x) {
    int32_t word;
    memcpy(&word, x, sizeof(word));
    return _mm512_set1_epi32(word);
}
#else
#define PRODUCT_BLOCK 0
#endif

/* Rows per block of both products' codes: 8 or 16 (the blocks above), or 0: a row at a time. */
int product_block(void) { return PRODUCT_BLOCK; }

/* x [rows, k] float32 -> xq [rows, k] int8 and, per group of 32, its scale dx and corr =
   128 * dx * sum(xq) (the products below take the codes as unsigned: code + 128). */
void int8_quantize(const float *x, int64_t rows, int64_t k, int8_t *xq, float *dx, float *corr) {
    int64_t groups = k / GROUP;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *xs = x + r * k + g * GROUP;
            float top = 0.0f;
            for (int i = 0; i < GROUP; i++) top = fmaxf(top, fabsf(xs[i]));
            float d = top / 127.0f;
            float inv = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            int8_t *q = xq + r * k + g * GROUP;
            for (int i = 0; i < GROUP; i++) {
                int32_t v = (int32_t)lrintf(xs[i] * inv);
                q[i] = (int8_t)v;
                sum += v;
            }
            dx[r * groups + g] = d;
            corr[r * groups + g] = 128.0f * d * (float)sum;
        }
    }
}

#if !PRODUCT_BLOCK
/* One weight row against one quantised input row: sum over groups of scale * dx * (codes . xq). */
static float int8_row(const int8_t *w, const uint16_t *s16, const int8_t *xr, const float *dr,
                      const float *cr, int64_t groups) {
    float total = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        int32_t sum = 0;
        float s = from_f16(s16[g]);
        for (int i = 0; i < GROUP; i++) sum += ((int32_t)w[g * GROUP + i] + 128) * (int32_t)xr[g * GROUP + i];
        total += s * dr[g] * (float)sum - s * cr[g];
    }
    return total;
}

#elif PRODUCTS_AVX2
/* A block of 8-bit codes (8 steps of 4 codes a row per group: byte 4 r + t of step s is row r's code
   4 s + t) against `count` (1 to 4) input rows (xr, dr: the first's; the next ones k bytes and groups
   scales further on), into its `width` columns of out (the next row's n floats further on). A Q8_0
   code goes in as its magnitude, the input taking its sign; a pair of products can reach 2 * 127 *
   127, so each step's sums widen to 32 bits at once. Inlined with a constant count, so that the sums
   stay in registers. */
static inline __attribute__((always_inline)) void int8_block_rows(const int8_t *w, const uint16_t *s, const int8_t *xr,
                                                                const float *dr, const float *cr, int64_t k,
                                                                int64_t groups, float *out, int64_t n,
                                                                int64_t width, const int count) {
    (void)cr;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        for (int step = 0; step < 8; step++) {
            __m256i codes = _mm256_loadu_si256((const __m256i *)(w + (g * 8 + step) * 32));
            __m256i magnitudes = _mm256_sign_epi8(codes, codes);
            for (int i = 0; i < count; i++) {
                __m256i inputs = _mm256_sign_epi8(four_inputs(xr + i * k + g * GROUP + step * 4), codes);
                sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, inputs), ones));
            }
        }
        __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + g * PRODUCT_BLOCK)));
        for (int i = 0; i < count; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[i]),
                                     _mm256_mul_ps(scales, _mm256_broadcast_ss(dr + i * groups + g)), acc[i]);
        }
    }
    for (int i = 0; i < count; i++) store_block(out + i * n, acc[i], width);
}

#else
/* As above with AVX512-VNNI: blocks of 16 rows, 8 steps of 64 bytes a group. vpdpbusd takes the codes
   unsigned (code + 128: the inputs' sums take the 128 back, corr) and adds each row's 4 products
   into its 32-bit lane. */
static inline __attribute__((always_inline)) void int8_block_rows(const int8_t *w, const uint16_t *s, const int8_t *xr,
                                                                const float *dr, const float *cr, int64_t k,
                                                                int64_t groups, float *out, int64_t n,
                                                                int64_t width, const int count) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                           _mm512_setzero_si512()};
        for (int step = 0; step < 8; step++) {
            __m512i codes = _mm512_xor_si512(_mm512_loadu_si512(w + (g * 8 + step) * 64), flip);
            for (int i = 0; i < count; i++)
                sums[i] = _mm512_dpbusd_epi32(sums[i], codes, four_inputs(xr + i * k + g * GROUP + step * 4));
        }
        __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + g * PRODUCT_BLOCK)));
        for (int i = 0; i < count; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]),
                                     _mm512_mul_ps(scales, _mm512_set1_ps(dr[i * groups + g])), acc[i]);
            acc[i] = _mm512_fnmadd_ps(scales, _mm512_set1_ps(cr[i * groups + g]), acc[i]);
        }
    }
    for (int i = 0; i < count; i++) store_block(out + i * n, acc[i], width);
}
#endif

#if PRODUCT_BLOCK
#define DEFINE_INT8_BLOCK_ROWS(COUNT)                                                                    \
    static void int8_block_rows##COUNT(const int8_t *w, const uint16_t *s, const int8_t *xr, const float *dr, \
                                       const float *cr, int64_t k, int64_t groups, float *out, int64_t n,  \
                                       int64_t width) {                                                    \
        int8_block_rows(w, s, xr, dr, cr, k, groups, out, n, width, COUNT);                                \
    }
DEFINE_INT8_BLOCK_ROWS(1)
DEFINE_INT8_BLOCK_ROWS(2)
DEFINE_INT8_BLOCK_ROWS(3)
DEFINE_INT8_BLOCK_ROWS(4)
#endif

/* out [rows, n] float32 = x . w for codes [n, k] int8 and scales [n, k / 32] float16 (as Q8_0 holds
   them), or in blocks (above); x quantised by int8_quantize (xq, dx, corr). */
void int8_product(const int8_t *xq, const float *dx, const float *corr, int64_t rows, const int8_t *codes,
                  const uint16_t *scales, int64_t n, int64_t k, float *out) {
    int64_t groups = k / GROUP;
#if PRODUCT_BLOCK
    static void (*const by_count[4])(const int8_t *, const uint16_t *, const int8_t *, const float *, const float *,
                                     int64_t, int64_t, float *, int64_t, int64_t) = {
        int8_block_rows1, int8_block_rows2, int8_block_rows3, int8_block_rows4};
    for (int64_t b = 0; b * PRODUCT_BLOCK < n; b++) {
        int64_t width = n - b * PRODUCT_BLOCK < PRODUCT_BLOCK ? n - b * PRODUCT_BLOCK : PRODUCT_BLOCK;
        for (int64_t r = 0; r < rows; r += 4) { /* the block's codes stay in L1 for all the rows */
            int64_t count = rows - r < 4 ? rows - r : 4;
            by_count[count - 1](codes + b * groups * PRODUCT_BLOCK * GROUP, scales + b * groups * PRODUCT_BLOCK,
                                xq + r * k, dx + r * groups, corr + r * groups, k, groups,
                                out + r * n + b * PRODUCT_BLOCK, n, width);
        }
    }
#else
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < rows; r++) {
            out[r * n + j] = int8_row(codes + j * k, scales + j * groups, xq + r * k, dx + r * groups,
                                      corr + r * groups, groups);
        }
    }
#endif
}

#if !PRODUCT_BLOCK
/* One weight row of 4-bit groups, packed two groups to 32 bytes (byte j: code j of the first group in
   the low nibble, of the second in the high one; a last odd group alone in 16 bytes, byte j: codes j
   and j + 16), against one quantised input row. The minimums take the inputs' sums (corr / 128). */
static float int4_row(const uint8_t *w, const uint16_t *d16, const uint16_t *m16, const int8_t *xr,
                      const float *dr, const float *cr, int64_t groups) {
    float total = 0.0f, d[2], m[2];
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *b = w + g * 16;
        const int8_t *x = xr + g * GROUP;
        for (int i = 0; i < 2 && g + i < groups; i++) d[i] = from_f16(d16[g + i]), m[i] = from_f16(m16[g + i]);
        total += m[0] * cr[g] / 128.0f;
        int32_t sum = 0;
        if (g + 1 < groups) { /* a pair */
            for (int j = 0; j < GROUP; j++) sum += (int32_t)(b[j] & 0x0F) * (int32_t)x[j];
            int32_t next = 0;
            for (int j = 0; j < GROUP; j++) next += (int32_t)(b[j] >> 4) * (int32_t)x[GROUP + j];
            total += d[0] * dr[g] * (float)sum + m[1] * cr[g + 1] / 128.0f + d[1] * dr[g + 1] * (float)next;
            g++;
            continue;
        }
        for (int j = 0; j < 16; j++) sum += (int32_t)(b[j] & 0x0F) * (int32_t)x[j] + (int32_t)(b[j] >> 4) * (int32_t)x[16 + j];
        total += d[0] * dr[g] * (float)sum;
    }
    return total;
}

#elif PRODUCTS_AVX2
/* A block of 4-bit codes (4 steps of 8 codes a row per group: byte 4 r + t of step s holds row r's
   code 8 s + t in its low nibble, 8 s + 4 + t in its high one) against `count` (1 to 4) input rows, as
   int8_block_rows. A group's 8 byte products add in 16 bits (16 products of at most 15 * 127 each);
   the minimums take the inputs' sums (corr / 128). */
static inline __attribute__((always_inline)) void int4_block_rows(const uint8_t *w, const uint16_t *d, const uint16_t *m,
                                                                const int8_t *xr, const float *dr, const float *cr,
                                                                int64_t k, int64_t groups, float *out, int64_t n,
                                                                int64_t width, const int count) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256 eighth = _mm256_set1_ps(1.0f / 128.0f);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                           _mm256_setzero_si256()};
        for (int s = 0; s < 4; s++) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(w + (g * 4 + s) * 32));
            __m256i low = _mm256_and_si256(packed, nibble), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
            for (int i = 0; i < count; i++) {
                const int8_t *x = xr + i * k + g * GROUP + s * 8;
                __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(low, four_inputs(x)),
                                                _mm256_maddubs_epi16(high, four_inputs(x + 4)));
                sums[i] = _mm256_add_epi16(sums[i], both);
            }
        }
        __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + g * PRODUCT_BLOCK)));
        __m256 minimums =
            _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + g * PRODUCT_BLOCK))), eighth);
        for (int i = 0; i < count; i++) {
            __m256 exact = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[i], ones));
            acc[i] = _mm256_fmadd_ps(exact, _mm256_mul_ps(scales, _mm256_broadcast_ss(dr + i * groups + g)), acc[i]);
            acc[i] = _mm256_fmadd_ps(minimums, _mm256_broadcast_ss(cr + i * groups + g), acc[i]);
        }
    }
    for (int i = 0; i < count; i++) store_block(out + i * n, acc[i], width);
}

#else
/* As above with AVX512-VNNI: blocks of 16 rows, 4 steps of 64 bytes a group, each row's sums in 32 bits. */
static inline __attribute__((always_inline)) void int4_block_rows(const uint8_t *w, const uint16_t *d, const uint16_t *m,
                                                                const int8_t *xr, const float *dr, const float *cr,
                                                                int64_t k, int64_t groups, float *out, int64_t n,
                                                                int64_t width, const int count) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512 eighth = _mm512_set1_ps(1.0f / 128.0f);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        __m512i sums[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                           _mm512_setzero_si512()};
        for (int s = 0; s < 4; s++) {
            _mm_prefetch((const char *)(w + (g * 4 + s) * 64 + CODES_AHEAD), _MM_HINT_T0);
            __m512i packed = _mm512_loadu_si512(w + (g * 4 + s) * 64);
            __m512i low = _mm512_and_si512(packed, nibble), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
            for (int i = 0; i < count; i++) {
                const int8_t *x = xr + i * k + g * GROUP + s * 8;
                sums[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sums[i], low, four_inputs(x)), high, four_inputs(x + 4));
            }
        }
        _mm_prefetch((const char *)(d + g * PRODUCT_BLOCK) + CODES_AHEAD / 4, _MM_HINT_T0);
        _mm_prefetch((const char *)(m + g * PRODUCT_BLOCK) + CODES_AHEAD / 4, _MM_HINT_T0);
        __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + g * PRODUCT_BLOCK)));
        __m512 minimums =
            _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + g * PRODUCT_BLOCK))), eighth);
        for (int i = 0; i < count; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[i]), _mm512_mul_ps(scales, _mm512_set1_ps(dr[i * groups + g])),
                                     acc[i]);
            acc[i] = _mm512_fmadd_ps(minimums, _mm512_set1_ps(cr[i * groups + g]), acc[i]);
        }
    }
    for (int i = 0; i < count; i++) store_block(out + i * n, acc[i], width);
}
#endif

#if PRODUCT_BLOCK
#define DEFINE_INT4_BLOCK_ROWS(COUNT)                                                                    \
    static void int4_block_rows##COUNT(const uint8_t *w, const uint16_t *d, const uint16_t *m, const int8_t *xr, \
                                       const float *dr, const float *cr, int64_t k, int64_t groups,        \
                                       float *out, int64_t n, int64_t width) {                             \
        int4_block_rows(w, d, m, xr, dr, cr, k, groups, out, n, width, COUNT);                             \
    }
DEFINE_INT4_BLOCK_ROWS(1)
DEFINE_INT4_BLOCK_ROWS(2)
DEFINE_INT4_BLOCK_ROWS(3)
DEFINE_INT4_BLOCK_ROWS(4)
#endif

/* out [rows, n] float32 = x . w for 4-bit groups: codes [n, 16 * groups] packed as int4_row takes
   them, d and m [n, groups] float16 (as Q4_1 holds them), or in blocks (above); x quantised by
   int8_quantize. */
void int4_product(const int8_t *xq, const float *dx, const float *corr, int64_t rows, const uint8_t *codes,
                  const uint16_t *d, const uint16_t *m, int64_t n, int64_t k, float *out) {
    int64_t groups = k / GROUP;
#if PRODUCT_BLOCK
    static void (*const by_count[4])(const uint8_t *, const uint16_t *, const uint16_t *, const int8_t *, const float *,
                                     const float *, int64_t, int64_t, float *, int64_t, int64_t) = {
        int4_block_rows1, int4_block_rows2, int4_block_rows3, int4_block_rows4};
    for (int64_t b = 0; b * PRODUCT_BLOCK < n; b++) {
        int64_t width = n - b * PRODUCT_BLOCK < PRODUCT_BLOCK ? n - b * PRODUCT_BLOCK : PRODUCT_BLOCK;
        const uint8_t *w = codes + b * groups * PRODUCT_BLOCK * GROUP / 2;
        const uint16_t *db = d + b * groups * PRODUCT_BLOCK, *mb = m + b * groups * PRODUCT_BLOCK;
        for (int64_t r = 0; r < rows; r += 4) { /* the block's codes stay in L1 for all the rows */
            int64_t count = rows - r < 4 ? rows - r : 4;
            by_count[count - 1](w, db, mb, xq + r * k, dx + r * groups, corr + r * groups, k, groups,
                                out + r * n + b * PRODUCT_BLOCK, n, width);
        }
    }
#else
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < rows; r++) {
            out[r * n + j] = int4_row(codes + j * groups * 16, d + j * groups, m + j * groups, xq + r * k,
                                      dx + r * groups, corr + r * groups, groups);
        }
    }
#endif
}

/* x [rows, k] float32 quantised here, then the product: one call per product (the calls' own cost
   mattered: four products a layer). Returns -1 where memory for the quantised inputs ran out. */
int int8_matmul(const float *x, int64_t rows, int64_t k, const int8_t *codes, const uint16_t *scales, int64_t n,
                float *out) {
    int64_t groups = k / GROUP;
    int8_t *xq = malloc((size_t)(rows * k) + 2 * sizeof(float) * (size_t)(rows * groups) + 64);
    if (xq == NULL) return -1;
    float *dx = (float *)(((uintptr_t)(xq + rows * k) + 63) & ~(uintptr_t)63), *corr = dx + rows * groups;
    int8_quantize(x, rows, k, xq, dx, corr);
    int8_product(xq, dx, corr, rows, codes, scales, n, k, out);
    free(xq);
    return 0;
}

int int4_matmul(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                int64_t n, float *out) {
    int64_t groups = k / GROUP;
    int8_t *xq = malloc((size_t)(rows * k) + 2 * sizeof(float) * (size_t)(rows * groups) + 64);
    if (xq == NULL) return -1;
    float *dx = (float *)(((uintptr_t)(xq + rows * k) + 63) & ~(uintptr_t)63), *corr = dx + rows * groups;
    int8_quantize(x, rows, k, xq, dx, corr);
    int4_product(xq, dx, corr, rows, codes, d, m, n, k, out);
    free(xq);
    return 0;
}

/* A step's layers in one call (workers/model/cpu/layerstep.py), where each layer's four products run
   on 4-bit groups here or on a GGUF file's blocks (blocks.c), its norms, rotation, cache writes,
   attention and activation here: the same functions in the same order as the Python layer loop calls
   them one at a time (workers/model/layers.py), so the same results bit for bit, without the Python
   between them (about 160 calls a layer: docs/performance.md, "CPU kernels"). x [rows, hidden] float32
   (the embeddings; the last layer's output on return). A layer's table holds its pointers: the norms'
   weights, then each product's codes, scales and minimums (int4_matmul's), then its keys and values,
   then, for products on blocks, blocks.c's blocks_matmul (its address: this library does not link
   that one) and each product's table of parts. Row r is written at positions[r] of slots[r] and
   attends to 0..limits[r] of attend_slots[r] (attend_*). Returns 0; -1 for a position, slot or limit
   outside the cache, -2 where memory ran out. */
typedef int (*parts_product)(const float *x, int64_t rows, int64_t k, const void *parts, int64_t nparts,
                             float *out);

typedef struct {
    const float *input_norm, *post_norm;
    const uint8_t *codes[4]; /* qkv, o, gate_up, down */
    const uint16_t *scales[4], *minimums[4]; /* float16 */
    void *keys, *values;
    parts_product on_parts; /* NULL: the products on the 4-bit groups above; else on parts[i] */
    const void *parts[4];
    int64_t nparts[4];
} layer_table; /* filled by workers/model/cpu/layerstep.py, which names each field's offset */

typedef struct {
    int64_t hidden, heads, kv, d, intermediate, slot_count, slot_positions;
} layer_shape;

/* Scratch of a step's layers (float32): the normed rows, the residual after attention, a product's
   output, the fused product, the attention's output, the gate and up product, the activation. */
typedef struct {
    float *normed, *h, *y, *qkv, *attended, *gate_up, *activated;
} layer_work;

static float *layer_work_of(layer_work *w, int64_t rows, const layer_shape *s) {
    int64_t n = rows * s->hidden, width = (s->heads + 2 * s->kv) * s->d;
    float *all = malloc(sizeof(float) * (size_t)(3 * n + rows * (width + s->heads * s->d + 3 * s->intermediate)));
    if (all == NULL) return NULL;
    w->normed = all, w->h = all + n, w->y = all + 2 * n, w->qkv = all + 3 * n, w->attended = w->qkv + rows * width;
    w->gate_up = w->attended + rows * s->heads * s->d, w->activated = w->gate_up + 2 * rows * s->intermediate;
    return all;
}

/* Product i of layer l (qkv, o, gate_up, down) of `rows` rows of k inputs into n outputs. */
static int layer_product(const layer_table *l, int i, const float *x, int64_t rows, int64_t k, int64_t n, float *out) {
    if (l->on_parts != NULL) return l->on_parts(x, rows, k, l->parts[i], l->nparts[i], out);
    return int4_matmul(x, rows, k, l->codes[i], l->scales[i], l->minimums[i], n, out);
}

/* The layer after its attention (w->attended, float32): x + o(attended), then that plus the MLP of its
   norm, into x (as Layer.finish). */
static int layer_finish(const layer_table *l, float *x, int64_t rows, const layer_shape *s, float eps, layer_work *w) {
    int64_t n = rows * s->hidden;
    if (layer_product(l, 1, w->attended, rows, s->heads * s->d, s->hidden, w->y) != 0) return -2;
    for (int64_t j = 0; j < n; j++) w->h[j] = x[j] + w->y[j];
    rms_norm_f32(w->h, rows, s->hidden, l->post_norm, eps, w->normed);
    if (layer_product(l, 2, w->normed, rows, s->hidden, 2 * s->intermediate, w->gate_up) != 0) return -2;
    silu_mul_f32(w->gate_up, rows, s->intermediate, w->activated);
    if (layer_product(l, 3, w->activated, rows, s->intermediate, s->hidden, w->y) != 0) return -2;
    for (int64_t j = 0; j < n; j++) x[j] = w->h[j] + w->y[j];
    return 0;
}

/* The norm, the fused product, the rotation with the cache writes, the attention (its output in the
   cache's dtype, as the Python loop has it, then float32: exactly), then layer_finish; each layer's
   attention lets the helper read the next layer's keys and values ahead. */
#define DEFINE_LAYERS(SUFFIX, T, LOAD)                                                                       \
    int layers_##SUFFIX(float *x, int64_t rows, const layer_table *layers, int64_t count, const layer_shape *s, \
                        float eps, float scale, const float *cos, const float *sin, const int64_t *positions,    \
                        const int64_t *slots, const int64_t *attend_slots, const int64_t *limits,              \
                        float *scores) {                                                                     \
        int64_t width = (s->heads + 2 * s->kv) * s->d, qd = s->heads * s->d;                                 \
        layer_work w;                                                                                        \
        float *all = layer_work_of(&w, rows, s);                                                             \
        T *q = malloc(sizeof(T) * (size_t)(2 * rows * qd)), *attended = q == NULL ? NULL : q + rows * qd;    \
        int status = all == NULL || q == NULL ? -2 : 0;                                                      \
        for (int64_t i = 0; i < count && status == 0; i++) {                                                 \
            const layer_table *l = layers + i, *next = i + 1 < count ? layers + i + 1 : NULL;                \
            rms_norm_f32(x, rows, s->hidden, l->input_norm, eps, w.normed);                                  \
            if (layer_product(l, 0, w.normed, rows, s->hidden, width, w.qkv) != 0) {                         \
                status = -2;                                                                                 \
                break;                                                                                       \
            }                                                                                                \
            status = rope_store_##SUFFIX(w.qkv, rows, s->heads, s->kv, s->d, cos, sin, positions, slots,     \
                                         s->slot_count, s->slot_positions, l->keys, l->values, q);           \
            if (status == 0)                                                                                 \
                status = attend_##SUFFIX(q, qd, l->keys, l->values, attend_slots, limits, rows, s->kv,       \
                                         s->heads / s->kv, s->d, s->slot_positions, scale, scores, attended, \
                                         next == NULL ? NULL : next->keys, next == NULL ? NULL : next->values); \
            if (status != 0) break;                                                                          \
            for (int64_t j = 0; j < rows * qd; j++) w.attended[j] = LOAD(attended[j]);                      \
            status = layer_finish(l, x, rows, s, eps, &w);                                                   \
        }                                                                                                    \
        free(all);                                                                                           \
        free(q);                                                                                             \
        return status;                                                                                       \
    }
DEFINE_LAYERS(bf16, uint16_t, from_bf16)
DEFINE_LAYERS(f16, uint16_t, from_f16)
DEFINE_LAYERS(f32, float, from_f32)
