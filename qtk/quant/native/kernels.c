/* qtk's native CPU kernels (qtk/quant/native/__init__.py compiles this file on first use and checks it against the torch
 * path before trusting it; any failure falls back to torch).
 *
 * qtk_rtn: round-to-nearest of a weight [rows, cols] whose scales each cover a group of columns of one row, or a
 * tile of rows x columns, in one pass over each row while it sits in cache: the row's float32 values, each group's
 * amax and scale, the codes, the engine's decode of the codes, and the relative error's squared sums. The torch
 * path (qtk.quant.formats.*) makes ~10 passes over 2 MiB blocks for the same result. The arithmetic is the torch
 * path's IEEE float32 operations in the same order, so codes and scales are equal bit for bit (test_native_kernels.py checks
 * every fp8 and fp4 rounding case and random weights of every kind, dtype and shape):
 *
 *   kind    scale of a group (amax = max |w|, float32)                          element q of w            decode
 *   INT     s = amax / divisor (7.5, 127.5), rounded to the model dtype (h);   round-even(h(w / s)),     h(q * s)
 *           zero -> h's eps (float32 model: 1.0)                               clamped to [qmin, qmax]
 *   FP8     s = amax / 448, rounded to h; zero -> h's eps (float32: 1.0)       e4m3(clamp(h(w / s)))     q * s
 *   BLOCK   as FP8 over a tile of rows x cols; zero -> eps also in float32     e4m3(clamp(h(h(w) / s)))  h(q * s)
 *   MXFP4   2^(e - 2), e the exponent of amax rounded to a power of two        e2m1(clamp(w / s, 6))     h(q * s)
 *           (up from a 1.75 mantissa); E8M0, clamped to codes 0..254
 *   NVFP4   s = e4m3(clamp(gs * h(amax / 6), 448)), zero -> 0.125;            e2m1(clamp(w / (s / gs))) h(q * s / gs)
 *           gs the tensor's (or fusion group's) global scale, given
 *
 * h: rounding to the model dtype (bf16 / fp16, nearest even; none for a float32 model). e4m3 and e2m1: nearest,
 * ties to even, with subnormals and the sign of values that round to zero kept. Compile with -ffp-contract=off: a
 * fused multiply-add would round once where the torch path rounds twice.
 *
 * qtk_sq_rows: per row, sum (dec - ref)^2 and sum ref^2 in float64: the difference rounded to float32 (as the torch
 * path forms it), its square exact in float64, added in eight lanes by column (j % 8) combined pairwise. The rounding
 * kernel sums its rows the same way, so the stream's error and the module loop's are the same number.
 * qtk_block_sums: those row sums added in order, `step` rows per block (qtk.quant.error's blocks).
 *
 * Rows (tile rows for BLOCK) are split over `threads` POSIX threads in contiguous ranges; every figure is per row,
 * so results do not depend on the thread count. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
enum { KIND_INT = 0, KIND_FP8 = 1, KIND_BLOCK = 2, KIND_MXFP4 = 3, KIND_NVFP4 = 4 };

typedef struct {
    const void *w;          /* [rows, cols], in_dtype, contiguous */
    int64_t rows, cols;
    int64_t group;          /* columns per scale (the last group of a BLOCK row may be narrower) */
    int64_t group_rows;     /* rows per scale: 1, or the BLOCK tile's height */
    int32_t in_dtype;       /* DT_* of w */
    int32_t half;           /* DT_* of the model: what h rounds to (DT_F32: no rounding) */
    int32_t kind;           /* KIND_* */
    int32_t want_error;     /* compute row_e / row_w / hi */
    float divisor;          /* INT, FP8, BLOCK: amax / divisor = scale */
    float qmin, qmax;       /* INT grid */
    float zero_scale;       /* INT, FP8, BLOCK: what a zero scale becomes */
    float global_scale;     /* NVFP4 */
    void *values;           /* [rows, cols]: int8 codes, e4m3 bytes or e2m1 codes (uint8, unpacked) */
    float *scale;           /* [ceil(rows / group_rows), ceil(cols / group)] */
    double *row_e, *row_w;  /* [rows] */
    float *hi;              /* [threads]: max |decoded weight| */
    int32_t *bad;           /* [threads]: a value or scale not finite (the caller redoes the weight in torch) */
} qtk_rtn_args;

#define INLINE static inline __attribute__((always_inline))

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* round half to even for |t| < 2^22, by the float adder itself (the default rounding mode; without -ffast-math the
   compiler keeps both operations): vectorises where roundevenf does not */
INLINE float round_even_small(float t) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (t + magic) - magic;
}

