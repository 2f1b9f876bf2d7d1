/* Products on a GGUF file's own blocks (workers/model/cpu/blocks.py builds them for the host's CPU and
   loads them; workers/model/gguf.py maps the file).

   blocks_matmul: out[r][c] = x[r] . w[c] for float32 rows x [rows, k] and weights w given as parts (each
   a tensor of `n` rows in one GGML type: a fused product's q, k and v, say), their outputs side by side.
   The weights are read as the file holds them: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32), Q4_K, Q5_K, Q6_K (super-
   blocks of 256), F16, BF16 and F32 rows. As llama.cpp does, the inputs are first quantised to 8 bits
   (per 32 for the blocks of 32, per 256 with sums of every 16 for the K-quants), so that
   the products run on integers: AVX2's byte products (maddubs: unsigned by signed bytes, pairs summed
   into 16 bits; AVX512 VNNI's dpbusd where the CPU has it), else plain C. Float weights multiply the
   float32 inputs. Q4_K and Q6_K tensors are first interleaved by eights (blocks_interleave: a copy, as
   llama.cpp repacks them), so that one load of codes and one broadcast of inputs serve eight rows.

   A weight row's blocks are unpacked once for up to ROWS_AT_ONCE input rows (8 streams, a prompt
   chunk), and a prompt's rows go through in tiles that stay in the caches while a tile of weight rows
   passes. The weight rows are split between this process's threads (blocks_threads): the calling thread and
   the others claim a few tiles of them at a time until none is left.

   blocks_rows: rows of a tensor as float32 (the embeddings of a step's tokens).
   blocks_quantize: the inputs as the products see them (for the tests). */

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BLOCKS_AVX2 1
#else
#define BLOCKS_AVX2 0
#endif
/* AVX512's byte dot products on 256-bit vectors (Zen 4, Ice Lake and later): one instruction for maddubs,
   madd and add where a sum of 4 products goes on in 32 bits */
#if BLOCKS_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BLOCKS_VNNI 1
#else
#define BLOCKS_VNNI 0
#endif

/* GGML's type numbers (gguf-py's GGMLQuantizationType) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_BF16 = 30,
       /* not GGML's: Q4_K and Q6_K super-blocks of eight rows interleaved (blocks_interleave), the products' layout */
       T_Q4_K_X8 = 1012, T_Q6_K_X8 = 1014,
       /* not GGML's either: F16 and BF16 rows as the file holds them, a product taking four at a time */
       T_F16_X4 = 1001, T_BF16_X4 = 1030 };
/* the inputs' form for each: quantised per 32 (Q8_0: scale; Q8_1: scale and scale * sum), per 256
   (Q8_K), or float32 */
enum { A_Q8_0 = 0, A_Q8_1 = 1, A_Q8_K = 2, A_F32 = 3, A_KINDS = 4 };

#define QK 32
#define QK_K 256
#define ROWS_AT_ONCE 8  /* input rows per pass over a weight row's blocks */
#define TILE_INPUTS 64  /* a prompt's input rows per tile */
#define TILE_WEIGHTS 16 /* weight rows per tile */
#define TILES_TAKEN 4   /* tiles a thread takes at once while decoding, at least */
#define TASKS_A_THREAD 4 /* a decoding product's tasks per thread */
#define TASKS_A_THREAD_ROWS 16 /* the same, for several input rows (8 streams): compute-bound */

typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } block_q5_1;
typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } block_q5_K;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } block_q6_K;
/* the inputs, quantised: scales as float32, each rounded to float16 where llama.cpp holds it so */
/* s: Q8_1's scale times the codes' sum; offset: Q8_0's, -16 times the codes' sum (avx2_q8_0 with VNNI) */
typedef struct { float d; union { float s; int32_t offset; }; int8_t qs[QK]; } act_q8;
/* bsums: the sums of each 16 codes (Q6_K's groups); sums32: of each 32 (Q4_K's and Q5_K's sub-blocks) */
typedef struct { float d; int16_t bsums[QK_K / 16]; int16_t sums32[QK_K / 32]; int8_t qs[QK_K]; } act_q8_K;

/* Eight rows' Q4_K super-blocks over the same 256 inputs, laid out for products on all eight at once:
   the scales and minimums unpacked to bytes, and the codes in 32 groups of 4 inputs, each group the eight
   rows' 4 bytes side by side (a row's 4 bytes: 4 codes of sub-block 2j in the low nibbles, of 2j+1 in the
   high ones). One 32-byte load then holds eight rows' codes for the same inputs, and the per-row work
   (scales, minimums, float scales) is done for eight rows in one vector. */
typedef struct {
    uint16_t d[8], dmin[8];
    uint8_t scales[8][8];   /* [sub-block][row] */
    uint8_t mins[4][16];    /* [sub-block pair p][2 row + t]: the minimum of sub-block 2p + t */
    uint8_t qs[4][8][32];   /* [j][group g][4 row + b]: byte 32 j + 4 g + b of the row's codes */
} block_q4_K_x8;

/* Eight rows' Q6_K super-blocks, as block_q4_K_x8: in each half of 128 inputs, group g's 4 inputs of each
   32 (s = 0..3) come from q[half][g][0 and 1] (a Q6_K's ql[l] and ql[l + 32], l = 4 g + b: low nibbles
   for s = 0 and 1, high ones for 2 and 3) and q[half][g][2] (its qh[l]: bits 2 s and 2 s + 1), eight rows
   side by side, in the order the products read them (the hardware's prefetching follows one stream). */
typedef struct {
    uint16_t d[8];
    int8_t scales[8][16];     /* [pair p][2 row + t]: the scale of the row's group of 16 number 2 p + t */
    uint8_t q[2][8][3][32];   /* [half][group g][ql[l], ql[l + 32], qh[l]][4 row + b] */
} block_q6_K_x8;

_Static_assert(sizeof(block_q4_K_x8) == 1184, "Q4_K x8");
_Static_assert(sizeof(block_q6_K_x8) == 1680, "Q6_K x8");
_Static_assert(sizeof(block_q4_0) == 18, "Q4_0");
_Static_assert(sizeof(block_q4_1) == 20, "Q4_1");
_Static_assert(sizeof(block_q5_0) == 22, "Q5_0");
_Static_assert(sizeof(block_q5_1) == 24, "Q5_1");
_Static_assert(sizeof(block_q8_0) == 34, "Q8_0");
_Static_assert(sizeof(block_q4_K) == 144, "Q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "Q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "Q6_K");

/* --- float16 and bfloat16 ------------------------------------------------------------------------- */

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        float value = (float)mantissa * (1.0f / 16777216.0f);
        return sign ? -value : value;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    /* the scales rounded here are >= 0 and finite: normal and subnormal float16s, round to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint32_t sign = (bits >> 16) & 0x8000;
    float a = fabsf(f);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00);
    if (a < 6.103515625e-05f) return (uint16_t)(sign | (uint16_t)nearbyintf(a * 16777216.0f));
    memcpy(&bits, &a, 4);
    uint32_t rounded = bits + 0xfff + ((bits >> 13) & 1);
    return (uint16_t)(sign | (((rounded >> 23) - 112) << 10) | ((rounded >> 13) & 0x3ff));
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float as_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

/* --- the types ---------------------------------------------------------------------------------------- */

typedef struct {
    int64_t block;     /* weights per block */
    int64_t bytes;     /* bytes per block (of all its rows) */
    int activation;    /* the inputs' form */
    int64_t rows;      /* weight rows a block spans: 1, 4 side by side, or 8 interleaved */
} type_info;

static int type_of(int64_t type, type_info *info) {
    switch (type) {
    case T_F32: *info = (type_info){1, 4, A_F32, 1}; return 0;
    case T_F16: *info = (type_info){1, 2, A_F32, 1}; return 0;
    case T_BF16: *info = (type_info){1, 2, A_F32, 1}; return 0;
    case T_F16_X4: *info = (type_info){1, 8, A_F32, 4}; return 0;
    case T_BF16_X4: *info = (type_info){1, 8, A_F32, 4}; return 0;
    case T_Q4_0: *info = (type_info){QK, sizeof(block_q4_0), A_Q8_0, 1}; return 0;
    case T_Q4_1: *info = (type_info){QK, sizeof(block_q4_1), A_Q8_1, 1}; return 0;
    case T_Q5_0: *info = (type_info){QK, sizeof(block_q5_0), A_Q8_0, 1}; return 0;
    case T_Q5_1: *info = (type_info){QK, sizeof(block_q5_1), A_Q8_1, 1}; return 0;
    case T_Q8_0: *info = (type_info){QK, sizeof(block_q8_0), A_Q8_0, 1}; return 0;
    case T_Q4_K: *info = (type_info){QK_K, sizeof(block_q4_K), A_Q8_K, 1}; return 0;
    case T_Q5_K: *info = (type_info){QK_K, sizeof(block_q5_K), A_Q8_K, 1}; return 0;
    case T_Q6_K: *info = (type_info){QK_K, sizeof(block_q6_K), A_Q8_K, 1}; return 0;
    case T_Q4_K_X8: *info = (type_info){QK_K, sizeof(block_q4_K_x8), A_Q8_K, 8}; return 0;
    case T_Q6_K_X8: *info = (type_info){QK_K, sizeof(block_q6_K_x8), A_Q8_K, 8}; return 0;
    default: return -1;
    }
}

/* Which GGML types the products take, and in blocks of how many weights (0: not taken). */
int64_t blocks_type_block(int64_t type) {
    type_info info;
    return type_of(type, &info) ? 0 : info.block;
}

