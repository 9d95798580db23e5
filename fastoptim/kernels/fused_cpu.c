/* Fused CPU kernels: one call updates every tensor of a bucket in one pass over memory.

   The work is a table of fixed-size chunks across all tensors (built once in Python and cached):
   each thread takes a run of consecutive chunks holding an equal share of the elements, so 2000
   small tensors cost what one large tensor of the same size costs, and each thread streams
   through memory in order, as the hardware prefetcher likes. Each element of each tensor is read
   once and written once; nothing is allocated. ctypes releases the GIL for the call.

   The threads are torch's own: the OpenMP runtime torch has loaded, reached with dlopen(NOLOAD),
   so no second runtime is ever loaded. After a parallel region (a clip norm, say) torch's OpenMP
   threads spin for a while; threads of our own would fight them for the cores (measured: +2 ms on
   a 4 ms step). Without an OpenMP runtime in the process, plain pthreads do the work.

   The per-element math restates fastoptim/optimizers/adan.py, adamw.py and adamwsn.py, the
   reference the tests hold these kernels to; the comments name the reference's steps. Each
   algorithm's math is written once, as inline functions of one element; its kernel body walks them
   over a dense tensor, or over the subsets of a subset-norm one. Options that change the loop
   (dtype, amsgrad, no first moment, stochastic rounding) are compile-time constants of one kernel
   body, specialised by always-inline; the rest (weight decay, prox, maximize, clipping) are scalars.

   Each tensor comes with a layout (b, c, states) (NULL for the table: (1, 1, FP32) for all).
   - (b, c): subset-norm tensors (fastoptim/states/subset_norm.py) are (a, b, c) arrays whose second
     moment has one entry per subset [i, :, k]; (1, 1) is dense. Rows (c = 1): subsets of b
     consecutive elements, and a chunk holds whole subsets. Columns (a = 1): a chunk is a run of the
     c columns over all b rows, counted in elements (start and count are multiples of b). A chunk
     first sums its subsets' squares into their second moments, then updates its elements, reading
     them again from cache.
   - states: the format of the param-shaped states, FP32, BF16 or Q8 (8-bit blockwise, below).
     A subset-norm second moment is fp32 in every format, and Adan's g_prev is bf16 under Q8, as
     fastoptim.optimizers.base.state_dtype keeps them. */
#include <dlfcn.h>
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { FP32, BF16, FP16, Q8 };  /* element formats: params take the first three */
enum { STOCHASTIC_ROUNDING = 1, AMSGRAD = 2, FIRST_MOMENT = 4 };  /* flags */

/* One scalar argument: a shared value (stride 0) or one value per tensor (stride 1). A pointer,
   not a value, so a tensor lr or clip coefficient is read here without a host sync in Python. */
typedef struct { const float *values; int64_t stride; } Scalar;

/* Scalars shared by every kernel come first, in this order; each kernel's own follow. */
enum { FOUND_INF, SEED, GRAD_SCALE, COMMON_SCALARS };
/* 1 − β comes from Python, computed in double as the reference does, not from the rounded β. */
enum { ADAN_BETA1 = COMMON_SCALARS, ADAN_BETA2, ADAN_BETA3, ADAN_ONE_MINUS_BETA1, ADAN_ONE_MINUS_BETA2,
       ADAN_ONE_MINUS_BETA3, ADAN_EPS, ADAN_PRE_GRAD_WEIGHT,
       ADAN_BIAS_CORRECTION3_SQRT, ADAN_STEP_SIZE, ADAN_DIFF_RATIO, ADAN_DECAY_MUL, ADAN_DECAY_DIV,
       ADAN_SCALARS };
enum { ADAMW_ONE_MINUS_BETA1 = COMMON_SCALARS, ADAMW_BETA2, ADAMW_ONE_MINUS_BETA2, ADAMW_EPS, ADAMW_DECAY_MUL,
       ADAMW_DECAY_AFTER, ADAMW_STEP_SIZE, ADAMW_BIAS_CORRECTION2_SQRT, ADAMW_SCALARS };
/* Rows of the pointer table, by kernel: param, grad, the states, then each state's block maxima
   (rows of zeros where a state is not 8-bit). */
enum { PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, EXP_AVG_DIFF, NEG_PRE_GRAD, ADAN_ROWS };
enum { MAX_EXP_AVG_SQ = EXP_AVG_SQ + 1, ADAMW_ROWS };

typedef struct Work Work;
typedef void (*ChunkFn)(const Work *, int64_t chunk);  /* a row of the chunk table */

struct Work {
    const int64_t *pointers;   /* [role][tensor] data pointers */
    int64_t n_tensors;
    const int64_t *chunks;     /* [chunk][4]: tensor, first element (column), element (column) count, elements before it */
    const int64_t *layouts;    /* [tensor][3]: subset-norm (b, c) and the states' format; NULL: (1, 1, FP32) */
    const Scalar *scalars;
    ChunkFn chunk;
    void *extra;               /* the norm kernel's partial per chunk (double); the scale kernel's factor (float) */
};

typedef struct { const Work *work; int64_t chunk_begin, chunk_end; } Share;

/* The streams never overlap (each is its own tensor): tell the vectoriser so. */
#define IVDEP _Pragma("GCC ivdep")
#define INLINE static inline __attribute__((always_inline))
/* Each chunk function is compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2, FMA, F16C) and baseline
   x86-64; the loader picks by the CPU's features (an "arch=<model>" clone would miss AMD CPUs). */
#ifndef VECTORISED  /* the sanitizer build (tests/test_sanitizers.py) defines it empty: one copy each */
#define VECTORISED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

INLINE void *row(const Work *w, int role, int64_t tensor) {
    return (void *)(intptr_t)w->pointers[role * w->n_tensors + tensor];
}

INLINE float scalar(const Work *w, int index, int64_t tensor) {
    Scalar s = w->scalars[index];
    return s.values[tensor * s.stride];
}

INLINE float load(const void *base, int64_t i, int dtype) {
    if (dtype == BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
        float x;
        memcpy(&x, &bits, sizeof x);
        return x;
    }
    if (dtype == FP16) return (float)((const _Float16 *)base)[i];
    return ((const float *)base)[i];
}

/* A counter-based hash (murmur3's finaliser): random bits for stochastic rounding, the same for
   any thread count. */