/* nearest even; finite inputs (a weight holding NaN/Inf is flagged and redone in torch) */
INLINE float round_bf16(float f) {
    uint32_t u = bits_of_f32(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return f32_of_bits(u & 0xffff0000u);
}

/* f rounded to float16 and back, nearest even: 10 mantissa bits from 2^-14, multiples of 2^-24 below (subnormals),
   Inf from 65520 (integer and float ops only, so it vectorises without AVX512-FP16) */
INLINE float round_f16(float f) {
    uint32_t u = bits_of_f32(f), sign = u & 0x80000000u, a = u & 0x7fffffffu;
    uint32_t n = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;
    n = n > 0x477fe000u ? 0x7f800000u : n;
    float sub = round_even_small(f32_of_bits(a < 0x38800000u ? a : 0u) * 16777216.0f) * (1.0f / 16777216.0f);
    return f32_of_bits(sign | (a < 0x38800000u ? bits_of_f32(sub) : n));
}

/* `dt` is a constant at every call (the callers are specialised per dtype), so this folds to one branch */
INLINE float round_to(float f, const int dt) {
    return dt == DT_BF16 ? round_bf16(f) : dt == DT_F16 ? round_f16(f) : f;
}

INLINE float f16_value(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    uint32_t normal = e == 31u ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13);
    float sub = (float)m * (1.0f / 16777216.0f);
    return f32_of_bits(sign | (e ? normal : bits_of_f32(sub)));
}

static void load_row(const void *w, int dt, int64_t off, int64_t n, float *out) {
    if (dt == DT_F32) {
        memcpy(out, (const float *)w + off, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        const uint16_t *p = (const uint16_t *)w + off;
        for (int64_t j = 0; j < n; j++) out[j] = f32_of_bits((uint32_t)p[j] << 16);
    } else {
        const uint16_t *p = (const uint16_t *)w + off;
        for (int64_t j = 0; j < n; j++) out[j] = f16_value(p[j]);
    }
}

/* x rounded to the nearest e4m3 value, |x| <= 448 (clamped before; nearest even, below 2^-6 in units of 2^-9, the
   subnormals), in float bits alone, with no code byte in between (the group loop of NVFP4's scales vectorises with
   it, not with e4m3_code_value) */
INLINE float e4m3_round(float x) {
    uint32_t u = bits_of_f32(x), sign = u & 0x80000000u, a = u & 0x7fffffffu;
    uint32_t normal = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;
    float sub = round_even_small(f32_of_bits(a < 0x3c800000u ? a : 0u) * 512.0f) * (1.0f / 512.0f);
    return f32_of_bits(sign | (a >= 0x3c800000u ? normal : bits_of_f32(sub)));
}

/* e4m3 code of x and its value (e4m3_round(x)) from one rounding, |x| <= 448: sign bit 7, exponent bits 3-6 (bias 7),
   mantissa bits 0-2 */
INLINE float e4m3_code_value(float x, uint8_t *code) {
    uint32_t u = bits_of_f32(x), sign = u & 0x80000000u, a = u & 0x7fffffffu;
    uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    float m = round_even_small(f32_of_bits(a < 0x3c800000u ? a : 0u) * 512.0f);  /* subnormal: units of 2^-9 */
    uint32_t c = a >= 0x3c800000u ? (r >> 20) - (120u << 3) : (uint32_t)m;
    float mag = a >= 0x3c800000u ? f32_of_bits(r & 0xfff00000u) : m * (1.0f / 512.0f);
    *code = (uint8_t)((sign >> 24) | c);
    return f32_of_bits(sign | bits_of_f32(mag));
}

/* e2m1 code of x, |x| <= 6 (clamped before): the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even code
   (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); sign bit 3 when x < 0 */
INLINE uint8_t e2m1_code(float x) {
    float a = fabsf(x);
    uint32_t m = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) + (uint32_t)(a >= 1.75f)
               + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) + (uint32_t)(a > 5.0f);
    return (uint8_t)(m | ((uint32_t)(x < 0.0f) << 3));
}

INLINE float e2m1_value(uint8_t c) {
    float m = (float)(c & 7u);
    float mag = m < 5.0f ? m * 0.5f : (m == 7.0f ? 6.0f : m - 2.0f);
    return (c & 8u) ? -mag : mag;
}

typedef float v8f __attribute__((vector_size(32)));
typedef double v8d __attribute__((vector_size(64)));

/* Lane k holds the columns j with j % 8 == k (GCC / Clang vector extensions: the same lane arithmetic on any
   target; one AVX-512 register, or two AVX2 ones). */