int blocks_vectorised(void) { return BLOCKS_AVX2; }

/* --- the inputs, quantised -------------------------------------------------------------------------- */

static void quantize_q8(const float *x, int64_t k, act_q8 *y, int with_sum) {
    for (int64_t b = 0; b < k / QK; b++, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        /* as llama.cpp's AVX2 quantize_row_q8_0: x * (127 / amax), rounded half to even */
        float d = amax / 127.0f, id = amax ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(x[j] * id);
            y[b].qs[j] = (int8_t)q;
            sum += q;
        }
        y[b].d = as_f16(d);
        if (with_sum) y[b].s = as_f16(d * (float)sum);
        else y[b].offset = -16 * sum;
    }
}

static void quantize_q8_K(const float *x, int64_t k, act_q8_K *y) {
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK_K; j++) {
            float a = fabsf(x[j]);
            if (a > amax) { amax = a; max = x[j]; }
        }
        if (amax == 0.0f) {
            memset(&y[b], 0, sizeof(y[b]));
            continue;
        }
        /* the largest of either sign maps to -127 (as llama.cpp's quantize_row_q8_K) */
        float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            int q = (int)nearbyintf(iscale * x[j]);
            y[b].qs[j] = (int8_t)(q > 127 ? 127 : q);
        }
        for (int j = 0; j < QK_K / 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += y[b].qs[j * 16 + i];
            y[b].bsums[j] = (int16_t)sum;
        }
        for (int j = 0; j < QK_K / 32; j++) y[b].sums32[j] = (int16_t)(y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
        y[b].d = 1.0f / iscale;
    }
}

/* Bytes of one input row of k in `kind`. */
static int64_t act_bytes(int kind, int64_t k) {
    switch (kind) {
    case A_Q8_0: case A_Q8_1: return k / QK * (int64_t)sizeof(act_q8);
    case A_Q8_K: return k / QK_K * (int64_t)sizeof(act_q8_K);
    default: return k * (int64_t)sizeof(float);
    }
}

static void quantize_row(int kind, const float *x, int64_t k, void *out) {
    switch (kind) {
    case A_Q8_0: quantize_q8(x, k, out, 0); break;
    case A_Q8_1: quantize_q8(x, k, out, 1); break;
    case A_Q8_K: quantize_q8_K(x, k, out); break;
    default: memcpy(out, x, (size_t)k * sizeof(float));
    }
}

/* --- plain C products: one weight row against nx input rows ----------------------------------------- */

static inline void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static void plain_q4_0(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q4_0 *b = w;
    for (int r = 0; r < nx; r++) {
        const act_q8 *a = x[r];
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            int s = 0;
            for (int j = 0; j < QK / 2; j++)
                s += ((b[i].qs[j] & 0xF) - 8) * a[i].qs[j] + ((b[i].qs[j] >> 4) - 8) * a[i].qs[j + QK / 2];
            sum += f16_to_f32(b[i].d) * a[i].d * (float)s;
        }
        out[r] = sum;
    }
}

static void plain_q4_1(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q4_1 *b = w;
    for (int r = 0; r < nx; r++) {
        const act_q8 *a = x[r];
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            int s = 0;
            for (int j = 0; j < QK / 2; j++)
                s += (b[i].qs[j] & 0xF) * a[i].qs[j] + (b[i].qs[j] >> 4) * a[i].qs[j + QK / 2];
            sum += f16_to_f32(b[i].d) * a[i].d * (float)s + f16_to_f32(b[i].m) * a[i].s;
        }
        out[r] = sum;
    }
}

/* The fifth bits of Q5_0 and Q5_1: weight j's is bit j of qh */
static inline int fifth(const uint8_t *qh, int j) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    return (int)((bits >> j) & 1) << 4;
}

static void plain_q5_0(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q5_0 *b = w;
    for (int r = 0; r < nx; r++) {
        const act_q8 *a = x[r];
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            int s = 0;
            for (int j = 0; j < QK / 2; j++)
                s += (((b[i].qs[j] & 0xF) | fifth(b[i].qh, j)) - 16) * a[i].qs[j]
                     + (((b[i].qs[j] >> 4) | fifth(b[i].qh, j + QK / 2)) - 16) * a[i].qs[j + QK / 2];
            sum += f16_to_f32(b[i].d) * a[i].d * (float)s;
        }
        out[r] = sum;
    }
}

static void plain_q5_1(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q5_1 *b = w;
    for (int r = 0; r < nx; r++) {
        const act_q8 *a = x[r];
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            int s = 0;
            for (int j = 0; j < QK / 2; j++)
                s += ((b[i].qs[j] & 0xF) | fifth(b[i].qh, j)) * a[i].qs[j]
                     + ((b[i].qs[j] >> 4) | fifth(b[i].qh, j + QK / 2)) * a[i].qs[j + QK / 2];
            sum += f16_to_f32(b[i].d) * a[i].d * (float)s + f16_to_f32(b[i].m) * a[i].s;
        }
        out[r] = sum;
    }
}

static void plain_q8_0(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q8_0 *b = w;
    for (int r = 0; r < nx; r++) {
        const act_q8 *a = x[r];
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            int s = 0;
            for (int j = 0; j < QK; j++) s += b[i].qs[j] * a[i].qs[j];
            sum += f16_to_f32(b[i].d) * a[i].d * (float)s;
        }
        out[r] = sum;
    }
}

/* A K-quant super-block's 8 sub-blocks of 32: their integer sums against the inputs, and its minimums
   against the inputs' sums (Q4_K, Q5_K). */
static float plain_k_block(const uint8_t *scales, float d, float dmin, const act_q8_K *a, const uint8_t *codes) {
    int sum = 0, mins = 0;
    for (int j = 0; j < 8; j++) {
        int scale, min, s = 0;
        scale_min_k4(j, scales, &scale, &min);
        for (int l = 0; l < 32; l++) s += codes[j * 32 + l] * a->qs[j * 32 + l];
        sum += scale * s;
        mins += min * a->sums32[j];
    }
    return a->d * (d * (float)sum - dmin * (float)mins);
}

static void plain_q4_K(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q4_K *b = w;
    uint8_t codes[QK_K];
    for (int r = 0; r < nx; r++) out[r] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                codes[64 * j + l] = b[i].qs[32 * j + l] & 0xF;
                codes[64 * j + 32 + l] = b[i].qs[32 * j + l] >> 4;
            }
        for (int r = 0; r < nx; r++)
            out[r] += plain_k_block(b[i].scales, f16_to_f32(b[i].d), f16_to_f32(b[i].dmin),
                                    (const act_q8_K *)x[r] + i, codes);
    }
}

/* Eight interleaved Q4_K rows against nx input rows: out[8 r + i] for input r, weight row i. */
static void plain_q4_K_x8(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q4_K_x8 *b = w;
    for (int o = 0; o < 8 * nx; o++) out[o] = 0.0f;
    for (int64_t i = 0; i < nb; i++)
        for (int r = 0; r < nx; r++) {
            const act_q8_K *a = (const act_q8_K *)x[r] + i;
            for (int row = 0; row < 8; row++) {
                int sum = 0, mins = 0;
                for (int s = 0; s < 8; s++) {
                    int j = s / 2, high = s % 2, dot = 0;
                    for (int l = 0; l < 32; l++) {
                        uint8_t byte = b[i].qs[j][l / 4][4 * row + l % 4];
                        dot += (high ? byte >> 4 : byte & 0xF) * a->qs[64 * j + 32 * high + l];
                    }
                    sum += b[i].scales[s][row] * dot;
                    mins += b[i].mins[j][2 * row + high] * a->sums32[s];
                }
                out[8 * r + row] += a->d * (f16_to_f32(b[i].d[row]) * (float)sum - f16_to_f32(b[i].dmin[row]) * (float)mins);
            }
        }
}

/* A code of row `row` of an interleaved Q6_K super-block: input 128 half + 32 s + l (as plain_q6_K's). */
static int q6_K_x8_code(const block_q6_K_x8 *b, int row, int half, int s, int l) {
    uint8_t low = b->q[half][l / 4][s % 2][4 * row + l % 4], high = b->q[half][l / 4][2][4 * row + l % 4];
    return ((s < 2 ? low & 0xF : low >> 4) | (((high >> (2 * s)) & 3) << 4)) - 32;
}

static void plain_q6_K_x8(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q6_K_x8 *b = w;
    for (int o = 0; o < 8 * nx; o++) out[o] = 0.0f;
    for (int64_t i = 0; i < nb; i++)
        for (int r = 0; r < nx; r++) {
            const act_q8_K *a = (const act_q8_K *)x[r] + i;
            for (int row = 0; row < 8; row++) {
                int sum = 0;
                for (int half = 0; half < 2; half++)
                    for (int s = 0; s < 4; s++)
                        for (int l = 0; l < 32; l++) {
                            int input = 128 * half + 32 * s + l, group = input / 16;
                            sum += b[i].scales[group / 2][2 * row + group % 2] * q6_K_x8_code(&b[i], row, half, s, l) *
                                   a->qs[input];
                        }
                out[8 * r + row] += f16_to_f32(b[i].d[row]) * a->d * (float)sum;
            }
        }
}