INLINE uint32_t random_bits(uint32_t seed, uint32_t tensor, uint32_t i) {
    uint32_t h = seed ^ (tensor * 0x9e3779b9u) ^ (i * 0x85ebca6bu);
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}

/* fp32 math back to the param's dtype: round to nearest even, or, for bf16 with stochastic
   rounding, up with probability equal to the dropped fraction. */
INLINE void store(void *base, int64_t i, float x, int dtype, int stochastic, uint32_t seed, int64_t tensor) {
    if (dtype == BF16) {
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        uint32_t add = stochastic ? random_bits(seed, (uint32_t)tensor, (uint32_t)i) >> 16
                                  : 0x7fffu + ((bits >> 16) & 1u);
        ((uint16_t *)base)[i] = isnan(x) ? (uint16_t)((bits >> 16) | 0x40u) : (uint16_t)((bits + add) >> 16);
    } else if (dtype == FP16) {
        ((_Float16 *)base)[i] = (_Float16)x;
    } else {
        ((float *)base)[i] = x;
    }
}

enum { SUBSET_ROWS, SUBSET_COLUMNS, STATES };  /* the columns of the layout table */

INLINE int64_t layout(const Work *w, int64_t t, int which) {
    return w->layouts ? w->layouts[3 * t + which] : which == STATES ? FP32 : 1;
}

/* max(a, b) as a compare and select that vectorises (fmaxf is a libm call), NaN when b is NaN. */
INLINE float larger(float a, float b) { return a > b ? a : b; }

/* The sum over i in [begin, end) of a per-element expression: in several lanes, so it vectorises. */
#define SIMD_SUM _Pragma("omp simd reduction(+:sum)")

/* --- States in fp32, bf16 or 8 bits ----------------------------------------------------------

   8-bit states follow fastoptim/states/blockwise8.py: blocks of BLOCK elements in row-major order,
   one fp32 absmax each, and per element the index of a code: an fp16 number with 3 mantissa bits
   (magnitude k has the fp16 bits k << 7; SIGNED: k up to 127 with a sign, zero at index 127;
   UNSIGNED: k up to 247) divided by its table's largest, top. Every chunk starts on a block (the
   chunk plan makes sure), so each thread owns its blocks. It dequantizes a block's states into
   buffers on its stack, updates them there, and requantizes them: no dequantized copy of a state
   exists beyond those buffers. Adan's bf16 g_prev is widened into a buffer too: the update loop
   then reads and writes fp32 only, in 8 lanes, where bf16 made GCC spill (measured 4% faster).
   With fp32 or bf16 states, a whole run is one block and the states are updated where they are.

   Converting is most of an 8-bit step's work, and GCC does not vectorise fp16 conversions, so the
   block functions come twice: with AVX2 and F16C's conversions, 8 elements an instruction, where
   the CPU has them, and portable C that finds the same codes from fp32 bits.

   A non-finite element keeps an index of its own that decodes to itself (UNSIGNED: +inf at 248,
   NaN at 255; SIGNED: NaN at 255, for ±inf too), and the block's absmax is its finite elements'.
   Such blocks are rare: the vectorised quantizer leaves them to the portable one. */
#define BLOCK 256
enum { UNSIGNED, SIGNED, BF16_VALUES };  /* the code tables; or no table: Adan's g_prev, bf16 */

INLINE float table_top(int table) { return table == SIGNED ? 1.875f : 61440.f; }
INLINE int32_t last(int table) { return table == SIGNED ? 127 : 247; }
enum { UNSIGNED_INF_INDEX = 248, NAN_INDEX = 255 };
#define INF_BITS 0x7f800000  /* +inf's bits: |x|'s bits are at least these where x is not finite */

/* Magnitude k as fp32 (exact): fp16's bits moved into fp32's, its exponent rebased from fp16's
   bias (15) to fp32's (127); below 8, an fp16 subnormal, k·2^-17. */
INLINE float magnitude(int32_t k) {
    const int32_t bits = (k << 20) + ((127 - 15) << 23);
    float normal;
    memcpy(&normal, &bits, sizeof normal);
    return k < 8 ? (float)k * 0x1p-17f : normal;
}

INLINE float dequantize(uint8_t index, float absmax, int table) {
    if (index > (table == SIGNED ? 127 + last(table) : last(table)))  /* not a code: a non-finite value */
        return table == UNSIGNED && index == UNSIGNED_INF_INDEX ? INFINITY : NAN;
    const int32_t k = table == SIGNED ? index - 127 : index;
    const float code = magnitude(k < 0 ? -k : k) * (1 / table_top(table));  /* a product: no division */
    return (k < 0 ? -code : code) * absmax;
}

/* The index of the magnitude nearest to t = |x|·scale, a tie going up: from t's fp32 bits, rounding
   away the 20 bits below fp16's 3 and rebasing the exponent; below fp16's normal range (2^-14), by
   rounding t·2^17 to a whole number. */
INLINE uint8_t quantize(float x, float scale, int table) {
    if (!isfinite(x)) return table == UNSIGNED && x > 0 ? UNSIGNED_INF_INDEX : NAN_INDEX;
    const float t = fabsf(x) * scale, steps = (t < 0x1p-14f ? t : 0x1p-14f) * 0x1p17f, whole = floorf(steps);
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    const int32_t normal = ((bits + (1 << 19)) >> 20) - ((127 - 15) << 3);
    const int32_t subnormal = (int32_t)whole + (steps - whole >= 0.5f);
    int32_t k = t < 0x1p-14f ? subnormal : normal;
    k = k > last(table) ? last(table) : k;
    return (uint8_t)(table == SIGNED ? (x < 0 ? 127 - k : 127 + k) : k);
}

/* A block's scale, top / absmax; where that is not finite, 0, and the block is stored as zeros. */
INLINE float block_scale(float *absmax, int table) {
    const float scale = table_top(table) / *absmax;
    if (scale <= FLT_MAX) return scale;
    *absmax = 0;
    return 0;
}

#define F16C __attribute__((target("avx2,f16c")))

/* quantize() on 32 elements at a time: truncating t to fp16 and rounding that half up finds the
   nearest magnitude of t itself (no tie of t is lost, since the midpoints are fp16 numbers). */