INLINE void sq_row(const float *d, const float *r, int64_t n, double *e_out, double *w_out) {
    v8d ae = {0}, aw = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f dv, rv;
        memcpy(&dv, d + j, sizeof dv);
        memcpy(&rv, r + j, sizeof rv);
        v8d x = __builtin_convertvector(dv - rv, v8d), y = __builtin_convertvector(rv, v8d);
        ae += x * x;
        aw += y * y;
    }
    for (; j < n; j++) {
        double x = (double)(d[j] - r[j]), y = (double)r[j];
        ae[j & 7] += x * x;
        aw[j & 7] += y * y;
    }
    *e_out = ((ae[0] + ae[1]) + (ae[2] + ae[3])) + ((ae[4] + ae[5]) + (ae[6] + ae[7]));
    *w_out = ((aw[0] + aw[1]) + (aw[2] + aw[3])) + ((aw[4] + aw[5]) + (aw[6] + aw[7]));
}

/* max |x| of n floats as bits (for non-negative floats the integer order is the float order; NaN > Inf) */
INLINE uint32_t amax_bits(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t b = bits_of_f32(x[j]) & 0x7fffffffu;
        m = b > m ? b : m;
    }
    return m;
}

/* The stored scale of a group from its amax (bits), per the table above (the scheme's constants passed in registers:
   the group loop below vectorises). */
INLINE float group_scale(uint32_t mb, float divisor, float zero_scale, float global_scale, const int half,
                         const int kind) {
    float m = f32_of_bits(mb);
    if (kind == KIND_MXFP4) {
        int32_t e = (int32_t)(((mb + (1u << 21)) >> 23) & 0xffu);  /* exponent of amax rounded to a power of two */
        int32_t code = e - 2 > 0 ? e - 2 : 0;   /* 127 + log2(pow2) - 2, 0 for a zero or tiny amax */
        code = code == 253 ? 254 : code;          /* e 255: rounded past the largest float (+Inf), clamped to 254 */
        return f32_of_bits(code ? (uint32_t)code << 23 : 0x00400000u);  /* 2^(code - 127) */
    }
    if (kind == KIND_NVFP4) {
        float t = global_scale * round_to(m / 6.0f, half);
        t = t > 448.0f ? 448.0f : t;
        float s = e4m3_round(t);
        return s == 0.0f ? 0.125f : s;
    }
    float s = round_to(m / divisor, half);
    return s > 0.0f ? s : zero_scale;
}

/* The scales of ng groups from their amax (bits), and each one's divisor (NVFP4: s / gs, formed first in float32).
   One branch-free loop over the groups, vectorised: for 16-column NVFP4 groups a scalar group at a time cost as
   much as the rounding itself. Returns 0 when an amax or a scale is not finite. */
INLINE int group_scales(const uint32_t *restrict tmax, int64_t ng, const qtk_rtn_args *a, float *restrict scale,
                        float *restrict dv, const int half, const int kind) {
    const float divisor = a->divisor, zero = a->zero_scale, gs = a->global_scale;
    uint32_t bad = 0;  /* bit 31: some |x| >= 0x7f800000 (Inf or NaN) among the amax and scales (x + 2^23 carries) */
    for (int64_t g = 0; g < ng; g++) {
        const uint32_t mb = tmax[g];
        const float s = group_scale(mb, divisor, zero, gs, half, kind);
        bad |= (mb + 0x00800000u) | ((bits_of_f32(s) & 0x7fffffffu) + 0x00800000u);
        scale[g] = s;
        dv[g] = kind == KIND_NVFP4 ? s / gs : s;
    }
    return !(bad >> 31);
}

/* Each group's amax (bits) of one row of `cols` values, groups of G (the last one may be narrower); 16 and 32 are
   compile-time sizes here, so each group is one or two vector operations and a reduction, not a short loop. */
INLINE void row_group_amax(const float *x, int64_t cols, int64_t G, uint32_t *out) {
    const int64_t ng = (cols + G - 1) / G;
    if (G == 16 && cols % 16 == 0) {
        for (int64_t g = 0; g < ng; g++) out[g] = amax_bits(x + g * 16, 16);
    } else if (G == 32 && cols % 32 == 0) {
        for (int64_t g = 0; g < ng; g++) out[g] = amax_bits(x + g * 32, 32);
    } else {
        for (int64_t g = 0; g < ng; g++) out[g] = amax_bits(x + g * G, (g + 1) * G <= cols ? G : cols - g * G);
    }
}

