/* CPU kernels of the decoding step (workers/kernels.py builds them for the host's CPU and loads them).

   attend_*: attention of a step's query rows, one after another (workers/attention.py). Row r is a
   decoding sequence's token or a prompt chunk's: its queries attend to positions 0..limits[r] of
   slot slots[r] (a limit below 0: the row's output is zeros). The queries of one key head's group
   share each key and value as it is read; scores, softmax and sums are float32 whatever the
   cache's dtype.

   int8_*: a product with weights in 8-bit groups as GGUF's Q8_0 holds them (a code from -127 to 127
   per weight, a scale per 32), the output layer's (workers/decoder.py); int4_product: one with
   4-bit groups as Q4_1 holds them (w = code * d + m, codes 0..15), the layers' (workers/weights.py).
   The inputs are quantised to 8 bits per 32 (int8_quantize, as llama.cpp does), so that AVX512-VNNI
   multiplies the codes as integers.

   Single-threaded: one call at a time per model thread. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define INT8_VECTORISED 1
#else
#define INT8_VECTORISED 0
#endif

#define MAX_GROUP 16
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

static void softmax(float *s, int64_t length) {
    float top = -INFINITY;
    for (int64_t t = 0; t < length; t++) top = fmaxf(top, s[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < length; t++) {
        s[t] = expf(s[t] - top);
        sum += s[t];
    }
    float inv = 1.0f / sum;
    for (int64_t t = 0; t < length; t++) s[t] *= inv;
}

/* One key head: its GRP queries against `length` keys and values (DIM apart). GRP and DIM constant
   let the compiler keep a row and the sums of every query in registers (a third faster than with
   the group a variable); the last variant takes both as variables. Each key and value is read once
   for all queries of the head. */
#define DEFINE_HEAD(NAME, T, LOAD, STORE, DIM, DIMS, GRP, GRPS)                                      \
    static void NAME(const T *q, const T *k, const T *v, int64_t length, int64_t group, int64_t d, \
                     float scale, float *scores, int64_t stride, T *out) {                         \
        (void)d;                                                                                   \
        (void)group;                                                                               \
        float qf[GRPS][DIMS];                                                                      \
        for (int64_t g = 0; g < GRP; g++)                                                          \
            for (int64_t i = 0; i < DIM; i++) qf[g][i] = LOAD(q[g * DIM + i]) * scale;              \
        for (int64_t t = 0; t < length; t++) {                                                     \
            float row[DIMS];                                                                       \
            for (int64_t i = 0; i < DIM; i++) row[i] = LOAD(k[t * DIM + i]);                        \
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
            for (int64_t i = 0; i < DIM; i++) row[i] = LOAD(v[t * DIM + i]);                        \
            for (int64_t g = 0; g < GRP; g++) {                                                    \
                float p = scores[g * stride + t];                                                  \
                for (int64_t i = 0; i < DIM; i++) acc[g][i] += p * row[i];                         \
            }                                                                                      \
        }                                                                                          \
        for (int64_t g = 0; g < GRP; g++)                                                          \
            for (int64_t i = 0; i < DIM; i++) out[g * DIM + i] = STORE(acc[g][i]);                 \
    }