F16C static void quantize_block_f16c(const float *restrict values, int64_t n, uint8_t *restrict codes, float scale,
                                     int table) {
    const __m256 scale8 = _mm256_set1_ps(scale);
    const __m256i no_sign = _mm256_set1_epi16(0x7fff), half = _mm256_set1_epi16(64);
    const __m256i largest = _mm256_set1_epi16((int16_t)last(table)), zero = _mm256_set1_epi16(127);
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i index[2];
        for (int h = 0; h < 2; h++) {  /* 16 elements as fp16, then their magnitudes' indices */
            const float *x = values + k + 16 * h;
            const __m256i t = _mm256_set_m128i(
                _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x + 8), scale8), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC),
                _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(x), scale8), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
            const __m256i m = _mm256_srli_epi16(_mm256_add_epi16(_mm256_and_si256(t, no_sign), half), 7);
            index[h] = _mm256_min_epu16(m, largest);
            if (table == SIGNED) index[h] = _mm256_add_epi16(_mm256_sign_epi16(index[h], t), zero);
        }
        /* packus interleaves the two halves' 128-bit lanes; the permute puts them back in order */
        _mm256_storeu_si256((__m256i *)(codes + k), _mm256_permute4x64_epi64(_mm256_packus_epi16(index[0], index[1]), 0xd8));
    }
    for (; k < n; k++) codes[k] = quantize(values[k], scale, table);
}

F16C static void dequantize_block_f16c(const uint8_t *restrict codes, float absmax, int64_t n, float *restrict values,
                                       int table) {
    const __m256 absmax8 = _mm256_set1_ps(absmax), inverse_top = _mm256_set1_ps(1 / table_top(table));
    const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX)), inf = _mm256_set1_ps(INFINITY);
    const __m128i zero = _mm_set1_epi16(127), sign = _mm_set1_epi16(INT16_MIN), nan_index = _mm_set1_epi16(NAN_INDEX);
    const __m128i fp16_nan = _mm_set1_epi16(0x7e00);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m128i index = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(codes + k)));
        __m128i h;  /* fp16 bits: UNSIGNED's indices past its codes are fp16's +inf and NaNs already */
        if (table == SIGNED) {
            h = _mm_sub_epi16(index, zero);
            h = _mm_or_si128(_mm_slli_epi16(_mm_abs_epi16(h), 7), _mm_and_si128(h, sign));
            h = _mm_blendv_epi8(h, fp16_nan, _mm_cmpeq_epi16(index, nan_index));
        } else {
            h = _mm_slli_epi16(index, 7);
        }
        const __m256 decoded = _mm256_cvtph_ps(h);
        __m256 value = _mm256_mul_ps(_mm256_mul_ps(decoded, inverse_top), absmax8);  /* a NaN stays NaN */
        if (table == UNSIGNED && absmax == 0)  /* +inf times an absmax of 0 would not stay +inf */
            value = _mm256_blendv_ps(decoded, value, _mm256_cmp_ps(_mm256_and_ps(decoded, no_sign), inf, _CMP_LT_OQ));
        _mm256_storeu_ps(values + k, value);
    }
    for (; k < n; k++) values[k] = dequantize(codes[k], absmax, table);
}

/* |x|'s bits. As integers they order magnitudes as floats do, with NaN above infinity: their
   maximum is the absmax, NaN if there is one (a float compare and select would drop it). */
INLINE int32_t magnitude_bits(float x) {
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits & INT32_MAX;
}

INLINE float from_bits(int32_t bits) {
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

INLINE int32_t larger_bits(int32_t a, int32_t b) { return a > b ? a : b; }

/* magnitude_bits' maximum over n values, in four running maxima: with one, each max waits for the
   last (the 8-bit Adan step measured 3% faster with four). */
F16C static int32_t absmax_bits_f16c(const float *restrict values, int64_t n) {
    const __m256i no_sign = _mm256_set1_epi32(INT32_MAX);
    __m256i top[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        for (int j = 0; j < 4; j++)
            top[j] = _mm256_max_epi32(top[j], _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(values + k + 8 * j)),
                                                               no_sign));
    const __m256i top8 = _mm256_max_epi32(_mm256_max_epi32(top[0], top[1]), _mm256_max_epi32(top[2], top[3]));
    __m128i top4 = _mm_max_epi32(_mm256_castsi256_si128(top8), _mm256_extracti128_si256(top8, 1));
    top4 = _mm_max_epi32(top4, _mm_shuffle_epi32(top4, 0x4e));  /* against the other 64-bit half */
    top4 = _mm_max_epi32(top4, _mm_shuffle_epi32(top4, 0xb1));  /* against the neighbouring lane */
    int32_t largest = _mm_cvtsi128_si32(top4);
    for (; k < n; k++) largest = larger_bits(largest, magnitude_bits(values[k]));
    return largest;
}

/* Whether the block functions take the F16C path: the CPU's answer, which the tests can turn off to
   hold the portable path to the reference too. */
static int use_f16c;

int fastoptim_use_f16c(int32_t enable) {
    __builtin_cpu_init();
    use_f16c = enable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    return use_f16c;
}

__attribute__((constructor)) static void pick_f16c(void) { fastoptim_use_f16c(1); }

/* The largest of magnitude_bits over n values, or over their finite ones only. */
INLINE int32_t absmax_bits(const float *restrict values, int64_t n, int finite_only) {
    int32_t top_bits = 0;
    _Pragma("omp simd reduction(max:top_bits)")
    for (int64_t k = 0; k < n; k++) {
        const int32_t bits = magnitude_bits(values[k]);
        top_bits = larger_bits(top_bits, finite_only && bits >= INF_BITS ? 0 : bits);
    }
    return top_bits;
}

/* n (at most BLOCK) values into their codes and their block's absmax. */
INLINE void quantize_block(const float *restrict values, int64_t n, uint8_t *restrict codes, float *absmax, int table) {
    int32_t top_bits = use_f16c ? absmax_bits_f16c(values, n) : absmax_bits(values, n, 0);
    const int finite = top_bits < INF_BITS;  /* else the block holds an inf or a NaN */
    if (!finite) top_bits = absmax_bits(values, n, 1);
    float top = from_bits(top_bits);
    const float scale = block_scale(&top, table);
    if (use_f16c && finite) quantize_block_f16c(values, n, codes, scale, table);
    else IVDEP for (int64_t k = 0; k < n; k++) codes[k] = quantize(values[k], scale, table);
    *absmax = top;
}