static void plain_q5_K(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q5_K *b = w;
    uint8_t codes[QK_K];
    for (int r = 0; r < nx; r++) out[r] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                codes[64 * j + l] = (b[i].qs[32 * j + l] & 0xF) | (((b[i].qh[l] >> (2 * j)) & 1) << 4);
                codes[64 * j + 32 + l] = (b[i].qs[32 * j + l] >> 4) | (((b[i].qh[l] >> (2 * j + 1)) & 1) << 4);
            }
        for (int r = 0; r < nx; r++)
            out[r] += plain_k_block(b[i].scales, f16_to_f32(b[i].d), f16_to_f32(b[i].dmin),
                                    (const act_q8_K *)x[r] + i, codes);
    }
}

static void plain_q6_K(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q6_K *b = w;
    int8_t codes[QK_K];
    for (int r = 0; r < nx; r++) out[r] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = b[i].ql + 64 * half, *qh = b[i].qh + 32 * half;
            int8_t *c = codes + 128 * half;
            for (int l = 0; l < 32; l++) {
                c[l] = (int8_t)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                c[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                c[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                c[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        float d = f16_to_f32(b[i].d);
        for (int r = 0; r < nx; r++) {
            const act_q8_K *a = (const act_q8_K *)x[r] + i;
            int sum = 0;
            for (int g = 0; g < 16; g++) {
                int s = 0;
                for (int l = 0; l < 16; l++) s += codes[16 * g + l] * a->qs[16 * g + l];
                sum += b[i].scales[g] * s;
            }
            out[r] += d * a->d * (float)sum;
        }
    }
}

#define DEFINE_PLAIN_FLOAT(NAME, T, LOAD)                                                             \
    static void NAME(const void *w, const void *const *x, int nx, int64_t k, float *out) {           \
        const T *row = w;                                                                             \
        for (int r = 0; r < nx; r++) {                                                                \
            const float *a = x[r];                                                                    \
            float sum = 0.0f;                                                                         \
            for (int64_t j = 0; j < k; j++) sum += LOAD(row[j]) * a[j];                               \
            out[r] = sum;                                                                             \
        }                                                                                             \
    }
#define LOAD_F32(v) (v)
DEFINE_PLAIN_FLOAT(plain_f32, float, LOAD_F32)
DEFINE_PLAIN_FLOAT(plain_f16, uint16_t, f16_to_f32)
DEFINE_PLAIN_FLOAT(plain_bf16, uint16_t, bf16_to_f32)
/* Four rows `stride` weights apart (out[4 r + o]) */
#define DEFINE_PLAIN_FOUR(NAME, ONE, T)                                                               \
    static void NAME(const void *w, int64_t stride, const void *const *x, int nx, int64_t k, float *out) { \
        float sums[4][ROWS_AT_ONCE];                                                                  \
        for (int o = 0; o < 4; o++) ONE((const T *)w + o * stride, x, nx, k, sums[o]);                \
        for (int r = 0; r < nx; r++)                                                                  \
            for (int o = 0; o < 4; o++) out[4 * r + o] = sums[o][r];                                  \
    }
DEFINE_PLAIN_FOUR(plain_f16_x4, plain_f16, uint16_t)
DEFINE_PLAIN_FOUR(plain_bf16_x4, plain_bf16, uint16_t)

/* --- AVX2 products ------------------------------------------------------------------------------------ */

#if BLOCKS_AVX2
#define INLINE static inline __attribute__((always_inline))
/* loops whose counts are constants, unrolled whole: their sums stay in registers */
#define UNROLL _Pragma("GCC unroll 8")

/* A product's weights come from memory, beyond the caches, and the hardware's prefetcher alone kept a row
   of blocks well below memory's rate (docs/performance.md, "GGUF weights in their own blocks"): each
   block's bytes FETCH_AHEAD further on are asked for while it is multiplied. */
#define FETCH_AHEAD 2048

INLINE void fetch_ahead(const void *block, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64)
        _mm_prefetch((const char *)block + FETCH_AHEAD + offset, _MM_HINT_T0);
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 nibbles of 16 bytes as bytes: the low ones first (weights 0..15), then the high ones (16..31) */
INLINE __m256i nibbles32(const uint8_t *q) {
    __m128i packed = _mm_loadu_si128((const __m128i *)q);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
}

/* sum of unsigned bytes w times signed bytes a, as 8 int32 */
INLINE __m256i dot_unsigned(__m256i w, __m256i a) {
#if BLOCKS_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
#endif
}

/* sum of signed bytes w * a, as 8 int32 (the sign moved onto a: the byte products take unsigned by signed) */
INLINE __m256i dot_signed(__m256i w, __m256i a) {
    return dot_unsigned(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

/* Two sums a row, blocks taken in turn: one chain of multiply-adds, a block per its latency, ran slower than
   memory delivers a Q8_0 row at one thread */
#define Q8_FAMILY_BLOCK(BLOCK, CODES, DOT, MIN, ACC)                                                    \
    {                                                                                                 \
        fetch_ahead(b + i, sizeof(BLOCK));                                                            \
        __m256i codes = CODES;                                                                        \
        float d = f16_to_f32(b[i].d);                                                                 \
        for (int r = 0; r < nx; r++) {                                                                \
            const act_q8 *a = (const act_q8 *)x[r] + i;                                               \
            __m256 dot = _mm256_cvtepi32_ps(DOT(codes, _mm256_loadu_si256((const __m256i *)a->qs)));  \
            ACC[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), dot, ACC[r]);                          \
            MIN;                                                                                      \
        }                                                                                             \
    }
#define DEFINE_Q8_FAMILY(NAME, BLOCK, CODES, DOT, MIN)                                                  \
    INLINE void NAME##_n(const void *w, const void *const *x, int nx, int64_t nb, float *out) {       \
        const BLOCK *b = w;                                                                           \
        __m256 acc[ROWS_AT_ONCE], odd[ROWS_AT_ONCE];                                                  \
        float mins[ROWS_AT_ONCE];                                                                     \
        for (int r = 0; r < nx; r++) { acc[r] = odd[r] = _mm256_setzero_ps(); mins[r] = 0.0f; }      \
        int64_t i = 0;                                                                                \
        for (; i + 2 <= nb; i++) {                                                                    \
            Q8_FAMILY_BLOCK(BLOCK, CODES, DOT, MIN, acc)                                              \
            i++;                                                                                      \
            Q8_FAMILY_BLOCK(BLOCK, CODES, DOT, MIN, odd)                                              \
        }                                                                                             \
        if (i < nb) Q8_FAMILY_BLOCK(BLOCK, CODES, DOT, MIN, acc)                                      \
        for (int r = 0; r < nx; r++) out[r] = hsum8(_mm256_add_ps(acc[r], odd[r])) + mins[r];        \
    }

DEFINE_Q8_FAMILY(avx2_q4_0, block_q4_0, _mm256_sub_epi8(nibbles32(b[i].qs), _mm256_set1_epi8(8)), dot_signed,
                 (void)0)
DEFINE_Q8_FAMILY(avx2_q4_1, block_q4_1, nibbles32(b[i].qs), dot_unsigned, mins[r] += f16_to_f32(b[i].m) * a->s)
/* 32 bits as 32 bytes: 0xFF where the bit is set, else 0 */
INLINE __m256i bytes_of_bits(const uint8_t *q) {
    uint32_t bits;
    memcpy(&bits, q, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe); /* every bit but the byte's own */
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

/* Q5_0's codes less 16: a nibble without its fifth bit is the nibble - 16, its high bits set */
DEFINE_Q8_FAMILY(avx2_q5_0, block_q5_0,
                 _mm256_or_si256(nibbles32(b[i].qs), _mm256_andnot_si256(bytes_of_bits(b[i].qh),
                                                                         _mm256_set1_epi8((char)0xF0))),
                 dot_signed, (void)0)
DEFINE_Q8_FAMILY(avx2_q5_1, block_q5_1,
                 _mm256_or_si256(nibbles32(b[i].qs), _mm256_and_si256(bytes_of_bits(b[i].qh), _mm256_set1_epi8(0x10))),
                 dot_unsigned, mins[r] += f16_to_f32(b[i].m) * a->s)
#if BLOCKS_VNNI
/* Q8_0's signed codes as unsigned ones 128 above, so that vpdpbusd takes them without moving their signs
   onto the inputs (a sixth of a compute-bound product's instructions): each sum of products starts from
   -128 times the input's codes' sum, spread over its 8 lanes. Without VNNI, maddubs' 16-bit pairs would
   overflow. */
#define DOT_Q8_0(codes, inputs) _mm256_dpbusd_epi32(_mm256_set1_epi32(a->offset), codes, inputs)
DEFINE_Q8_FAMILY(avx2_q8_0, block_q8_0,
                 _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b[i].qs), _mm256_set1_epi8((char)0x80)),
                 DOT_Q8_0, (void)0)
#else
DEFINE_Q8_FAMILY(avx2_q8_0, block_q8_0, _mm256_loadu_si256((const __m256i *)b[i].qs), dot_signed, (void)0)
#endif

/* A Q4_K or Q5_K super-block's 6-bit scales and minimums as 16 int16: scales 0..7, then minimums 0..7. */
INLINE __m256i scales_mins_k(const uint8_t *packed) {
    uint32_t u[4];
    memcpy(u, packed, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    uint32_t mins_low = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_low;
    u[0] &= m1;
    return _mm256_cvtepu8_epi16(_mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]));
}

/* The int16 scale of sub-block j in every lane (scales: scales_mins_k's low half in both lanes). */
INLINE __m256i scale_k(__m256i scales, int j) {
    const __m256i shuffle = _mm256_set1_epi16((short)((2 * j) | ((2 * j + 1) << 8)));
    return _mm256_shuffle_epi8(scales, shuffle);
}

/* The minimums' part of a super-block against an input's sums of 16: sum over sub-blocks of min * sum */
INLINE __m128i mins_k(__m128i mins, const act_q8_K *a) {
    return _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)a->sums32));
}

