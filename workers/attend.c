/* Decoding rows' attention on a CPU (workers/attention.py builds and calls it).

   Row r is one decoding sequence's query, in slot r of the KV slots: its queries attend to
   positions 0..limits[r] of that slot (a limit below 0: the row's output is zeros). The queries of
   one key head's group share each key and value as it is read; scores, softmax and sums are
   float32 whatever the cache's dtype. Single-threaded: a call per layer, one thread. */

#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* One key head: its `group` queries against `length` keys and values (`d` apart). A constant D lets
   the compiler keep a row in registers; DIM is D or the runtime d. */
#define DEFINE_HEAD(NAME, T, LOAD, STORE, DIM, DIMS)                                                  \
    static void NAME(const T *q, const T *k, const T *v, int64_t length, int64_t group, int64_t d, \
                     float scale, float *scores, int64_t stride, T *out) {                         \
        (void)d;                                                                                   \
        float qf[MAX_GROUP][DIMS];                                                                 \
        for (int64_t g = 0; g < group; g++)                                                        \
            for (int64_t i = 0; i < DIM; i++) qf[g][i] = LOAD(q[g * DIM + i]) * scale;              \
        for (int64_t t = 0; t < length; t++) {                                                     \
            float row[DIMS];                                                                       \
            for (int64_t i = 0; i < DIM; i++) row[i] = LOAD(k[t * DIM + i]);                        \
            for (int64_t g = 0; g < group; g++) {                                                  \
                float s = 0.0f;                                                                    \
                for (int64_t i = 0; i < DIM; i++) s += qf[g][i] * row[i];                          \
                scores[g * stride + t] = s;                                                        \
            }                                                                                      \
        }                                                                                          \
        for (int64_t g = 0; g < group; g++) softmax(scores + g * stride, length);                  \
        for (int64_t g = 0; g < group; g++) {                                                      \
            float acc[DIMS];                                                                       \
            for (int64_t i = 0; i < DIM; i++) acc[i] = 0.0f;                                       \
            const float *p = scores + g * stride;                                                  \
            for (int64_t t = 0; t < length; t++) {                                                 \
                float pt = p[t];                                                                   \
                for (int64_t i = 0; i < DIM; i++) acc[i] += pt * LOAD(v[t * DIM + i]);             \
            }                                                                                      \
            for (int64_t i = 0; i < DIM; i++) out[g * DIM + i] = STORE(acc[i]);                    \
        }                                                                                          \
    }

#define DEFINE_ATTEND(SUFFIX, T, LOAD, STORE)                                                          \
    DEFINE_HEAD(head64_##SUFFIX, T, LOAD, STORE, 64, 64)                                             \
    DEFINE_HEAD(head128_##SUFFIX, T, LOAD, STORE, 128, 128)                                          \
    DEFINE_HEAD(head_any_##SUFFIX, T, LOAD, STORE, d, MAX_DIM)                                       \
    int attend_##SUFFIX(const T *q, int64_t q_stride, const T *keys, const T *values,                \
                        const int64_t *limits, int64_t rows, int64_t kv, int64_t group, int64_t d,   \
                        int64_t positions, float scale, float *scores, T *out) {                     \
        if (group > MAX_GROUP || d > MAX_DIM) return -1;                                             \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            int64_t length = limits[r] + 1;                                                          \
            if (length > positions) return -1;                                                       \
            for (int64_t h = 0; h < kv; h++) {                                                       \
                const T *qh = q + r * q_stride + h * group * d;                                      \
                const T *k = keys + (r * kv + h) * positions * d;                                    \
                const T *v = values + (r * kv + h) * positions * d;                                  \
                T *o = out + (r * kv + h) * group * d;                                               \
                if (length <= 0) {                                                                   \
                    memset(o, 0, (size_t)(group * d) * sizeof(T));                                   \
                } else if (d == 64) {                                                                \
                    head64_##SUFFIX(qh, k, v, length, group, d, scale, scores, positions, o);       \
                } else if (d == 128) {                                                               \
                    head128_##SUFFIX(qh, k, v, length, group, d, scale, scores, positions, o);      \
                } else {                                                                             \
                    head_any_##SUFFIX(qh, k, v, length, group, d, scale, scores, positions, o);     \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        return 0;                                                                                    \
    }

DEFINE_ATTEND(bf16, uint16_t, from_bf16, to_bf16)
DEFINE_ATTEND(f32, float, from_f32, to_f32)