INLINE void dequantize_block(const uint8_t *restrict codes, float absmax, int64_t n, float *restrict values, int table) {
    if (use_f16c) dequantize_block_f16c(codes, absmax, n, values, table);
    else IVDEP for (int64_t k = 0; k < n; k++) values[k] = dequantize(codes[k], absmax, table);
}

/* The kernels' quantizer and dequantizer over n elements, for the tests to hold them to the
   reference. */
VECTORISED int fastoptim_quantize(const float *values, int64_t n, int32_t table, uint8_t *codes, float *absmax) {
    for (int64_t i = 0; i < n; i += BLOCK)
        quantize_block(values + i, n - i < BLOCK ? n - i : BLOCK, codes + i, absmax + i / BLOCK, table);
    return 0;
}

VECTORISED int fastoptim_dequantize(const uint8_t *codes, const float *absmax, int64_t n, int32_t table, float *values) {
    for (int64_t i = 0; i < n; i += BLOCK)
        dequantize_block(codes + i, absmax[i / BLOCK], n - i < BLOCK ? n - i : BLOCK, values + i, table);
    return 0;
}

/* One state of one tensor, in format FP32, BF16 or Q8 (the format is a compile-time argument of
   the functions below, so each kernel body is specialised for it). */
typedef struct {
    void *data;
    float *absmax;        /* Q8: one per block; NULL for a state without codes (absent, fp32 or bf16) */
    int table;            /* Q8: SIGNED or UNSIGNED; BF16_VALUES for bf16 values, held in the block
                             too, so that the update loop reads and writes fp32 only */
    float *block;         /* Q8: the values of the block being updated */
    int64_t first;        /* Q8: that block's first element */
} State;

INLINE State state(const Work *w, int role, int rows, int64_t t, int table, float *block) {
    return (State){row(w, role, t), row(w, rows + role - EXP_AVG, t), table, block, 0};
}

INLINE float get(const State *s, int64_t i, int format) {
    return format == Q8 ? s->block[i - s->first] : load(s->data, i, format);
}

INLINE void put(State *s, int64_t i, float x, int format) {
    if (format == Q8) s->block[i - s->first] = x;
    else store(s->data, i, x, format, 0, 0, 0);
}

/* The end of the block that starts at i, in a run that ends at end. */
INLINE int64_t block_end(int64_t i, int64_t end, int format) {
    return format == Q8 && i / BLOCK * BLOCK + BLOCK < end ? i / BLOCK * BLOCK + BLOCK : end;
}

/* Blocks start on multiples of BLOCK. */
INLINE void open_block(State *s, int64_t i, int64_t end, int format) {
    s->first = i;
    if (format == Q8 && s->table == BF16_VALUES)
        IVDEP for (int64_t k = 0; k < end - i; k++) s->block[k] = load(s->data, i + k, BF16);
    else if (format == Q8 && s->absmax)
        dequantize_block((const uint8_t *)s->data + i, s->absmax[i / BLOCK], end - i, s->block, s->table);
}

INLINE void close_block(State *s, int64_t i, int64_t end, int format) {
    if (format == Q8 && s->table == BF16_VALUES)
        IVDEP for (int64_t k = 0; k < end - i; k++) store(s->data, i + k, s->block[k], BF16, 0, 0, 0);
    else if (format == Q8 && s->absmax)
        quantize_block(s->block, end - i, (uint8_t *)s->data + i, &s->absmax[i / BLOCK], s->table);
}

/* Runs the code after the states over [from, to) block by block (it reads the block as [i0, i1)),
   opening the four states before each block and closing them after it. */
#define FOR_BLOCKS(from, to, format, s1, s2, s3, s4, ...) for (int64_t i0 = (from), i1, end_ = (to); i0 < end_; i0 = i1) { \
        i1 = block_end(i0, end_, format);                                                              \
        open_block(s1, i0, i1, format), open_block(s2, i0, i1, format);                               \
        open_block(s3, i0, i1, format), open_block(s4, i0, i1, format);                               \
        __VA_ARGS__                                                                                    \
        close_block(s1, i0, i1, format), close_block(s2, i0, i1, format);                             \
        close_block(s3, i0, i1, format), close_block(s4, i0, i1, format); }

/* Inside FOR_BLOCKS: runs the code after ``index`` over the block cut at multiples of ``size`` (a
   subset of rows, or a row of columns), the ``index``-th piece read as [from, to). */
#define FOR_RUNS(size, index, ...) for (int64_t index = i0 / (size); index * (size) < i1; index++) {      \
        const int64_t from = index * (size) > i0 ? index * (size) : i0;                                 \
        const int64_t to = (index + 1) * (size) < i1 ? (index + 1) * (size) : i1;                       \
        __VA_ARGS__ }

/* --- Adan ----------------------------------------------------------------------------------- */

typedef struct {
    float beta1, beta2, beta3, one_minus_beta1, one_minus_beta2, one_minus_beta3, eps, grad_scale;
    float pre_grad_weight, inv_bias_correction3_sqrt, step_size, diff_ratio, decay_mul, inv_decay_div;
} AdanScalars;

/* Reciprocals once per tensor: one division per element is what the core can afford. */
INLINE AdanScalars adan_scalars(const Work *w, int64_t t) {
    return (AdanScalars){
        scalar(w, ADAN_BETA1, t), scalar(w, ADAN_BETA2, t), scalar(w, ADAN_BETA3, t),
        scalar(w, ADAN_ONE_MINUS_BETA1, t), scalar(w, ADAN_ONE_MINUS_BETA2, t), scalar(w, ADAN_ONE_MINUS_BETA3, t),
        scalar(w, ADAN_EPS, t), scalar(w, GRAD_SCALE, t), scalar(w, ADAN_PRE_GRAD_WEIGHT, t),
        1 / scalar(w, ADAN_BIAS_CORRECTION3_SQRT, t), scalar(w, ADAN_STEP_SIZE, t), scalar(w, ADAN_DIFF_RATIO, t),
        scalar(w, ADAN_DECAY_MUL, t), 1 / scalar(w, ADAN_DECAY_DIV, t)};
}