/* sv[j] = dv[j / G] over a row (the per-element divisors row_round reads), G a compile-time size where it can be. */
INLINE void fill_divisors(const float *restrict dv, int64_t cols, int64_t G, float *restrict sv) {
    const int64_t ng = (cols + G - 1) / G;
    if (G == 16 && cols % 16 == 0) {
        for (int64_t g = 0; g < ng; g++)
            for (int64_t k = 0; k < 16; k++) sv[g * 16 + k] = dv[g];
    } else if (G == 32 && cols % 32 == 0) {
        for (int64_t g = 0; g < ng; g++)
            for (int64_t k = 0; k < 32; k++) sv[g * 32 + k] = dv[g];
    } else {
        for (int64_t g = 0; g < ng; g++) {
            const int64_t n = (g + 1) * G <= cols ? G : cols - g * G;
            for (int64_t k = 0; k < n; k++) sv[g * G + k] = dv[g];
        }
    }
}

/* Codes and decode (df) of the n values x of a row, each under its group's divisor sv[j] (the stored scale; NVFP4:
   s / gs), or sv[0] for all when `one` (a scale per row: no row of divisors to fill and read); returns the largest
   decoded magnitude. One loop over the whole row (groups of 16 or 32 are shorter than a vector loop's stride). */
INLINE float row_round(const float *x, int64_t n, const float *sv, const int one, const qtk_rtn_args *a, void *qv,
                       float *df, const int half, const int kind) {
    uint32_t dmax = 0;
    const float s1 = sv[0];
#define SV(j) (one ? s1 : sv[j])
    if (kind == KIND_INT) {
        int8_t *q = (int8_t *)qv;
        const float qmin = a->qmin, qmax = a->qmax;
        for (int64_t j = 0; j < n; j++) {
            float v = round_even_small(round_to(x[j] / SV(j), half));  /* |x / s| <= ~130 */
            v = v < qmin ? qmin : v;
            v = v > qmax ? qmax : v;
            q[j] = (int8_t)v;
            float d = round_to(v * SV(j), half);
            df[j] = d;
            uint32_t db = bits_of_f32(d) & 0x7fffffffu;  /* |d| as bits: an integer max reduction vectorises */
            dmax = db > dmax ? db : dmax;
        }
    } else if (kind == KIND_FP8 || kind == KIND_BLOCK) {
        uint8_t *q = (uint8_t *)qv;
        for (int64_t j = 0; j < n; j++) {
            float xi = kind == KIND_BLOCK ? round_to(x[j], half) : x[j];  /* BLOCK divides the model-dtype weight */
            float v = round_to(xi / SV(j), half);
            v = v < -448.0f ? -448.0f : v;
            v = v > 448.0f ? 448.0f : v;
            float e = e4m3_code_value(v, q + j);
            float d = kind == KIND_BLOCK ? round_to(e * SV(j), half) : e * SV(j);
            df[j] = d;
            uint32_t db = bits_of_f32(d) & 0x7fffffffu;
            dmax = db > dmax ? db : dmax;
        }
    } else {
        uint8_t *q = (uint8_t *)qv;
        for (int64_t j = 0; j < n; j++) {
            float v = x[j] / SV(j);
            v = v < -6.0f ? -6.0f : v;
            v = v > 6.0f ? 6.0f : v;
            uint8_t c = e2m1_code(v);
            q[j] = c;
            float d = round_to(e2m1_value(c) * SV(j), half);
            df[j] = d;
            uint32_t db = bits_of_f32(d) & 0x7fffffffu;
            dmax = db > dmax ? db : dmax;
        }
    }
#undef SV
    return f32_of_bits(dmax);
}

/* The rows [r0, r1) a job covers and its index t (its slot in per-thread result arrays), set by split_rows: the
   first member of every job struct below. */
typedef struct {
    int64_t r0, r1;
    int t;
} span_t;

typedef struct {
    span_t span;
    const qtk_rtn_args *a;
} job_t;

/* Rows [r0, r1) of one tile row (group_rows rows; 1 for row-wise kinds): scales first, over the whole tile, then
   each row's codes, decode and error sums. sv: a row of per-element divisors. Returns the largest decoded
   magnitude, or -1 when a value or scale is not finite. */