/* Q4_K and Q5_K: codes of sub-blocks 2j (low) and 2j+1 (high) given by LOW and HIGH for j = 0..3. */
#define DEFINE_K_FAMILY(NAME, BLOCK, PREPARE, LOW, HIGH)                                                  \
    INLINE void NAME##_n(const void *w, const void *const *x, int nx, int64_t nb, float *out) {         \
        const BLOCK *b = w;                                                                             \
        __m256 acc[ROWS_AT_ONCE];                                                                       \
        __m128 acc_m[ROWS_AT_ONCE];                                                                     \
        for (int r = 0; r < nx; r++) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm_setzero_ps(); }    \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                      \
        for (int64_t i = 0; i < nb; i++) {                                                              \
            fetch_ahead(b + i, sizeof(BLOCK));                                                          \
            const float d = f16_to_f32(b[i].d), dmin = f16_to_f32(b[i].dmin);                           \
            const __m256i both = scales_mins_k(b[i].scales);                                            \
            const __m128i low128 = _mm256_castsi256_si128(both);                                        \
            const __m256i scales = _mm256_set_m128i(low128, low128);                                    \
            const __m128i mins = _mm256_extracti128_si256(both, 1);                                     \
            __m256i sums[ROWS_AT_ONCE];                                                                 \
            for (int r = 0; r < nx; r++) sums[r] = _mm256_setzero_si256();                              \
            PREPARE;                                                                                    \
            for (int j = 0; j < 4; j++) {                                                               \
                const __m256i bits = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * j));          \
                const __m256i low = LOW, high = HIGH;                                                   \
                const __m256i scale_l = scale_k(scales, 2 * j), scale_h = scale_k(scales, 2 * j + 1);  \
                for (int r = 0; r < nx; r++) {                                                          \
                    const int8_t *q8 = ((const act_q8_K *)x[r] + i)->qs + 64 * j;                      \
                    __m256i pl = _mm256_maddubs_epi16(low, _mm256_loadu_si256((const __m256i *)q8));    \
                    __m256i ph = _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i *)(q8 + 32))); \
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(_mm256_madd_epi16(scale_l, pl),   \
                                                                         _mm256_madd_epi16(scale_h, ph))); \
                }                                                                                       \
            }                                                                                           \
            for (int r = 0; r < nx; r++) {                                                              \
                const act_q8_K *a = (const act_q8_K *)x[r] + i;                                         \
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(sums[r]), acc[r]); \
                acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(-dmin * a->d), _mm_cvtepi32_ps(mins_k(mins, a)), acc_m[r]); \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < nx; r++) {                                                                  \
            __m128 m = acc_m[r];                                                                        \
            m = _mm_add_ps(m, _mm_movehl_ps(m, m));                                                     \
            m = _mm_add_ss(m, _mm_movehdup_ps(m));                                                      \
            out[r] = hsum8(acc[r]) + _mm_cvtss_f32(m);                                                  \
        }                                                                                               \
    }

DEFINE_K_FAMILY(avx2_q4_K, block_q4_K, (void)0, _mm256_and_si256(bits, m4),
                _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4))
/* Q5_K: the fifth bit of sub-block s is bit s of each of qh's 32 bytes, moved to bit 4 */
DEFINE_K_FAMILY(avx2_q5_K, block_q5_K, const __m256i hbits = _mm256_loadu_si256((const __m256i *)b[i].qh),
                _mm256_or_si256(_mm256_and_si256(bits, m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j),
                                                                   _mm256_set1_epi8(1)), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1),
                                                                   _mm256_set1_epi8(1)), 4)))

/* Q6_K: codes 0..63 (the stored ones, 32 above the signed ones): maddubs of the unsigned codes, less 32
   times the scaled sums of the inputs (their sums of 16, once a super-block). */
INLINE void avx2_q6_K_n(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q6_K *b = w;
    __m256 acc[ROWS_AT_ONCE];
    for (int r = 0; r < nx; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nb; i++) {
        fetch_ahead(b + i, sizeof(*b));
        const __m128i scales8 = _mm_loadu_si128((const __m128i *)b[i].scales);
        const __m256i scales16 = _mm256_cvtepi8_epi16(scales8);
        __m256i sums[ROWS_AT_ONCE];
        for (int r = 0; r < nx; r++) {
            const act_q8_K *a = (const act_q8_K *)x[r] + i;
            /* -32 * sum over groups of scale * input sum */
            __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i *)a->bsums));
            sums[r] = _mm256_mullo_epi32(offset, _mm256_set1_epi32(-32));
        }
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = b[i].ql + 64 * half;
            const __m256i bits1 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i bits2 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i high = _mm256_loadu_si256((const __m256i *)(b[i].qh + 32 * half));
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(bits1, m4), _mm256_slli_epi16(_mm256_and_si256(high, m2), 4)),
                _mm256_or_si256(_mm256_and_si256(bits2, m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2), m2), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 4), m2), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 6), m2), 4)),
            };
            __m256i scale[4];
            for (int s = 0; s < 4; s++) {
                /* groups 8 half + 2 s and + 1: 16 lanes, the first 8 the first group's scale */
                int g = 8 * half + 2 * s;
                scale[s] = _mm256_set_m128i(_mm_set1_epi16(b[i].scales[g + 1]), _mm_set1_epi16(b[i].scales[g]));
            }
            for (int r = 0; r < nx; r++) {
                const int8_t *q8 = ((const act_q8_K *)x[r] + i)->qs + 128 * half;
                for (int s = 0; s < 4; s++) {
                    __m256i p = _mm256_maddubs_epi16(q[s], _mm256_loadu_si256((const __m256i *)(q8 + 32 * s)));
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(scale[s], p));
                }
            }
        }
        const float d = f16_to_f32(b[i].d);
        for (int r = 0; r < nx; r++) {
            const act_q8_K *a = (const act_q8_K *)x[r] + i;
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->d), _mm256_cvtepi32_ps(sums[r]), acc[r]);
        }
    }
    for (int r = 0; r < nx; r++) out[r] = hsum8(acc[r]);
}

/* A running sum, kept in a register at each step: else gcc stores each addend to the stack and adds them
   all up after the loop (docs/performance.md, "GGUF weights in their own blocks") */
INLINE __m256i in_register(__m256i sum) {
    __asm__("" : "+v"(sum));
    return sum;
}

/* A sub-block's 8 groups of codes against their inputs, added up per row (x8_add), then times each row's
   scale (x8_scale_of: the scales of 8 bytes; x8_scaled). With VNNI, dpbusd adds each 32-bit lane's 4 byte
   products into it, and the row sums are multiplied as 32 bits; else maddubs' pairs add up in 16 bits (at
   most 8 * 2 * 15 * 128) and madd multiplies each row's two lanes by its scale and adds them. */
#if BLOCKS_VNNI
INLINE __m256i x8_add(__m256i sums, __m256i codes, __m256i inputs) { return _mm256_dpbusd_epi32(sums, codes, inputs); }
INLINE __m256i x8_scale_of(const uint8_t *scales) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)scales)); }
INLINE __m256i x8_scaled(__m256i sums, __m256i scale) { return _mm256_mullo_epi32(sums, scale); }
#else
INLINE __m256i x8_add(__m256i sums, __m256i codes, __m256i inputs) {
    return in_register(_mm256_add_epi16(sums, _mm256_maddubs_epi16(codes, inputs)));
}
INLINE __m256i x8_scale_of(const uint8_t *scales) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)scales);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes, bytes));
}
INLINE __m256i x8_scaled(__m256i sums, __m256i scale) { return _mm256_madd_epi16(sums, scale); }
#endif

/* Eight interleaved Q4_K rows (block_q4_K_x8) against nx input rows: a group's 32 bytes hold the eight
   rows' codes for the same 4 inputs, so one broadcast of the inputs serves eight rows. Each block is taken
   by all input rows, four at a time (more spill their sums from the registers), before the next: a pass
   of four rows over the whole row of blocks, then the next four, left the first pass waiting on memory,
   its blocks fetched ahead too short a time before it came to them (docs/performance.md, "GGUF weights
   in their own blocks"). */