typedef struct { float neg_g, d, u; } AdanTerms;

INLINE AdanTerms adan_terms(const AdanScalars *s, float grad, float neg_pre_grad) {
    const float neg_g = grad * -s->grad_scale;
    const float d = (neg_pre_grad - neg_g) * s->pre_grad_weight;         /* g − g_prev (0 at a first step) */
    return (AdanTerms){neg_g, d, d * s->beta2 - neg_g};                   /* u = g + β2·d */
}

/* step_size / denom, from exp_avg_sq (the element's or its subset's). */
INLINE float adan_scale(const AdanScalars *s, float n) {
    return s->step_size / (sqrtf(n) * s->inv_bias_correction3_sqrt + s->eps);
}

/* After exp_avg_sq: the moments m and v, and the new value of param p. */
INLINE float adan_apply(const AdanScalars *s, AdanTerms x, float *m, float *v, float p, float scale) {
    *m = *m * s->beta1 - x.neg_g * s->one_minus_beta1;
    *v = *v * s->beta2 + x.d * s->one_minus_beta2;
    p = p * s->decay_mul - *m * scale - *v * (scale * s->diff_ratio);    /* 1 − lr·wd with no_prox */
    return p * s->inv_decay_div;                                          /* 1 + lr·wd: prox */
}

/* ``states``: the format of the param-shaped states (see the top of the file). */
INLINE void adan_body(const Work *w, int64_t t, int64_t start, int64_t count, int dtype, int stochastic, int states) {
    const AdanScalars s = adan_scalars(w, t);
    const uint32_t seed = (uint32_t)scalar(w, SEED, t);
    void *param = row(w, PARAM, t);
    const void *grad = row(w, GRAD, t);
    float m_block[BLOCK], v_block[BLOCK], n_block[BLOCK], neg_pre_grad_block[BLOCK];
    State m = state(w, EXP_AVG, ADAN_ROWS, t, SIGNED, m_block);
    State v = state(w, EXP_AVG_DIFF, ADAN_ROWS, t, SIGNED, v_block);
    State n = state(w, EXP_AVG_SQ, ADAN_ROWS, t, UNSIGNED, n_block);
    State neg_pre_grad = state(w, NEG_PRE_GRAD, ADAN_ROWS, t, BF16_VALUES, neg_pre_grad_block);
    const int pre_grad_format = states == Q8 ? BF16 : states;
    const int64_t b = layout(w, t, SUBSET_ROWS), c = layout(w, t, SUBSET_COLUMNS), end = start + count;
    /* the terms from g_prev in memory (the subset-norm sums, outside blocks), or in its block */
#define ADAN_STORED_TERMS(i) adan_terms(&s, load(grad, i, dtype), load(neg_pre_grad.data, i, pre_grad_format))
#define ADAN_TERMS(i) adan_terms(&s, load(grad, i, dtype), get(&neg_pre_grad, i, states))
#define ADAN_UPDATE(i, x, scale) do {                                                                 \
        float m_i = get(&m, i, states), v_i = get(&v, i, states);                                     \
        const float p = adan_apply(&s, x, &m_i, &v_i, load(param, i, dtype), scale);                  \
        put(&m, i, m_i, states), put(&v, i, v_i, states), put(&neg_pre_grad, i, x.neg_g, states);    \
        store(param, i, p, dtype, stochastic, seed, t);                                               \
    } while (0)
#define ADAN_BLOCKS(from, to, ...) FOR_BLOCKS(from, to, states, &m, &v, &n, &neg_pre_grad, __VA_ARGS__)
    if (b == 1) {                                           /* dense: n = β3·n + (1−β3)·u² per element */
        ADAN_BLOCKS(start, end, IVDEP for (int64_t i = i0; i < i1; i++) {
            const AdanTerms x = ADAN_TERMS(i);
            /* (1−β3)·u·u as torch's addcmul orders it: u² alone overflows sooner */
            const float n_i = get(&n, i, states) * s.beta3 + s.one_minus_beta3 * x.u * x.u;
            put(&n, i, n_i, states);
            ADAN_UPDATE(i, x, adan_scale(&s, n_i));
        })
        return;
    }
    float *restrict reduced = n.data;                       /* fp32, one per subset */
    if (c == 1) {                                           /* rows: subset k is elements [k·b, (k+1)·b) */
        for (int64_t k = start / b; k < end / b; k++) {
            float sum = 0;
            SIMD_SUM for (int64_t i = k * b; i < (k + 1) * b; i++) {
                const AdanTerms x = ADAN_STORED_TERMS(i);
                sum += x.u * x.u;
            }
            reduced[k] = reduced[k] * s.beta3 + sum * s.one_minus_beta3;
        }
        ADAN_BLOCKS(start, end, FOR_RUNS(b, k,
            const float scale = adan_scale(&s, reduced[k]);
            IVDEP for (int64_t i = from; i < to; i++) ADAN_UPDATE(i, ADAN_TERMS(i), scale);
        ))
        return;
    }
    /* columns: the chunk's elements / b of b rows; under Q8 all c of them (the chunk plan makes
       sure), so the rows make one run of whole blocks */
    const int64_t j0 = start / b, j1 = end / b;
    IVDEP for (int64_t j = j0; j < j1; j++) reduced[j] *= s.beta3;
    for (int64_t r = 0; r < b; r++)
        IVDEP for (int64_t j = j0; j < j1; j++) {
            const AdanTerms x = ADAN_STORED_TERMS(r * c + j);
            reduced[j] += x.u * x.u * s.one_minus_beta3;
        }
    for (int64_t r = 0; r < (states == Q8 ? 1 : b); r++)
        ADAN_BLOCKS(states == Q8 ? 0 : r * c + j0, states == Q8 ? b * c : r * c + j1,
                   FOR_RUNS(c, row,
            IVDEP for (int64_t i = from; i < to; i++) ADAN_UPDATE(i, ADAN_TERMS(i), adan_scale(&s, reduced[i - row * c]));
        ))
#undef ADAN_BLOCKS
#undef ADAN_UPDATE
#undef ADAN_TERMS
#undef ADAN_STORED_TERMS
}

/* --- AdamW, AdamWSN and RMSPropSN ------------------------------------------------------------- */