INLINE float tile_rows(const qtk_rtn_args *a, int64_t r0, int64_t r1, float *wf, float *df, uint32_t *tmax,
                       float *dv, float *sv, const int half, const int kind) {
    const int64_t cols = a->cols, G = a->group, ng = (cols + G - 1) / G;
    float dmax = 0.0f;
    if (r1 - r0 > 1) {  /* a tile row: every row's amax first (the rows are read twice, from cache) */
        for (int64_t g = 0; g < ng; g++) tmax[g] = 0;
        for (int64_t r = r0; r < r1; r++) {
            load_row(a->w, a->in_dtype, r * cols, cols, wf);
            for (int64_t g = 0; g < ng; g++) {
                uint32_t m = amax_bits(wf + g * G, (g + 1) * G <= cols ? G : cols - g * G);
                tmax[g] = m > tmax[g] ? m : tmax[g];
            }
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        load_row(a->w, a->in_dtype, r * cols, cols, wf);
        if (r == r0) {
            if (r1 - r0 == 1) row_group_amax(wf, cols, G, tmax);
            if (!group_scales(tmax, ng, a, a->scale + (r0 / a->group_rows) * ng, dv, half, kind)) return -1.0f;
            if (ng > 1) fill_divisors(dv, cols, G, sv);
            else sv[0] = dv[0];
        }
        uint8_t *q = (uint8_t *)a->values + r * cols;
        float m = ng > 1 ? row_round(wf, cols, sv, 0, a, q, df, half, kind) : row_round(wf, cols, sv, 1, a, q, df, half, kind);
        dmax = m > dmax ? m : dmax;
        if (a->want_error) sq_row(df, wf, cols, a->row_e + r, a->row_w + r);
    }
    return dmax;
}

#define TILE_CASE(H, K) \
    if (a->half == H && a->kind == K) m = tile_rows(a, r, r1, wf, df, tmax, dv, sv, H, K)

static void *rtn_job(void *arg) {
    const job_t *job = (const job_t *)arg;
    const qtk_rtn_args *a = job->a;
    const int64_t cols = a->cols, ng = (cols + a->group - 1) / a->group;
    float *wf = (float *)malloc((size_t)cols * 4), *df = (float *)malloc((size_t)cols * 4);
    float *sv = (float *)malloc((size_t)cols * 4);
    uint32_t *tmax = (uint32_t *)malloc((size_t)ng * 4);
    float *dv = (float *)malloc((size_t)ng * 4);
    float hi = 0.0f;
    int bad = 0;
    if (!wf || !df || !sv || !tmax || !dv) {
        bad = 2;
    }
    for (int64_t r = job->span.r0; r < job->span.r1 && !bad; r += a->group_rows) {
        const int64_t r1 = r + a->group_rows < job->span.r1 ? r + a->group_rows : job->span.r1;
        float m = -1.0f;
        TILE_CASE(DT_BF16, KIND_INT); else TILE_CASE(DT_F16, KIND_INT); else TILE_CASE(DT_F32, KIND_INT);
        else TILE_CASE(DT_BF16, KIND_FP8); else TILE_CASE(DT_F16, KIND_FP8); else TILE_CASE(DT_F32, KIND_FP8);
        else TILE_CASE(DT_BF16, KIND_BLOCK); else TILE_CASE(DT_F16, KIND_BLOCK); else TILE_CASE(DT_F32, KIND_BLOCK);
        else TILE_CASE(DT_BF16, KIND_MXFP4); else TILE_CASE(DT_F16, KIND_MXFP4); else TILE_CASE(DT_F32, KIND_MXFP4);
        else TILE_CASE(DT_BF16, KIND_NVFP4); else TILE_CASE(DT_F16, KIND_NVFP4); else TILE_CASE(DT_F32, KIND_NVFP4);
        if (m < 0.0f) {
            bad = 1;
            break;
        }
        hi = m > hi ? m : hi;
    }
    free(wf);
    free(df);
    free(sv);
    free(tmax);
    free(dv);
    a->hi[job->span.t] = hi;
    a->bad[job->span.t] = bad;
    return NULL;
}

typedef struct {
    span_t span;
    const float *d, *ref;
    int64_t cols;
    double *row_e, *row_w;
} sq_job_t;

static void *sq_rows_job(void *arg) {
    const sq_job_t *j = (const sq_job_t *)arg;
    for (int64_t r = j->span.r0; r < j->span.r1; r++)
        sq_row(j->d + r * j->cols, j->ref + r * j->cols, j->cols, j->row_e + r, j->row_w + r);
    return NULL;
}

/* Runs fn over [0, rows) in `threads` contiguous ranges, each a whole number of `unit` rows (the calling thread
   takes the first): job t (jobs[t], job_size bytes each, a span_t first) gets range t in its span. Returns the
   number of ranges. */
static int split_rows(int64_t rows, int64_t unit, int threads, void *(*fn)(void *), void *jobs, size_t job_size) {
    pthread_t tid[64];
    int started[64] = {0};
    const int64_t units = (rows + unit - 1) / unit;
    if (threads < 1) threads = 1;
    if (threads > 64) threads = 64;
    if (threads > units) threads = units > 0 ? (int)units : 1;
    for (int t = 0; t < threads; t++) {
        int64_t r0 = units * t / threads * unit, r1 = units * (t + 1) / threads * unit;
        span_t *span = (span_t *)((char *)jobs + t * job_size);
        span->r0 = r0 < rows ? r0 : rows;
        span->r1 = r1 < rows ? r1 : rows;
        span->t = t;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], NULL, fn, (char *)jobs + t * job_size) == 0;
    for (int t = 1; t < threads; t++)
        if (!started[t]) fn((char *)jobs + t * job_size);  /* no thread: run it here */
    fn(jobs);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tid[t], NULL);
    return threads;
}