INLINE void avx2_q4_K_x8_n(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q4_K_x8 *b = w;
    __m256 acc[ROWS_AT_ONCE], acc_m[ROWS_AT_ONCE];
    for (int r = 0; r < nx; r++) { acc[r] = _mm256_setzero_ps(); acc_m[r] = _mm256_setzero_ps(); }
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < nb; i++) {
        fetch_ahead(b + i, sizeof(*b));
        UNROLL for (int r0 = 0; r0 < nx; r0 += 4) {
            const int n = nx - r0 < 4 ? nx - r0 : 4;
            __m256i sums[4];
            for (int r = 0; r < n; r++) sums[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                __m256i low_sums[4], high_sums[4];
                for (int r = 0; r < n; r++) low_sums[r] = high_sums[r] = _mm256_setzero_si256();
                UNROLL for (int g = 0; g < 8; g++) {
                    const __m256i bits = _mm256_loadu_si256((const __m256i *)b[i].qs[j][g]);
                    const __m256i low = _mm256_and_si256(bits, m4), high = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
                    for (int r = 0; r < n; r++) {
                        const int8_t *q8 = ((const act_q8_K *)x[r0 + r] + i)->qs + 64 * j + 4 * g;
                        int32_t low4, high4;
                        memcpy(&low4, q8, 4);
                        memcpy(&high4, q8 + 32, 4);
                        low_sums[r] = x8_add(low_sums[r], low, _mm256_set1_epi32(low4));
                        high_sums[r] = x8_add(high_sums[r], high, _mm256_set1_epi32(high4));
                    }
                }
                const __m256i scale_l = x8_scale_of(b[i].scales[2 * j]), scale_h = x8_scale_of(b[i].scales[2 * j + 1]);
                for (int r = 0; r < n; r++)
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(x8_scaled(low_sums[r], scale_l),
                                                                         x8_scaled(high_sums[r], scale_h)));
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].dmin));
            for (int r = 0; r < n; r++) {
                const act_q8_K *a = (const act_q8_K *)x[r0 + r] + i;
                __m256i mins = _mm256_setzero_si256();
                for (int pair = 0; pair < 4; pair++) { /* two sub-blocks' minimums against their inputs' sums */
                    int32_t sums2;
                    memcpy(&sums2, a->sums32 + 2 * pair, 4);
                    const __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b[i].mins[pair]));
                    mins = _mm256_add_epi32(mins, _mm256_madd_epi16(m, _mm256_set1_epi32(sums2)));
                }
                const __m256 ad = _mm256_set1_ps(a->d);
                acc[r0 + r] = _mm256_fmadd_ps(_mm256_mul_ps(d, ad), _mm256_cvtepi32_ps(sums[r]), acc[r0 + r]);
                acc_m[r0 + r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, ad), _mm256_cvtepi32_ps(mins), acc_m[r0 + r]);
            }
        }
    }
    for (int r = 0; r < nx; r++) _mm256_storeu_ps(out + 8 * r, _mm256_sub_ps(acc[r], acc_m[r]));
}

/* An interleaved Q6_K row pair's scales (x8_scaled's form) of group 2 p + t: from 16 signed bytes, row r's
   scales of groups 2 p and 2 p + 1 side by side. */
INLINE __m256i x6_scale(const int8_t *pair, int t) {
    const __m256i both = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)pair));
#if BLOCKS_VNNI
    return t ? _mm256_srai_epi32(both, 16) : _mm256_srai_epi32(_mm256_slli_epi32(both, 16), 16);
#else
    /* each 32-bit lane's first (t = 0) or second 16 bits in both halves */
    const __m256i first = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                           0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    return _mm256_shuffle_epi8(both, t ? _mm256_add_epi8(first, _mm256_set1_epi8(2)) : first);
#endif
}

/* Groups of 4 inputs whose products add up before their scale: a group of 16's 4 with VNNI's 32-bit sums;
   2 in maddubs' 16 bits (at most 2 * 2 * 63 * 128) */
#define X6_RUN (BLOCKS_VNNI ? 4 : 2)

/* Eight interleaved Q6_K rows (block_q6_K_x8) against nx input rows, four at a time as avx2_q4_K_x8_n's:
   codes 0..63 (32 above the signed ones) against the inputs, less 32 times each group's scale times its
   inputs' sum (bsums). A run's four codes go in two passes, those from ql[l] and those from ql[l + 32]: all
   four at once held 16 sums for 4 input rows, more than AVX2's 16 registers hold with the codes
   (docs/performance.md, "GGUF weights in their own blocks"). */
INLINE void avx2_q6_K_x8_n(const void *w, const void *const *x, int nx, int64_t nb, float *out) {
    const block_q6_K_x8 *b = w;
    __m256 acc[ROWS_AT_ONCE];
    for (int r = 0; r < nx; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int64_t i = 0; i < nb; i++) {
        fetch_ahead(b + i, sizeof(*b));
        UNROLL for (int r0 = 0; r0 < nx; r0 += 4) {
            const int n = nx - r0 < 4 ? nx - r0 : 4;
            __m256i sums[4];
            for (int r = 0; r < n; r++) sums[r] = _mm256_setzero_si256();
            for (int half = 0; half < 2; half++)
                UNROLL for (int g0 = 0; g0 < 8; g0 += X6_RUN)
                    UNROLL for (int p = 0; p < 2; p++) { /* codes p and p + 2 */
                        __m256i run[4][2];
                        for (int r = 0; r < n; r++) run[r][0] = run[r][1] = _mm256_setzero_si256();
                        UNROLL for (int g = g0; g < g0 + X6_RUN; g++) {
                            const __m256i l = _mm256_loadu_si256((const __m256i *)b[i].q[half][g][p]);
                            const __m256i h = _mm256_loadu_si256((const __m256i *)b[i].q[half][g][2]);
                            const __m256i low = _mm256_or_si256(_mm256_and_si256(l, m4),
                                                                _mm256_and_si256(_mm256_slli_epi16(h, 4 - 2 * p), m30));
                            const __m256i high = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                                                                 _mm256_and_si256(p ? _mm256_srli_epi16(h, 2) : h, m30));
                            UNROLL for (int r = 0; r < n; r++) {
                                const int8_t *q8 = ((const act_q8_K *)x[r0 + r] + i)->qs + 128 * half + 4 * g;
                                int32_t four_low, four_high;
                                memcpy(&four_low, q8 + 32 * p, 4);
                                memcpy(&four_high, q8 + 32 * (p + 2), 4);
                                run[r][0] = x8_add(run[r][0], low, _mm256_set1_epi32(four_low));
                                run[r][1] = x8_add(run[r][1], high, _mm256_set1_epi32(four_high));
                            }
                        }
                        UNROLL for (int t = 0; t < 2; t++) {
                            const int group = 8 * half + 2 * (p + 2 * t) + g0 / 4;
                            const __m256i scale = x6_scale(b[i].scales[group / 2], group % 2);
                            for (int r = 0; r < n; r++)
                                sums[r] = in_register(_mm256_add_epi32(sums[r], x8_scaled(run[r][t], scale)));
                        }
                    }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b[i].d));
            for (int r = 0; r < n; r++) {
                const act_q8_K *a = (const act_q8_K *)x[r0 + r] + i;
                __m256i offset = _mm256_setzero_si256();
                for (int pair = 0; pair < 8; pair++) {
                    int32_t sums2;
                    memcpy(&sums2, a->bsums + 2 * pair, 4);
                    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[i].scales[pair]));
                    offset = _mm256_add_epi32(offset, _mm256_madd_epi16(scales, _mm256_set1_epi32(sums2)));
                }
                const __m256i total = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(offset, 5));
                acc[r0 + r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(a->d)), _mm256_cvtepi32_ps(total), acc[r0 + r]);
            }
        }
    }
    for (int r = 0; r < nx; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

INLINE __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
INLINE __m256 load8_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Float rows: each row's sums in as many chains as the registers hold (one chain is bound by the
   multiply-add's latency, not by the bytes) */
#define DEFINE_AVX2_FLOAT(NAME, T, LOAD8, LOAD1)                                                        \
    INLINE void NAME##_n(const void *w, const void *const *x, int nx, int64_t k, float *out) {        \
        const T *row = w;                                                                               \
        const int split = nx == 1 ? 4 : nx == 2 ? 2 : 1;                                               \
        __m256 acc[ROWS_AT_ONCE][4];                                                                    \
        for (int r = 0; r < nx; r++)                                                                    \
            for (int s = 0; s < split; s++) acc[r][s] = _mm256_setzero_ps();                            \
        int64_t j = 0;                                                                                  \
        for (; j + 8 * split <= k; j += 8 * split)                                                      \
            for (int s = 0; s < split; s++) {                                                           \
                __m256 v = LOAD8(row + j + 8 * s);                                                      \
                for (int r = 0; r < nx; r++)                                                            \
                    acc[r][s] = _mm256_fmadd_ps(v, _mm256_loadu_ps((const float *)x[r] + j + 8 * s), acc[r][s]); \
            }                                                                                           \
        for (; j + 8 <= k; j += 8) {                                                                    \
            __m256 v = LOAD8(row + j);                                                                  \
            for (int r = 0; r < nx; r++) acc[r][0] = _mm256_fmadd_ps(v, _mm256_loadu_ps((const float *)x[r] + j), acc[r][0]); \
        }                                                                                               \
        for (int r = 0; r < nx; r++) {                                                                  \
            for (int s = 1; s < split; s++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][s]);            \
            float sum = hsum8(acc[r][0]);                                                               \
            for (int64_t t = j; t < k; t++) sum += LOAD1(row[t]) * ((const float *)x[r])[t];           \
            out[r] = sum;                                                                               \
        }                                                                                               \
    }
DEFINE_AVX2_FLOAT(avx2_f32, float, load8_f32, LOAD_F32)
DEFINE_AVX2_FLOAT(avx2_f16, uint16_t, load8_f16, f16_to_f32)
DEFINE_AVX2_FLOAT(avx2_bf16, uint16_t, load8_bf16, bf16_to_f32)

/* Four rows `stride` weights apart against FOUR_INPUTS input rows at a time: an input load serves four
   rows and memory is read in four streams at once; one row at a time ran below llama.cpp's rate from
   memory. Four input rows' 16 sums fit AVX512's 32 registers, not AVX2's 16; each weight's conversion
   then serves four input rows, not two (docs/performance.md, "GGUF weights in their own blocks"). */