typedef struct {
    float one_minus_beta1, beta2, one_minus_beta2, eps, grad_scale, decay_mul, decay_after, step_size;
    float inv_bias_correction2_sqrt;
} AdamWScalars;

INLINE AdamWScalars adamw_scalars(const Work *w, int64_t t) {
    return (AdamWScalars){
        scalar(w, ADAMW_ONE_MINUS_BETA1, t), scalar(w, ADAMW_BETA2, t), scalar(w, ADAMW_ONE_MINUS_BETA2, t),
        scalar(w, ADAMW_EPS, t), scalar(w, GRAD_SCALE, t), scalar(w, ADAMW_DECAY_MUL, t),
        scalar(w, ADAMW_DECAY_AFTER, t), scalar(w, ADAMW_STEP_SIZE, t),
        1 / scalar(w, ADAMW_BIAS_CORRECTION2_SQRT, t)};
}

/* step_size / denom, from the second moment (the element's or its subset's; v̂ with amsgrad). */
INLINE float adamw_scale(const AdamWScalars *s, float v) {
    return s->step_size / (sqrtf(v) * s->inv_bias_correction2_sqrt + s->eps);
}

/* After the second moment: the first moment (the numerator; g itself without one) and the new
   value of param p. Weight decay multiplies before the update (AdamW) or after it (AdamWSN). */
INLINE float adamw_apply(const AdamWScalars *s, float g, float *m, float p, float scale, int first_moment) {
    float numerator = g;
    if (first_moment) {
        *m += (g - *m) * s->one_minus_beta1;                              /* lerp */
        numerator = *m;
    }
    return (p * s->decay_mul - numerator * scale) * s->decay_after;
}

INLINE void adamw_body(const Work *w, int64_t t, int64_t start, int64_t count, int dtype, int stochastic,
                       int amsgrad, int first_moment, int states) {
    const AdamWScalars s = adamw_scalars(w, t);
    const uint32_t seed = (uint32_t)scalar(w, SEED, t);
    void *param = row(w, PARAM, t);
    const void *grad = row(w, GRAD, t);
    float m_block[BLOCK], v_block[BLOCK], v_max_block[BLOCK];
    State m = state(w, EXP_AVG, ADAMW_ROWS, t, SIGNED, m_block);
    State v = state(w, EXP_AVG_SQ, ADAMW_ROWS, t, UNSIGNED, v_block);
    State v_max = amsgrad ? state(w, MAX_EXP_AVG_SQ, ADAMW_ROWS, t, UNSIGNED, v_max_block) : (State){0};
    State none = {0};  /* a fourth state for FOR_BLOCKS: its blocks open and close as no-ops */
    const int64_t b = layout(w, t, SUBSET_ROWS), c = layout(w, t, SUBSET_COLUMNS), end = start + count;
#define ADAMW_GRAD(i) (load(grad, i, dtype) * s.grad_scale)
#define ADAMW_UPDATE(i, g, scale) do {                                                                \
        float m_i = first_moment ? get(&m, i, states) : 0;                                           \
        const float p = adamw_apply(&s, g, &m_i, load(param, i, dtype), scale, first_moment);          \
        if (first_moment) put(&m, i, m_i, states);                                                    \
        store(param, i, p, dtype, stochastic, seed, t);                                               \
    } while (0)
#define ADAMW_BLOCKS(from, to, ...) FOR_BLOCKS(from, to, states, &m, &v, &v_max, &none, __VA_ARGS__)
    if (b == 1) {                                           /* dense: v = β2·v + (1−β2)·g² per element */
        ADAMW_BLOCKS(start, end, IVDEP for (int64_t i = i0; i < i1; i++) {
            const float g = ADAMW_GRAD(i);
            float v_i = get(&v, i, states) * s.beta2 + s.one_minus_beta2 * g * g;  /* addcmul's order, as Adan's */
            put(&v, i, v_i, states);
            if (amsgrad) {
                v_i = larger(get(&v_max, i, states), v_i);
                put(&v_max, i, v_i, states);
            }
            ADAMW_UPDATE(i, g, adamw_scale(&s, v_i));
        })
        return;
    }
    float *reduced = v.data, *reduced_max = amsgrad ? v_max.data : v.data;  /* fp32, one per subset */
    if (c == 1) {                                           /* rows: subset k is elements [k·b, (k+1)·b) */
        for (int64_t k = start / b; k < end / b; k++) {
            float sum = 0;
            SIMD_SUM for (int64_t i = k * b; i < (k + 1) * b; i++) sum += ADAMW_GRAD(i) * ADAMW_GRAD(i);
            reduced[k] = reduced[k] * s.beta2 + sum * s.one_minus_beta2;
            if (amsgrad) reduced_max[k] = larger(reduced_max[k], reduced[k]);
        }
        ADAMW_BLOCKS(start, end, FOR_RUNS(b, k,
            const float scale = adamw_scale(&s, reduced_max[k]);
            IVDEP for (int64_t i = from; i < to; i++) ADAMW_UPDATE(i, ADAMW_GRAD(i), scale);
        ))
        return;
    }
    /* columns: as Adan's */
    const int64_t j0 = start / b, j1 = end / b;
    IVDEP for (int64_t j = j0; j < j1; j++) reduced[j] *= s.beta2;
    for (int64_t r = 0; r < b; r++)
        IVDEP for (int64_t j = j0; j < j1; j++) {
            const float g = ADAMW_GRAD(r * c + j);
            reduced[j] += g * g * s.one_minus_beta2;
        }
    if (amsgrad)
        for (int64_t j = j0; j < j1; j++) reduced_max[j] = larger(reduced_max[j], reduced[j]);
    for (int64_t r = 0; r < (states == Q8 ? 1 : b); r++)
        ADAMW_BLOCKS(states == Q8 ? 0 : r * c + j0, states == Q8 ? b * c : r * c + j1,
                     FOR_RUNS(c, row,
            IVDEP for (int64_t i = from; i < to; i++)
                ADAMW_UPDATE(i, ADAMW_GRAD(i), adamw_scale(&s, reduced_max[i - row * c]));
        ))
#undef ADAMW_BLOCKS
#undef ADAMW_UPDATE
#undef ADAMW_GRAD
}