/* Returns the number of threads used (hi / bad hold that many entries), or -1 on a bad argument. */
int qtk_rtn(const qtk_rtn_args *a, int threads) {
    job_t jobs[64];
    if (a->group <= 0 || a->group_rows <= 0 || a->rows < 0 || a->cols <= 0 || a->kind < 0 || a->kind > KIND_NVFP4)
        return -1;
    if (a->kind != KIND_BLOCK && (a->group_rows != 1 || a->cols % a->group)) return -1;
    for (int t = 0; t < 64; t++) jobs[t].a = a;
    return split_rows(a->rows, a->group_rows, threads, rtn_job, jobs, sizeof(job_t));
}

int qtk_sq_rows(const float *d, const float *ref, int64_t rows, int64_t cols, double *row_e, double *row_w,
                int threads) {
    sq_job_t jobs[64];
    for (int t = 0; t < 64; t++) {
        jobs[t].d = d;
        jobs[t].ref = ref;
        jobs[t].cols = cols;
        jobs[t].row_e = row_e;
        jobs[t].row_w = row_w;
    }
    return split_rows(rows, 1, threads, sq_rows_job, jobs, sizeof(sq_job_t));
}

void qtk_block_sums(const double *row, int64_t rows, int64_t step, double *out) {
    for (int64_t b = 0, r = 0; r < rows; b++) {
        double acc = row[r++];
        for (int64_t k = 1; k < step && r < rows; k++) acc += row[r++];
        out[b] = acc;
    }
}

/* Bytes -> float32 through a 256-entry table: a one-byte format's every value, made by its definition on the Python
 * side (NVFP4's fp8 and MX's E8M0 group scales, which the convert self-check decodes layer after layer). */
typedef struct {
    span_t span;
    const uint8_t *src;
    const float *lut;
    float *dst;
} lut8_job_t;

static void *lut8_job(void *arg) {
    const lut8_job_t *j = (const lut8_job_t *)arg;
    for (int64_t i = j->span.r0; i < j->span.r1; i++) j->dst[i] = j->lut[j->src[i]];
    return NULL;
}

int qtk_lut8_f32(const uint8_t *src, int64_t n, const float *lut, float *dst, int threads) {
    lut8_job_t jobs[64], proto = {.src = src, .lut = lut, .dst = dst};
    if (n < 0) return -1;
    for (int t = 0; t < 64; t++) jobs[t] = proto;
    return split_rows(n, 4096, threads, lut8_job, jobs, sizeof(lut8_job_t));
}

/* How many float32 values are not positive finite powers of two: a normal one has exponent 1..254 and no mantissa
 * bit, a subnormal one exactly one mantissa bit; zero, negatives, Inf and NaN count. (u >> 23 keeps the sign bit
 * above the exponent, so a negative value falls outside both cases.) */
typedef struct {
    span_t span;
    const uint32_t *p;
    int64_t bad;
} pow2_job_t;

static void *pow2_job(void *arg) {
    pow2_job_t *j = (pow2_job_t *)arg;
    int64_t bad = 0;
    for (int64_t i = j->span.r0; i < j->span.r1; i++) {
        const uint32_t u = j->p[i], e = u >> 23, m = u & 0x7fffffu;
        const int normal = (e - 1u < 254u) & (m == 0), subnormal = (e == 0) & (m != 0) & ((m & (m - 1u)) == 0);
        bad += !(normal | subnormal);
    }
    j->bad = bad;
    return NULL;
}

int64_t qtk_count_not_pow2(const float *p, int64_t n, int threads) {
    pow2_job_t jobs[64], proto = {.p = (const uint32_t *)p};
    if (n < 0) return -1;
    for (int t = 0; t < 64; t++) jobs[t] = proto;
    const int used = split_rows(n, 1 << 16, threads, pow2_job, jobs, sizeof(pow2_job_t));
    int64_t bad = 0;
    for (int t = 0; t < used; t++) bad += jobs[t].bad;
    return bad;
}