#define DEFINE_HEADS(SUFFIX, T, LOAD, STORE, DIM)                                                     \
    DEFINE_HEAD(head##DIM##_1_##SUFFIX, T, LOAD, STORE, DIM, DIM, 1, 1)                              \
    DEFINE_HEAD(head##DIM##_2_##SUFFIX, T, LOAD, STORE, DIM, DIM, 2, 2)                              \
    DEFINE_HEAD(head##DIM##_3_##SUFFIX, T, LOAD, STORE, DIM, DIM, 3, 3)                              \
    DEFINE_HEAD(head##DIM##_4_##SUFFIX, T, LOAD, STORE, DIM, DIM, 4, 4)                              \
    DEFINE_HEAD(head##DIM##_n_##SUFFIX, T, LOAD, STORE, DIM, DIM, group, MAX_GROUP)

typedef void (*head_fn_bf16)(const uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, int64_t,
                             float, float *, int64_t, uint16_t *);
typedef void (*head_fn_f32)(const float *, const float *, const float *, int64_t, int64_t, int64_t, float,
                            float *, int64_t, float *);

#define DEFINE_ATTEND(SUFFIX, T, LOAD, STORE)                                                          \
    DEFINE_HEADS(SUFFIX, T, LOAD, STORE, 64)                                                         \
    DEFINE_HEADS(SUFFIX, T, LOAD, STORE, 128)                                                        \
    DEFINE_HEAD(head_any_##SUFFIX, T, LOAD, STORE, d, MAX_DIM, group, MAX_GROUP)                     \
    static head_fn_##SUFFIX pick_##SUFFIX(int64_t group, int64_t d) {                                \
        static const head_fn_##SUFFIX by64[] = {head64_1_##SUFFIX, head64_2_##SUFFIX, head64_3_##SUFFIX, \
                                                head64_4_##SUFFIX};                                  \
        static const head_fn_##SUFFIX by128[] = {head128_1_##SUFFIX, head128_2_##SUFFIX,               \
                                                 head128_3_##SUFFIX, head128_4_##SUFFIX};            \
        if (d == 64) return group <= 4 ? by64[group - 1] : head64_n_##SUFFIX;                        \
        if (d == 128) return group <= 4 ? by128[group - 1] : head128_n_##SUFFIX;                     \
        return head_any_##SUFFIX;                                                                    \
    }                                                                                                \
    int attend_##SUFFIX(const T *q, int64_t q_stride, const T *keys, const T *values,                \
                        const int64_t *slots, const int64_t *limits, int64_t rows, int64_t kv,       \
                        int64_t group, int64_t d, int64_t positions, float scale, float *scores,     \
                        T *out) {                                                                    \
        if (group < 1 || group > MAX_GROUP || d > MAX_DIM) return -1;                                \
        head_fn_##SUFFIX head = pick_##SUFFIX(group, d);                                             \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            int64_t length = limits[r] + 1;                                                          \
            if (length > positions) return -1;                                                       \
            for (int64_t h = 0; h < kv; h++) {                                                       \
                const T *qh = q + r * q_stride + h * group * d;                                      \
                T *o = out + (r * kv + h) * group * d;                                               \
                if (length <= 0) {                                                                   \
                    memset(o, 0, (size_t)(group * d) * sizeof(T));                                   \
                    continue;                                                                        \
                }                                                                                    \
                int64_t at = (slots[r] * kv + h) * positions * d;                                    \
                head(qh, keys + at, values + at, length, group, d, scale, scores, positions, o);     \
            }                                                                                        \
        }                                                                                            \
        return 0;                                                                                    \
    }

DEFINE_ATTEND(bf16, uint16_t, from_bf16, to_bf16)
DEFINE_ATTEND(f32, float, from_f32, to_f32)

#define GROUP 32

int int8_vectorised(void) { return INT8_VECTORISED; }

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

/* One weight row against one quantised input row: sum over groups of scale * dx * (codes . xq). */
static float int8_row(const int8_t *w, const float *s, const int8_t *xr, const float *dr, const float *cr,
                      int64_t groups) {
    int64_t g = 0;
    float total = 0.0f;
#if INT8_VECTORISED
    const __m512i flip = _mm512_set1_epi8((char)0x80); /* code + 128 as unsigned bytes */
    __m512 acc = _mm512_setzero_ps();
    for (; g + 2 <= groups; g += 2) { /* two groups: 64 bytes, 16 sums of 4 products */
        __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(w + g * GROUP), flip);
        __m512i xv = _mm512_loadu_si512(xr + g * GROUP);
        __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        __m512 lanes = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[g] * dr[g]), _mm512_set1_ps(s[g + 1] * dr[g + 1]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), lanes, acc);
    }
    int64_t h = 0;
    for (; h + 16 <= groups; h += 16)
        acc = _mm512_fnmadd_ps(_mm512_loadu_ps(s + h), _mm512_loadu_ps(cr + h), acc);
    if (h < groups) {
        __mmask16 m = (__mmask16)((1u << (groups - h)) - 1);
        acc = _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(m, s + h), _mm512_maskz_loadu_ps(m, cr + h), acc);
    }
    total = _mm512_reduce_add_ps(acc);
#else
    for (int64_t h = 0; h < groups; h++) total -= s[h] * cr[h];
#endif
    for (; g < groups; g++) {
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) sum += ((int32_t)w[g * GROUP + i] + 128) * (int32_t)xr[g * GROUP + i];
        total += s[g] * dr[g] * (float)sum;
    }
    return total;
}

/* out [rows, n] float32 = x . w for codes [n, k] int8 and scales [n, k / 32] float32 (x quantised by
   int8_quantize: xq, dx, corr). */