/* The trivial-math twin of Adan's traffic (6 reads, 5 writes of fp32): the bandwidth it reaches
   is what the Adan kernel is measured against. */
INLINE void probe_body(const Work *w, int64_t t, int64_t start, int64_t count) {
    float *restrict p = (float *)row(w, PARAM, t) + start;
    const float *restrict g = (const float *)row(w, GRAD, t) + start;
    float *restrict a = (float *)row(w, EXP_AVG, t) + start, *restrict b = (float *)row(w, EXP_AVG_SQ, t) + start;
    float *restrict c = (float *)row(w, EXP_AVG_DIFF, t) + start, *restrict e = (float *)row(w, NEG_PRE_GRAD, t) + start;
    IVDEP for (int64_t i = 0; i < count; i++) {
        p[i] += g[i]; a[i] += g[i]; b[i] += g[i]; c[i] += g[i]; e[i] += g[i];
    }
}

/* --- Gradient norms and clipping (fastoptim/clip.py) ------------------------------------------
   Row 0 of the pointer table holds the grads. The norm kernel writes one partial per chunk, in
   double: the sum of squares, or the largest magnitude (inf); Python reduces the partials in chunk
   order, so the norm does not depend on the thread count. The scale kernel multiplies every grad
   by one factor, read from its fp32 tensor. */
INLINE void norm_body(const Work *w, int64_t k, int64_t t, int64_t start, int64_t count, int dtype, int inf) {
    const void *grad = row(w, 0, t);
    double *partial = (double *)w->extra + k;
    if (inf) {
        int32_t top_bits = 0;  /* as the 8-bit absmax, so that a NaN shows in the norm */
        _Pragma("omp simd reduction(max:top_bits)")
        for (int64_t i = start; i < start + count; i++)
            top_bits = larger_bits(top_bits, magnitude_bits(load(grad, i, dtype)));
        *partial = from_bits(top_bits);
    } else {
        double sum = 0;
        SIMD_SUM for (int64_t i = start; i < start + count; i++) sum += (double)load(grad, i, dtype) * load(grad, i, dtype);
        *partial = sum;
    }
}

INLINE void scale_body(const Work *w, int64_t t, int64_t start, int64_t count, int dtype) {
    void *grad = row(w, 0, t);
    const float factor = *(const float *)w->extra;
    IVDEP for (int64_t i = start; i < start + count; i++) store(grad, i, load(grad, i, dtype) * factor, dtype, 0, 0, 0);
}

/* The specialisations: one chunk function per (kernel, dtype, rounding[, amsgrad | no first moment]),
   which picks the body for the tensor's state format. */
#define BY_STATES(w, t, BODY, ...) switch (layout(w, t, STATES)) {                                      \
        case BF16: BODY(__VA_ARGS__, BF16); break;                                                      \
        case Q8: BODY(__VA_ARGS__, Q8); break;                                                          \
        default: BODY(__VA_ARGS__, FP32); }
#define CHUNK(k) const int64_t t = w->chunks[4 * k], s = w->chunks[4 * k + 1], c = w->chunks[4 * k + 2]
#define ADAN_CHUNK(NAME, DTYPE, SR) VECTORISED static void NAME(const Work *w, int64_t k) { \
    CHUNK(k); BY_STATES(w, t, adan_body, w, t, s, c, DTYPE, SR) }
#define ADAMW_CHUNK(NAME, DTYPE, SR, AMS, FIRST) VECTORISED static void NAME(const Work *w, int64_t k) { \
    CHUNK(k); BY_STATES(w, t, adamw_body, w, t, s, c, DTYPE, SR, AMS, FIRST) }