#if defined(__AVX512VL__)
#define FOUR_INPUTS 4
#else
#define FOUR_INPUTS 2
#endif
#define DEFINE_AVX2_FOUR(NAME, T, LOAD8, LOAD1)                                                         \
    INLINE void NAME##_pass(const T *w, int64_t stride, const void *const *x, int nx, int64_t k, float *out) { \
        __m256 acc[4][4];                                                                               \
        for (int r = 0; r < nx; r++)                                                                    \
            for (int o = 0; o < 4; o++) acc[r][o] = _mm256_setzero_ps();                                \
        int64_t j = 0;                                                                                  \
        for (; j + 8 <= k; j += 8) {                                                                    \
            const __m256 v[4] = {LOAD8(w + j), LOAD8(w + stride + j), LOAD8(w + 2 * stride + j),          \
                                 LOAD8(w + 3 * stride + j)};                                            \
            for (int r = 0; r < nx; r++) {                                                              \
                const __m256 in = _mm256_loadu_ps((const float *)x[r] + j);                             \
                for (int o = 0; o < 4; o++) acc[r][o] = _mm256_fmadd_ps(v[o], in, acc[r][o]);           \
            }                                                                                           \
        }                                                                                               \
        for (int r = 0; r < nx; r++)                                                                    \
            for (int o = 0; o < 4; o++) {                                                               \
                float sum = hsum8(acc[r][o]);                                                           \
                for (int64_t t = j; t < k; t++) sum += LOAD1(w[o * stride + t]) * ((const float *)x[r])[t]; \
                out[4 * r + o] = sum;                                                                   \
            }                                                                                           \
    }                                                                                                   \
    static void NAME(const void *w, int64_t stride, const void *const *x, int nx, int64_t k, float *out) { \
        for (; nx > FOUR_INPUTS; nx -= FOUR_INPUTS, x += FOUR_INPUTS, out += 4 * FOUR_INPUTS)          \
            NAME##_pass(w, stride, x, FOUR_INPUTS, k, out);                                             \
        switch (nx) { /* the count a constant: the sums stay in registers */                           \
        case 1: NAME##_pass(w, stride, x, 1, k, out); break;                                            \
        case 2: NAME##_pass(w, stride, x, 2, k, out); break;                                            \
        case 3: NAME##_pass(w, stride, x, 3, k, out); break;                                            \
        default: NAME##_pass(w, stride, x, 4, k, out); break;                                           \
        }                                                                                               \
    }
DEFINE_AVX2_FOUR(avx2_f16_x4, uint16_t, load8_f16, f16_to_f32)
DEFINE_AVX2_FOUR(avx2_bf16_x4, uint16_t, load8_bf16, bf16_to_f32)

/* Each product for 1..ROWS_AT_ONCE input rows with the count a constant (registers for the sums). */
#define BY_COUNT(NAME)                                                                                  \
    static void NAME(const void *w, const void *const *x, int nx, int64_t nb, float *out) {            \
        switch (nx) {                                                                                   \
        case 1: NAME##_n(w, x, 1, nb, out); break;                                                     \
        case 2: NAME##_n(w, x, 2, nb, out); break;                                                     \
        case 3: NAME##_n(w, x, 3, nb, out); break;                                                     \
        case 4: NAME##_n(w, x, 4, nb, out); break;                                                     \
        case 5: NAME##_n(w, x, 5, nb, out); break;                                                     \
        case 6: NAME##_n(w, x, 6, nb, out); break;                                                     \
        case 7: NAME##_n(w, x, 7, nb, out); break;                                                     \
        default: NAME##_n(w, x, 8, nb, out); break;                                                    \
        }                                                                                               \
    }
BY_COUNT(avx2_q4_0)
BY_COUNT(avx2_q4_1)
BY_COUNT(avx2_q5_0)
BY_COUNT(avx2_q5_1)
BY_COUNT(avx2_q8_0)
/* At most 4 input rows a pass: the K family holds three sums a row; more spill them from the registers. */
#define BY_FOURS(NAME)                                                                                  \
    static void NAME(const void *w, const void *const *x, int nx, int64_t nb, float *out) {            \
        for (; nx > 4; nx -= 4, x += 4, out += 4) NAME##_n(w, x, 4, nb, out);                           \
        switch (nx) {                                                                                   \
        case 1: NAME##_n(w, x, 1, nb, out); break;                                                     \
        case 2: NAME##_n(w, x, 2, nb, out); break;                                                     \
        case 3: NAME##_n(w, x, 3, nb, out); break;                                                     \
        default: NAME##_n(w, x, 4, nb, out); break;                                                    \
        }                                                                                               \
    }
BY_FOURS(avx2_q4_K)
BY_FOURS(avx2_q5_K)
BY_COUNT(avx2_q4_K_x8)
BY_COUNT(avx2_q6_K_x8)
BY_COUNT(avx2_q6_K)
BY_COUNT(avx2_f32)
BY_COUNT(avx2_f16)
BY_COUNT(avx2_bf16)
#endif

/* One weight row (of `count` blocks, or floats) against up to ROWS_AT_ONCE input rows; an interleaved
   type's eight rows at once (out[8 r + i]). */
typedef void (*row_product)(const void *, const void *const *, int, int64_t, float *);

/* The plain C products even where AVX2's are built (blocks_plain: the tests compare the two) */
static int plain_only = 0;

int blocks_plain(int on) {
    plain_only = on;
    return BLOCKS_AVX2;
}

static row_product product_of(int64_t type) {
#if BLOCKS_AVX2
    if (!plain_only) switch (type) {
    case T_Q4_0: return avx2_q4_0;
    case T_Q4_1: return avx2_q4_1;
    case T_Q5_0: return avx2_q5_0;
    case T_Q5_1: return avx2_q5_1;
    case T_Q8_0: return avx2_q8_0;
    case T_Q4_K: return avx2_q4_K;
    case T_Q4_K_X8: return avx2_q4_K_x8;
    case T_Q6_K_X8: return avx2_q6_K_x8;
    case T_Q5_K: return avx2_q5_K;
    case T_Q6_K: return avx2_q6_K;
    case T_F32: return avx2_f32;
    case T_F16: return avx2_f16;
    case T_BF16: return avx2_bf16;
    }
#endif
    switch (type) {
    case T_Q4_0: return plain_q4_0;
    case T_Q4_1: return plain_q4_1;
    case T_Q5_0: return plain_q5_0;
    case T_Q5_1: return plain_q5_1;
    case T_Q8_0: return plain_q8_0;
    case T_Q4_K: return plain_q4_K;
    case T_Q4_K_X8: return plain_q4_K_x8;
    case T_Q6_K_X8: return plain_q6_K_x8;
    case T_Q5_K: return plain_q5_K;
    case T_Q6_K: return plain_q6_K;
    case T_F32: return plain_f32;
    case T_F16: return plain_f16;
    case T_BF16: return plain_bf16;
    }
    return NULL;
}

/* Four float rows `stride` weights apart (F16_X4, BF16_X4) against up to ROWS_AT_ONCE input rows */
typedef void (*four_product)(const void *, int64_t, const void *const *, int, int64_t, float *);

static four_product four_of(int64_t type) {
#if BLOCKS_AVX2
    if (!plain_only) return type == T_F16_X4 ? avx2_f16_x4 : avx2_bf16_x4;
#endif
    return type == T_F16_X4 ? plain_f16_x4 : plain_bf16_x4;
}

/* --- the threads --------------------------------------------------------------------------------------- */

/* A job: work(context, task) for tasks 0..tasks-1, which the calling thread and the helpers claim one at
   a time until none is left: a thread the system holds up (another process on its core) leaves its
   share to the others, and nobody waits for a helper that claimed nothing. Helpers wait for jobs
   spinning a little (a step's products come one after another), then on a futex. */
typedef void (*job_fn)(void *context, int64_t task);

#define MAX_THREADS 256
#define SPIN_NS 200000
/* the claim word: the job's number (24 bits), its tasks (20), the next task to claim (20) */
#define CLAIM_BITS 20
#define CLAIM_MASK ((1ull << CLAIM_BITS) - 1)
#define MAX_TASKS ((int64_t)CLAIM_MASK)

static struct {
    pthread_mutex_t lock;
    int started;                 /* threads running beside the caller */
    int wanted;                  /* threads a job is split between, the caller included */
    _Atomic uint32_t generation; /* bumped for each job: what helpers wait on */
    _Atomic uint64_t claim;      /* the current job's claim word */
    _Atomic int64_t finished;    /* its tasks done */
    job_fn work;
    void *context;
} pool = {PTHREAD_MUTEX_INITIALIZER, 0, 1, 0, 0, 0, NULL, NULL};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void wait_for(uint32_t seen) {
    int64_t deadline = now_ns() + SPIN_NS;
    unsigned spins = 0;
    while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
        if (++spins % 64 || now_ns() < deadline) {
            relax();
            continue;
        }
#if defined(__linux__)
        syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
}

/* Claim and run the current job's tasks until none is left. A claim succeeds only on the word of a job
   whose tasks are not all claimed, and the caller waits until every claimed task is done before it
   starts another job: the work and context read after a claim are that job's. */