void int8_product(const int8_t *xq, const float *dx, const float *corr, int64_t rows, const int8_t *codes,
                  const float *scales, int64_t n, int64_t k, float *out) {
    int64_t groups = k / GROUP;
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < rows; r++) {
            out[r * n + j] = int8_row(codes + j * k, scales + j * groups, xq + r * k, dx + r * groups,
                                      corr + r * groups, groups);
        }
    }
}

/* One weight row of 4-bit groups, packed two groups to 32 bytes (byte j: code j of the first group in
   the low nibble, of the second in the high one; a last odd group alone in 16 bytes, byte j: codes j
   and j + 16), against one quantised input row. The minimums take the inputs' sums (corr / 128). */
static float int4_row(const uint8_t *w, const float *d, const float *m, const int8_t *xr, const float *dr,
                      const float *cr, int64_t groups) {
    int64_t g = 0;
    float total = 0.0f;
#if INT8_VECTORISED
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    for (; g + 2 <= groups; g += 16) { /* up to 16 groups: their scales times the inputs' at once */
        int64_t count = groups - g < 16 ? (groups - g) & ~(int64_t)1 : 16;
        __mmask16 mask = (__mmask16)((1u << count) - 1);
        __m512 scales = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, d + g), _mm512_maskz_loadu_ps(mask, dr + g));
        for (int64_t p = 0; p < count; p += 2) {
            __m256i packed = _mm256_loadu_si256((const __m256i *)(w + (g + p) * 16));
            __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, nibble)),
                                               _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), 1);
            __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                               _mm512_loadu_si512(xr + (g + p) * GROUP));
            /* lanes 0-7: group g + p's scale, 8-15: the next one's */
            __m512i which = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32((int)p), _mm512_set1_epi32((int)p + 1));
            __m512 lanes = _mm512_permutexvar_ps(which, scales);
            if (p & 2) acc2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), lanes, acc2);
            else acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), lanes, acc);
        }
        if (count < 16) { g += count; break; }
    }
    acc = _mm512_add_ps(acc, acc2);
    const __m512 eighth = _mm512_set1_ps(1.0f / 128.0f);
    int64_t h = 0;
    for (; h + 16 <= groups; h += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(m + h), _mm512_mul_ps(_mm512_loadu_ps(cr + h), eighth), acc);
    if (h < groups) {
        __mmask16 mask = (__mmask16)((1u << (groups - h)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, m + h),
                              _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, cr + h), eighth), acc);
    }
    total = _mm512_reduce_add_ps(acc);
#else
    for (int64_t h = 0; h < groups; h++) total += m[h] * cr[h] / 128.0f;
#endif
    for (; g < groups; g++) {
        const uint8_t *b = w + g * 16;
        const int8_t *x = xr + g * GROUP;
        int32_t sum = 0;
        if (g + 1 < groups) { /* a pair (the plain-C path) */
            for (int j = 0; j < GROUP; j++) sum += (int32_t)(b[j] & 0x0F) * (int32_t)x[j];
            int32_t next = 0;
            for (int j = 0; j < GROUP; j++) next += (int32_t)(b[j] >> 4) * (int32_t)x[GROUP + j];
            total += d[g + 1] * dr[g + 1] * (float)next;
            total += d[g] * dr[g] * (float)sum;
            g++;
            continue;
        }
        for (int j = 0; j < 16; j++) sum += (int32_t)(b[j] & 0x0F) * (int32_t)x[j] + (int32_t)(b[j] >> 4) * (int32_t)x[16 + j];
        total += d[g] * dr[g] * (float)sum;
    }
    return total;
}

/* out [rows, n] float32 = x . w for 4-bit groups: codes [n, 16 * groups] packed as int4_row takes
   them, d and m [n, groups] float32; x quantised by int8_quantize. */
void int4_product(const int8_t *xq, const float *dx, const float *corr, int64_t rows, const uint8_t *codes,
                  const float *d, const float *m, int64_t n, int64_t k, float *out) {
    int64_t groups = k / GROUP;
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < rows; r++) {
            out[r * n + j] = int4_row(codes + j * groups * 16, d + j * groups, m + j * groups, xq + r * k,
                                      dx + r * groups, corr + r * groups, groups);
        }
    }
}

/* x [rows, k] float32 quantised here, then the product: one call per product (the calls' own cost
   mattered: 120 products a step). Returns -1 where memory for the quantised inputs ran out. */
int int8_matmul(const float *x, int64_t rows, int64_t k, const int8_t *codes, const float *scales, int64_t n,
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

int int4_matmul(const float *x, int64_t rows, int64_t k, const uint8_t *codes, const float *d, const float *m,
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