#define ADAMW_CHUNKS(SUFFIX, AMS, FIRST) \
    ADAMW_CHUNK(adamw_fp32##SUFFIX, FP32, 0, AMS, FIRST) ADAMW_CHUNK(adamw_bf16##SUFFIX, BF16, 0, AMS, FIRST) \
    ADAMW_CHUNK(adamw_bf16_sr##SUFFIX, BF16, 1, AMS, FIRST) ADAMW_CHUNK(adamw_fp16##SUFFIX, FP16, 0, AMS, FIRST)
ADAN_CHUNK(adan_fp32, FP32, 0)
ADAN_CHUNK(adan_bf16, BF16, 0)
ADAN_CHUNK(adan_bf16_sr, BF16, 1)
ADAN_CHUNK(adan_fp16, FP16, 0)
ADAMW_CHUNKS(, 0, 1)
ADAMW_CHUNKS(_ams, 1, 1)
ADAMW_CHUNKS(_rms, 0, 0)
VECTORISED static void probe_fp32(const Work *w, int64_t k) { CHUNK(k); probe_body(w, t, s, c); }
#define CLIP_CHUNKS(NAME, DTYPE) \
    VECTORISED static void norm2_##NAME(const Work *w, int64_t k) { CHUNK(k); norm_body(w, k, t, s, c, DTYPE, 0); } \
    VECTORISED static void norm_inf_##NAME(const Work *w, int64_t k) { CHUNK(k); norm_body(w, k, t, s, c, DTYPE, 1); } \
    VECTORISED static void scale_##NAME(const Work *w, int64_t k) { CHUNK(k); scale_body(w, t, s, c, DTYPE); }
CLIP_CHUNKS(fp32, FP32)
CLIP_CHUNKS(bf16, BF16)
CLIP_CHUNKS(fp16, FP16)

static void *work_share(void *arg) {
    const Share *s = arg;
    const Work *w = s->work;
    for (int64_t k = s->chunk_begin; k < s->chunk_end; k++)
        w->chunk(w, k);
    return NULL;
}

/* torch's OpenMP runtime, if fastoptim_use_openmp found it: GOMP_parallel is the entry point GCC
   compiles `#pragma omp parallel` to, offered by libgomp and by LLVM's and Intel's runtimes. */
static void (*gomp_parallel)(void (*)(void *), void *, unsigned, unsigned);
static int (*omp_get_thread_num_)(void), (*omp_get_num_threads_)(void);

/* Use the OpenMP runtime at ``path`` if it is loaded; NULL: use pthreads. */
int fastoptim_use_openmp(const char *path) {
    gomp_parallel = NULL;
    if (!path) return 0;
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);  /* only if already loaded */
    if (!library) return -1;
    gomp_parallel = (void (*)(void (*)(void *), void *, unsigned, unsigned))dlsym(library, "GOMP_parallel");
    omp_get_thread_num_ = (int (*)(void))dlsym(library, "omp_get_thread_num");
    omp_get_num_threads_ = (int (*)(void))dlsym(library, "omp_get_num_threads");
    if (!gomp_parallel || !omp_get_thread_num_ || !omp_get_num_threads_) {
        gomp_parallel = NULL;
        return -1;
    }
    return 0;
}

typedef struct { Share *shares; int64_t n; } Team;

static void team_member(void *arg) {
    const Team *team = arg;
    for (int64_t k = omp_get_thread_num_(); k < team->n; k += omp_get_num_threads_()) work_share(&team->shares[k]);
}

#define MAX_THREADS 256

/* The first chunk in [begin, end) that does not start before element ``target``. */
static int64_t chunk_at(const int64_t *chunks, int64_t begin, int64_t end, int64_t target) {
    while (begin < end) {
        int64_t mid = begin + (end - begin) / 2;
        if (chunks[4 * mid + 3] < target) begin = mid + 1; else end = mid;
    }
    return begin;
}

/* Runs chunks [chunk_begin, chunk_end) on up to n_threads threads (the caller is one of them). */
static int run(ChunkFn chunk, const int64_t *pointers, int64_t n_tensors, const int64_t *chunks,
               int64_t chunk_begin, int64_t chunk_end, const int64_t *layouts, const Scalar *scalars,
               void *extra, int32_t n_threads) {
    if (!chunk) return -1;
    if (scalars && scalars[FOUND_INF].values[0] != 0) return 0;  /* GradScaler found inf: skip */
    const Work w = {.pointers = pointers, .n_tensors = n_tensors, .chunks = chunks, .layouts = layouts,
                    .scalars = scalars, .chunk = chunk, .extra = extra};
    int64_t n_chunks = chunk_end - chunk_begin, n = n_threads < n_chunks ? n_threads : n_chunks;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n < 1) n = 1;
    Share shares[MAX_THREADS];
    const int64_t first = n_chunks ? chunks[4 * chunk_begin + 3] : 0;
    const int64_t total = n_chunks ? chunks[4 * (chunk_end - 1) + 3] + chunks[4 * (chunk_end - 1) + 2] - first : 0;
    for (int64_t k = 0; k < n; k++)
        shares[k] = (Share){&w, chunk_at(chunks, chunk_begin, chunk_end, first + total * k / n),
                            chunk_at(chunks, chunk_begin, chunk_end, first + total * (k + 1) / n)};
    if (n == 1) {
        work_share(&shares[0]);
    } else if (gomp_parallel) {
        Team team = {shares, n};
        gomp_parallel(team_member, &team, (unsigned)n, 0);
    } else {
        pthread_t threads[MAX_THREADS];
        int64_t started = 1;  /* share 0 is the caller's; a thread that fails to start leaves its share to it */
        for (; started < n && pthread_create(&threads[started], NULL, work_share, &shares[started]) == 0; started++) {}
        for (int64_t k = started; k < n; k++) work_share(&shares[k]);
        work_share(&shares[0]);
        for (int64_t k = 1; k < started; k++) pthread_join(threads[k], NULL);
    }
    return 0;
}

static ChunkFn pick(ChunkFn fp32, ChunkFn bf16, ChunkFn bf16_sr, ChunkFn fp16, int32_t dtype, int32_t flags) {
    switch (dtype) {
        case FP32: return fp32;
        case BF16: return flags & STOCHASTIC_ROUNDING ? bf16_sr : bf16;
        case FP16: return fp16;
        default: return NULL;
    }
}

int fastoptim_adan(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t chunk_begin,
                   int64_t chunk_end, const int64_t *layouts, const Scalar *scalars, int32_t dtype, int32_t flags,
                   int32_t n_threads) {
    ChunkFn chunk = pick(adan_fp32, adan_bf16, adan_bf16_sr, adan_fp16, dtype, flags);
    return run(chunk, pointers, n_tensors, chunks, chunk_begin, chunk_end, layouts, scalars, NULL, n_threads);
}

int fastoptim_adamw(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t chunk_begin,
                    int64_t chunk_end, const int64_t *layouts, const Scalar *scalars, int32_t dtype, int32_t flags,
                    int32_t n_threads) {
    ChunkFn chunk = flags & AMSGRAD ? pick(adamw_fp32_ams, adamw_bf16_ams, adamw_bf16_sr_ams, adamw_fp16_ams, dtype, flags)
                  : !(flags & FIRST_MOMENT) ? pick(adamw_fp32_rms, adamw_bf16_rms, adamw_bf16_sr_rms, adamw_fp16_rms,
                                                   dtype, flags)
                  : pick(adamw_fp32, adamw_bf16, adamw_bf16_sr, adamw_fp16, dtype, flags);
    return run(chunk, pointers, n_tensors, chunks, chunk_begin, chunk_end, layouts, scalars, NULL, n_threads);
}

int fastoptim_probe(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t chunk_begin,
                    int64_t chunk_end, int32_t n_threads) {
    return run(probe_fp32, pointers, n_tensors, chunks, chunk_begin, chunk_end, NULL, NULL, NULL, n_threads);
}


/* ``inf``: the largest magnitude, else the sum of squares, of each chunk into partials[chunk]. */
int fastoptim_grad_norm(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t n_chunks,
                        int32_t dtype, int32_t inf, double *partials, int32_t n_threads) {
    ChunkFn chunk = inf ? pick(norm_inf_fp32, norm_inf_bf16, norm_inf_bf16, norm_inf_fp16, dtype, 0)
                        : pick(norm2_fp32, norm2_bf16, norm2_bf16, norm2_fp16, dtype, 0);
    return run(chunk, pointers, n_tensors, chunks, 0, n_chunks, NULL, NULL, partials, n_threads);
}

int fastoptim_scale_grads(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t n_chunks,
                          int32_t dtype, const float *factor, int32_t n_threads) {
    ChunkFn chunk = pick(scale_fp32, scale_bf16, scale_bf16, scale_fp16, dtype, 0);
    return run(chunk, pointers, n_tensors, chunks, 0, n_chunks, NULL, NULL, (void *)factor, n_threads);
}