/* Two 4-bit codes per byte, low nibble first (compressed-tensors' int4 words on a little-endian host, and FP4's
 * packing). Unpacking: rows of `in_len` bytes -> rows of `out_len` codes, each minus `k` (uint8 arithmetic, wrapping:
 * 8 gives int4's signed values viewed as int8). Packing, the inverse: rows of `in_len` codes (uint8 or int8 bytes) ->
 * rows of `out_len` bytes, code 2i plus `k` in the low nibble of byte i, code 2i+1 in the high one; nibbles past
 * in_len are 0 (a row padded to whole int32 words). */
typedef struct {
    span_t span;
    const uint8_t *src;
    uint8_t *dst;
    int64_t in_len, out_len;
    uint8_t k;
    int pack;
} nib_job_t;

static void *nibbles_job(void *arg) {
    const nib_job_t *j = (const nib_job_t *)arg;
    const uint8_t k = j->k;
    for (int64_t r = j->span.r0; r < j->span.r1; r++) {
        const uint8_t *s = j->src + r * j->in_len;
        uint8_t *d = j->dst + r * j->out_len;
        if (j->pack) {
            const int64_t whole = j->in_len / 2;
            for (int64_t i = 0; i < whole; i++)
                d[i] = (uint8_t)(((uint8_t)(s[2 * i] + k) & 15u) | (((uint8_t)(s[2 * i + 1] + k) & 15u) << 4));
            int64_t i = whole;
            if (j->in_len & 1) d[i++] = (uint8_t)((uint8_t)(s[j->in_len - 1] + k) & 15u);
            for (; i < j->out_len; i++) d[i] = 0;
        } else {
            const int64_t whole = j->out_len / 2;
            for (int64_t i = 0; i < whole; i++) {
                d[2 * i] = (uint8_t)((s[i] & 15u) - k);
                d[2 * i + 1] = (uint8_t)((s[i] >> 4) - k);
            }
            if (j->out_len & 1) d[j->out_len - 1] = (uint8_t)((s[whole] & 15u) - k);
        }
    }
    return NULL;
}

static int run_nibbles(nib_job_t proto, int64_t rows, int threads) {
    nib_job_t jobs[64];
    if (rows < 0) return -1;
    for (int t = 0; t < 64; t++) jobs[t] = proto;
    return split_rows(rows, 1, threads, nibbles_job, jobs, sizeof(nib_job_t));
}

int qtk_unpack_nibbles(const uint8_t *src, int64_t rows, int64_t in_bytes, int64_t out_cols, uint8_t *dst, int sub,
                       int threads) {
    nib_job_t proto = {.src = src, .dst = dst, .in_len = in_bytes, .out_len = out_cols, .k = (uint8_t)sub, .pack = 0};
    return in_bytes * 2 < out_cols ? -1 : run_nibbles(proto, rows, threads);
}

int qtk_pack_nibbles(const uint8_t *src, int64_t rows, int64_t in_cols, int64_t out_bytes, uint8_t *dst, int add,
                     int threads) {
    nib_job_t proto = {.src = src, .dst = dst, .in_len = in_cols, .out_len = out_bytes, .k = (uint8_t)add, .pack = 1};
    return out_bytes * 2 < in_cols ? -1 : run_nibbles(proto, rows, threads);
}

/* CRC-32C (Castagnoli, reflected polynomial 0x82f63b78; iSCSI's and ext4's checksum) of n bytes, continuing from
 * `crc` (a finished value: 0 to start; crc32c("123456789") = 0xe3069283). The CPU's instruction where the build
 * target has it (x86 SSE4.2 crc32, 8 bytes per instruction; ARMv8's CRC32C), else eight table lookups per 8 bytes;
 * all three give the same value. */
#if defined(__SSE4_2__)
#include <nmmintrin.h>
#define CRC8(c, v) ((uint32_t)_mm_crc32_u64((c), (v)))
#define CRC1(c, b) _mm_crc32_u8((c), (b))
#elif defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#define CRC8(c, v) __crc32cd((c), (v))
#define CRC1(c, b) __crc32cb((c), (b))
#else
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1u ? (c >> 1) ^ 0x82f63b78u : c >> 1;
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (uint32_t i = 0; i < 256; i++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 255u];
}
static inline uint32_t CRC8(uint32_t c, uint64_t v) {
    v ^= c;
    return crc_table[7][v & 255u] ^ crc_table[6][(v >> 8) & 255u] ^ crc_table[5][(v >> 16) & 255u] ^
           crc_table[4][(v >> 24) & 255u] ^ crc_table[3][(v >> 32) & 255u] ^ crc_table[2][(v >> 40) & 255u] ^
           crc_table[1][(v >> 48) & 255u] ^ crc_table[0][v >> 56];
}
static inline uint32_t CRC1(uint32_t c, uint8_t b) { return (c >> 8) ^ crc_table[0][(c ^ b) & 255u]; }
#endif