static void take_tasks(void) {
    uint64_t word = atomic_load_explicit(&pool.claim, memory_order_acquire);
    for (;;) {
        uint64_t next = word & CLAIM_MASK, tasks = (word >> CLAIM_BITS) & CLAIM_MASK;
        if (next >= tasks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &word, word + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        pool.work(pool.context, (int64_t)next);
        atomic_fetch_add_explicit(&pool.finished, 1, memory_order_acq_rel);
        word = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *helper_main(void *argument) {
    int number = (int)(intptr_t)argument; /* 1.. : the caller is 0 */
    uint32_t seen = 0;
    for (;;) {
        wait_for(seen);
        seen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (number < pool.wanted) take_tasks();
    }
    return NULL;
}

/* A forked child has none of its parent's threads: it starts its own at its next blocks_threads,
   and runs its products alone until then (else it would wait for helpers that do not exist). */
static void forked(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.started = 0;
    pool.wanted = 1;
}

static void register_forked(void) { pthread_atfork(NULL, NULL, forked); }

/* Products split between `threads` threads from now on, the caller's included (1: the caller alone).
   Returns how many there are. */
int blocks_threads(int threads) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    pthread_once(&once, register_forked);
    pthread_mutex_lock(&pool.lock);
    while (pool.started < threads - 1) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&thread, &attributes, helper_main, (void *)(intptr_t)(pool.started + 1));
        pthread_attr_destroy(&attributes);
        if (failed) break;
        pool.started++;
    }
    pool.wanted = pool.started + 1 < threads ? pool.started + 1 : threads;
    int wanted = pool.wanted;
    pthread_mutex_unlock(&pool.lock);
    return wanted;
}

static void run_job(job_fn work, void *context, int64_t tasks) {
    if (tasks <= 1 || pool.started == 0 || pool.wanted <= 1 || tasks > MAX_TASKS) {
        for (int64_t task = 0; task < tasks; task++) work(context, task);
        return;
    }
    pthread_mutex_lock(&pool.lock); /* one job at a time in this process */
    static uint32_t number = 0;
    number = (number + 1) & 0xFFFFFF;
    pool.work = work;
    pool.context = context;
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.claim, ((uint64_t)number << (2 * CLAIM_BITS)) | ((uint64_t)tasks << CLAIM_BITS),
                          memory_order_release);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_acq_rel);
#if defined(__linux__)
    syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, pool.wanted - 1, NULL, NULL, 0);
#endif
    take_tasks();
    /* the tasks helpers claimed; yield now and then, in case one waits for this core */
    for (unsigned spins = 1; atomic_load_explicit(&pool.finished, memory_order_acquire) < tasks; spins++) {
        if (spins % 1024) relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.lock);
}

/* --- the products ------------------------------------------------------------------------------------ */

typedef struct {
    const void *data; /* the tensor's first block */
    int64_t type;     /* its GGML type */
    int64_t rows;     /* its weight rows (output columns) */
} part;

typedef struct {
    const part *parts;
    int64_t nparts, k, nx, columns; /* columns: all parts' rows */
    const uint8_t *inputs[A_KINDS]; /* the inputs in each form the parts take */
    int64_t input_bytes[A_KINDS];
    float *out;                     /* [nx, columns] */
} product_job;

/* The input rows r..r+n-1 in the form a part takes */
static int input_rows(const product_job *job, int activation, int64_t r, int64_t r1, const void **x) {
    int n = r1 - r < ROWS_AT_ONCE ? (int)(r1 - r) : ROWS_AT_ONCE;
    for (int i = 0; i < n; i++) x[i] = job->inputs[activation] + (r + i) * job->input_bytes[activation];
    return n;
}

/* Rows first..last-1 of a part of float rows taken four at a time (F16_X4, BF16_X4), the first at
   `start` of the columns: pass i takes rows first + i + o * spread (o = 0..3, spread a quarter of the
   rows), so that each of the four streams reads its quarter's rows one after another. Four rows side by
   side sent each stream a few KB further at every pass, which the hardware's prefetcher does not follow
   (docs/performance.md, "GGUF weights in their own blocks"). */
static void four_columns(const product_job *job, const part *w, int64_t first, int64_t last, int64_t start) {
    four_product product = four_of(w->type);
    const int64_t k = job->k, spread = (last - first) / 4;
    for (int64_t r0 = 0; r0 < job->nx; r0 += TILE_INPUTS) {
        int64_t r1 = r0 + TILE_INPUTS < job->nx ? r0 + TILE_INPUTS : job->nx;
        for (int64_t i = 0; i < spread; i++) {
            const void *row = (const uint16_t *)w->data + (first + i) * k;
            for (int64_t r = r0; r < r1; r += ROWS_AT_ONCE) {
                const void *x[ROWS_AT_ONCE];
                float sums[ROWS_AT_ONCE * 4];
                int n = input_rows(job, A_F32, r, r1, x);
                product(row, spread * k, x, n, k, sums);
                for (int q = 0; q < n; q++)
                    for (int64_t o = 0; o < 4; o++)
                        job->out[(r + q) * job->columns + start + first + i + o * spread] = sums[q * 4 + o];
            }
        }
    }
}

/* Output columns c0..c1-1 of every input row. */
static void product_columns(const product_job *job, int64_t c0, int64_t c1) {
    int64_t start = 0;
    for (int64_t p = 0; p < job->nparts && start < c1; start += job->parts[p].rows, p++) {
        const part *w = &job->parts[p];
        int64_t first = c0 > start ? c0 - start : 0, last = c1 - start < w->rows ? c1 - start : w->rows;
        if (first >= last) continue;
        type_info info;
        type_of(w->type, &info);
        if (info.rows == 4) {
            four_columns(job, w, first, last, start);
            continue;
        }
        row_product product = product_of(w->type);
        /* bytes of a row of blocks (of info.rows weight rows: first and last are multiples of it) */
        int64_t count = job->k / info.block, row_bytes = count * info.bytes, g = info.rows;
        for (int64_t r0 = 0; r0 < job->nx; r0 += TILE_INPUTS) {
            int64_t r1 = r0 + TILE_INPUTS < job->nx ? r0 + TILE_INPUTS : job->nx;
            for (int64_t c = first; c < last; c += g) {
                const void *row = (const uint8_t *)w->data + c / g * row_bytes;
                for (int64_t r = r0; r < r1; r += ROWS_AT_ONCE) {
                    const void *x[ROWS_AT_ONCE];
                    float sums[ROWS_AT_ONCE * 8];
                    int n = input_rows(job, info.activation, r, r1, x);
                    product(row, x, n, count, sums);
                    for (int i = 0; i < n; i++)
                        for (int64_t o = 0; o < g; o++) job->out[(r + i) * job->columns + start + c + o] = sums[i * g + o];
                }
            }
        }
    }
}

/* A task: whole tiles of weight rows, so that threads do not write the same cache lines; one for a
   prompt's rows (much work already), else TASKS_A_THREAD to a thread for one input row: each task's
   rows lie one after another in memory, and the hardware's prefetcher runs on through them where tasks
   of a few tiles sent each thread elsewhere every few KB. Several input rows are compute-bound: there
   finer tasks (TASKS_A_THREAD_ROWS) even out a core that starts late or runs slower (docs/performance.md,
   "GGUF weights in their own blocks"). */
static int64_t tiles_a_task(const product_job *job) {
    if (job->nx >= TILE_INPUTS) return 1;
    const int64_t tiles = (job->columns + TILE_WEIGHTS - 1) / TILE_WEIGHTS,
                  split = (job->nx > 1 ? TASKS_A_THREAD_ROWS : TASKS_A_THREAD) * pool.wanted;
    const int64_t take = (tiles + split - 1) / split;
    return take > TILES_TAKEN ? take : TILES_TAKEN;
}

static void product_task(void *context, int64_t task) {
    const product_job *job = context;
    const int64_t take = tiles_a_task(job), first = task * take * TILE_WEIGHTS;
    product_columns(job, first, first + take * TILE_WEIGHTS < job->columns ? first + take * TILE_WEIGHTS : job->columns);
}

/* out [nx, sum of rows] = x [nx, k] (float32) times the parts' rows. Returns 0; -1 for a type it does not
   take or a k not a multiple of a part's block; -2 where memory for the quantised inputs ran out. */
int blocks_matmul(const float *x, int64_t nx, int64_t k, const part *parts, int64_t nparts, float *out) {
    product_job job = {parts, nparts, k, nx, 0, {NULL}, {0}, out};
    if (nx <= 0) return 0;
    int needed[A_KINDS] = {0};
    for (int64_t p = 0; p < nparts; p++) {
        type_info info;
        /* interleaved rows start and end on their groups: the threads' shares are tiles of TILE_WEIGHTS */
        if (type_of(parts[p].type, &info) || k % info.block || parts[p].rows % info.rows ||
            job.columns % info.rows || TILE_WEIGHTS % info.rows)
            return -1;
        needed[info.activation] = 1;
        job.columns += parts[p].rows;
    }
    uint8_t *buffers[A_KINDS] = {NULL};
    int status = 0;
    for (int kind = 0; kind < A_KINDS; kind++) {
        if (!needed[kind]) continue;
        if (kind == A_F32) { /* float inputs as they are */
            job.inputs[kind] = (const uint8_t *)x;
            job.input_bytes[kind] = k * (int64_t)sizeof(float);
            continue;
        }
        job.input_bytes[kind] = act_bytes(kind, k);
        buffers[kind] = malloc((size_t)(job.input_bytes[kind] * nx));
        if (!buffers[kind]) { status = -2; break; }
        for (int64_t r = 0; r < nx; r++) quantize_row(kind, x + r * k, k, buffers[kind] + r * job.input_bytes[kind]);
        job.inputs[kind] = buffers[kind];
    }
    if (status == 0) {
        int64_t tiles = (job.columns + TILE_WEIGHTS - 1) / TILE_WEIGHTS, take = tiles_a_task(&job);
        run_job(product_task, &job, (tiles + take - 1) / take);
    }
    for (int kind = 0; kind < A_KINDS; kind++) free(buffers[kind]);
    return status;
}

/* --- interleaved rows -------------------------------------------------------------------------------- */