/* a * b modulo the polynomial (reflected: bit 31 is x^0) */
static uint32_t crc_mulmod(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1u ? (b >> 1) ^ 0x82f63b78u : b >> 1;
    }
    return p;
}

/* CRC-32C of A then B from crc(A), crc(B) and len(B): crc(A) times x^(8 len(B)), plus crc(B) (zlib's
   crc32_combine, for this polynomial) */
static uint32_t crc_combine(uint32_t ca, uint32_t cb, int64_t len_b) {
    uint32_t sq = 1u << 23, xp = 1u << 31;  /* sq: x^8, squared each step (x^(8 * 2^k)); xp: x^0 */
    for (uint64_t k = (uint64_t)len_b; k; k >>= 1, sq = crc_mulmod(sq, sq))
        if (k & 1u) xp = crc_mulmod(sq, xp);
    return crc_mulmod(xp, ca) ^ cb;
}

uint32_t qtk_crc32c(const uint8_t *p, int64_t n, uint32_t crc) {
#if !defined(__SSE4_2__) && !defined(__ARM_FEATURE_CRC32)
    pthread_once(&crc_once, crc_init);
#else
    if (n >= 3 * 4096) {  /* three independent streams (the instruction's latency is three times its issue
                             interval), joined by crc_combine */
        const int64_t third = n / 3 / 8 * 8;
        const uint8_t *pb = p + third, *pc = p + 2 * third;
        uint32_t ca = ~crc, cb = ~0u, cc = ~0u;
        for (int64_t i = 0; i < third; i += 8) {
            uint64_t va, vb, vc;
            memcpy(&va, p + i, 8);
            memcpy(&vb, pb + i, 8);
            memcpy(&vc, pc + i, 8);
            ca = CRC8(ca, va);
            cb = CRC8(cb, vb);
            cc = CRC8(cc, vc);
        }
        /* the rest of n beyond 3 * third continues the third stream */
        uint32_t c3 = qtk_crc32c(pc + third, n - 3 * third, ~cc);
        return crc_combine(crc_combine(~ca, ~cb, third), c3, n - 2 * third);
    }
#endif
    uint32_t c = ~crc;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);  /* little-endian words: the byte order the bytewise CRC sees (x86, ARM as run) */
        c = CRC8(c, v);
    }
    for (; n > 0; n--) c = CRC1(c, *p++);
    return ~c;
}

/* Whether n floats of dtype dt (DT_*) are all finite: no exponent field all ones (Inf, NaN). One OR-reduction of
 * (exponent bits + one exponent unit), whose carry reaches the sign bit only from an all-ones exponent; returns
 * 1 all finite, 0 not, -1 for an unknown dtype. */
typedef struct {
    span_t span;
    const void *p;
    int dt;
    int bad;
} fin_job_t;

static void *finite_job(void *arg) {
    fin_job_t *j = (fin_job_t *)arg;
    if (j->dt == DT_F32) {
        const uint32_t *x = (const uint32_t *)j->p;
        uint32_t acc = 0;
        for (int64_t i = j->span.r0; i < j->span.r1; i++) acc |= (x[i] & 0x7f800000u) + 0x00800000u;
        j->bad = (acc & 0x80000000u) != 0;
    } else {
        const uint16_t *x = (const uint16_t *)j->p;
        const uint16_t m = j->dt == DT_BF16 ? 0x7f80u : 0x7c00u, one = j->dt == DT_BF16 ? 0x0080u : 0x0400u;
        uint16_t acc = 0;
        for (int64_t i = j->span.r0; i < j->span.r1; i++) acc |= (uint16_t)((x[i] & m) + one);
        j->bad = (acc & 0x8000u) != 0;
    }
    return NULL;
}

int qtk_all_finite(const void *p, int64_t n, int dt, int threads) {
    fin_job_t jobs[64], proto = {.p = p, .dt = dt};
    if (dt != DT_F32 && dt != DT_BF16 && dt != DT_F16) return -1;
    for (int t = 0; t < 64; t++) jobs[t] = proto;
    int used = split_rows(n, 1 << 16, threads, finite_job, jobs, sizeof(fin_job_t));
    for (int t = 0; t < used; t++)
        if (jobs[t].bad) return 0;
    return 1;
}