/* dst = the Q4_K or Q6_K tensor src (rows x k) with each eight rows interleaved (block_q4_K_x8,
   block_q6_K_x8). Returns 0; -1 for another type, rows not a multiple of 8, or k not of whole super-blocks. */
static void interleave_q6_K(const block_q6_K *in, int64_t rows, int64_t nb, block_q6_K_x8 *out) {
    for (int64_t group = 0; group < rows / 8; group++)
        for (int64_t i = 0; i < nb; i++, out++)
            for (int row = 0; row < 8; row++) {
                const block_q6_K *b = &in[(group * 8 + row) * nb + i];
                out->d[row] = b->d;
                for (int g = 0; g < 16; g++) out->scales[g / 2][2 * row + g % 2] = b->scales[g];
                for (int half = 0; half < 2; half++)
                    for (int g = 0; g < 8; g++) {
                        memcpy(&out->q[half][g][0][4 * row], b->ql + 64 * half + 4 * g, 4);
                        memcpy(&out->q[half][g][1][4 * row], b->ql + 64 * half + 32 + 4 * g, 4);
                        memcpy(&out->q[half][g][2][4 * row], b->qh + 32 * half + 4 * g, 4);
                    }
            }
}

int blocks_interleave(const void *src, int64_t type, int64_t rows, int64_t k, void *dst) {
    if ((type != T_Q4_K && type != T_Q6_K) || rows % 8 || k % QK_K) return -1;
    if (type == T_Q6_K) {
        interleave_q6_K(src, rows, k / QK_K, dst);
        return 0;
    }
    const int64_t nb = k / QK_K;
    const block_q4_K *in = src;
    block_q4_K_x8 *out = dst;
    for (int64_t group = 0; group < rows / 8; group++)
        for (int64_t i = 0; i < nb; i++, out++)
            for (int row = 0; row < 8; row++) {
                const block_q4_K *b = &in[(group * 8 + row) * nb + i];
                out->d[row] = b->d;
                out->dmin[row] = b->dmin;
                for (int s = 0; s < 8; s++) {
                    int scale, min;
                    scale_min_k4(s, b->scales, &scale, &min);
                    out->scales[s][row] = (uint8_t)scale;
                    out->mins[s / 2][2 * row + s % 2] = (uint8_t)min;
                }
                for (int j = 0; j < 4; j++)
                    for (int g = 0; g < 8; g++) memcpy(&out->qs[j][g][4 * row], b->qs + 32 * j + 4 * g, 4);
            }
    return 0;
}

/* --- rows as float32 ------------------------------------------------------------------------------------ */

static void row_q4_0(const void *data, int64_t k, float *y) {
    const block_q4_0 *b = data;
    for (int64_t i = 0; i < k / QK; i++, y += QK) {
        float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)((b[i].qs[j] & 0xF) - 8);
            y[j + QK / 2] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

static void row_q4_1(const void *data, int64_t k, float *y) {
    const block_q4_1 *b = data;
    for (int64_t i = 0; i < k / QK; i++, y += QK) {
        float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)(b[i].qs[j] & 0xF) + m;
            y[j + QK / 2] = d * (float)(b[i].qs[j] >> 4) + m;
        }
    }
}

static void row_q5_0(const void *data, int64_t k, float *y) {
    const block_q5_0 *b = data;
    for (int64_t i = 0; i < k / QK; i++, y += QK) {
        float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)(((b[i].qs[j] & 0xF) | fifth(b[i].qh, j)) - 16);
            y[j + QK / 2] = d * (float)(((b[i].qs[j] >> 4) | fifth(b[i].qh, j + QK / 2)) - 16);
        }
    }
}

static void row_q5_1(const void *data, int64_t k, float *y) {
    const block_q5_1 *b = data;
    for (int64_t i = 0; i < k / QK; i++, y += QK) {
        float d = f16_to_f32(b[i].d), m = f16_to_f32(b[i].m);
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)((b[i].qs[j] & 0xF) | fifth(b[i].qh, j)) + m;
            y[j + QK / 2] = d * (float)((b[i].qs[j] >> 4) | fifth(b[i].qh, j + QK / 2)) + m;
        }
    }
}

static void row_q8_0(const void *data, int64_t k, float *y) {
    const block_q8_0 *b = data;
    for (int64_t i = 0; i < k / QK; i++, y += QK) {
        float d = f16_to_f32(b[i].d);
        for (int j = 0; j < QK; j++) y[j] = d * (float)b[i].qs[j];
    }
}

static void row_k(const uint8_t *scales, float d, float dmin, const uint8_t *codes, float *y) {
    for (int j = 0; j < 8; j++) {
        int scale, min;
        scale_min_k4(j, scales, &scale, &min);
        for (int l = 0; l < 32; l++) y[32 * j + l] = d * (float)scale * (float)codes[32 * j + l] - dmin * (float)min;
    }
}

static void row_q4_K(const void *data, int64_t k, float *y) {
    const block_q4_K *b = data;
    uint8_t codes[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++, y += QK_K) {
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                codes[64 * j + l] = b[i].qs[32 * j + l] & 0xF;
                codes[64 * j + 32 + l] = b[i].qs[32 * j + l] >> 4;
            }
        row_k(b[i].scales, f16_to_f32(b[i].d), f16_to_f32(b[i].dmin), codes, y);
    }
}

static void row_q5_K(const void *data, int64_t k, float *y) {
    const block_q5_K *b = data;
    uint8_t codes[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++, y += QK_K) {
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) {
                codes[64 * j + l] = (b[i].qs[32 * j + l] & 0xF) | (((b[i].qh[l] >> (2 * j)) & 1) << 4);
                codes[64 * j + 32 + l] = (b[i].qs[32 * j + l] >> 4) | (((b[i].qh[l] >> (2 * j + 1)) & 1) << 4);
            }
        row_k(b[i].scales, f16_to_f32(b[i].d), f16_to_f32(b[i].dmin), codes, y);
    }
}

static void row_q6_K(const void *data, int64_t k, float *y) {
    const block_q6_K *b = data;
    for (int64_t i = 0; i < k / QK_K; i++) {
        float d = f16_to_f32(b[i].d);
        for (int half = 0; half < 2; half++, y += 128) {
            const uint8_t *ql = b[i].ql + 64 * half, *qh = b[i].qh + 32 * half;
            const int8_t *sc = b[i].scales + 8 * half;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                y[l] = d * sc[is] * (float)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = d * sc[is + 2] * (float)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = d * sc[is + 4] * (float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = d * sc[is + 6] * (float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
    }
}

static void row_f32(const void *data, int64_t k, float *y) { memcpy(y, data, (size_t)k * sizeof(float)); }
static void row_f16(const void *data, int64_t k, float *y) {
    for (int64_t j = 0; j < k; j++) y[j] = f16_to_f32(((const uint16_t *)data)[j]);
}
static void row_bf16(const void *data, int64_t k, float *y) {
    for (int64_t j = 0; j < k; j++) y[j] = bf16_to_f32(((const uint16_t *)data)[j]);
}

/* out [n, k] = rows ids[0..n-1] of a tensor of `rows` rows of k in `type`, as float32. Returns 0; -1 for a
   type it does not take, or an id outside the tensor. */
int blocks_rows(const void *data, int64_t type, int64_t k, int64_t rows, const int64_t *ids, int64_t n, float *out) {
    type_info info;
    if (type == T_F16_X4 || type == T_BF16_X4) type -= 1000; /* the file's rows as they are */
    if (type_of(type, &info) || k % info.block || info.rows != 1) return -1;
    void (*row)(const void *, int64_t, float *) = NULL;
    switch (type) {
    case T_Q4_0: row = row_q4_0; break;
    case T_Q4_1: row = row_q4_1; break;
    case T_Q5_0: row = row_q5_0; break;
    case T_Q5_1: row = row_q5_1; break;
    case T_Q8_0: row = row_q8_0; break;
    case T_Q4_K: row = row_q4_K; break;
    case T_Q5_K: row = row_q5_K; break;
    case T_Q6_K: row = row_q6_K; break;
    case T_F32: row = row_f32; break;
    case T_F16: row = row_f16; break;
    default: row = row_bf16; break;
    }
    int64_t row_bytes = k / info.block * info.bytes;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= rows) return -1;
        row((const uint8_t *)data + ids[i] * row_bytes, k, out + i * k);
    }
    return 0;
}

/* The inputs x [nx, k] as the products of `type` see them, as float32 (codes times scales). Returns 0, or
   -1 as blocks_matmul. */
int blocks_quantize(const float *x, int64_t nx, int64_t k, int64_t type, float *out) {
    type_info info;
    if (type_of(type, &info) || k % info.block) return -1;
    int64_t bytes = act_bytes(info.activation, k);
    uint8_t *buffer = malloc((size_t)bytes);
    if (!buffer) return -2;
    for (int64_t r = 0; r < nx; r++, x += k, out += k) {
        quantize_row(info.activation, x, k, buffer);
        if (info.activation == A_F32) {
            memcpy(out, buffer, (size_t)k * sizeof(float));
        } else if (info.activation == A_Q8_K) {
            const act_q8_K *a = (const act_q8_K *)buffer;
            for (int64_t j = 0; j < k; j++) out[j] = a[j / QK_K].d * (float)a[j / QK_K].qs[j % QK_K];
        } else {
            const act_q8 *a = (const act_q8 *)buffer;
            for (int64_t j = 0; j < k; j++) out[j] = a[j / QK].d * (float)a[j / QK].qs[j % QK];
        }
    }
    free(buffer);
    return 0;
}
