/* Fused CPU kernels: one call updates every tensor of a bucket in one pass over memory.

   The work is a table of fixed-size chunks across all tensors (built once in Python and cached):
   each thread takes a run of consecutive chunks holding an equal share of the elements, so 2000
   small tensors cost what one large tensor of the same size costs, and each thread streams
   through memory in order, as the hardware prefetcher likes. Each element of each tensor is read
   once and written once; nothing is allocated. The caller (native.cpp, a torch op) runs without the GIL.

   The threads are torch's own: the OpenMP runtime torch has loaded, reached with dlopen(NOLOAD),
   so no second runtime is ever loaded. After a parallel region (a clip norm, say) torch's OpenMP
   threads spin for a while; threads of our own would fight them for the cores (measured: +2 ms on
   a 4 ms step). Without an OpenMP runtime in the process, plain pthreads do the work.

   The per-element math restates fastoptim/optimizers/adan.py, adamw.py, adamwsn.py, lion.py and muon_parts.py,
   the reference the tests hold these kernels to; the comments name the reference's steps. Each
   algorithm's math is written once, as inline functions of one element (see "The algorithms");
   one walk over memory serves them all (see "The walk"): a dense tensor, the subsets of a
   subset-norm one, 8-bit blocks. Its rows, scalars, flags and states come from the kernel specs,
   through the generated fused_cpu_specs.h, and FOR_EACH_KERNEL instantiates its chunk functions
   and entry point fastoptim_<name> for every kernel. Options that change the loop (dtype, the
   algorithm's flags such as amsgrad, the param's rounding or master remainder, the states' format) are compile-time
   constants of the walk, specialised by always-inline; the rest (weight decay, prox, maximize,
   clipping) are scalars.

   Each tensor comes with a layout (b, c, states) (NULL for the table: (1, 1, FP32) for all).
   - (b, c): subset-norm tensors (fastoptim/states/subset_norm.py) are (a, b, c) arrays whose second
     moment has one entry per subset [i, :, k]; (1, 1) is dense. Rows (c = 1): subsets of b
     consecutive elements, and a chunk holds whole subsets. Columns (a = 1): a chunk is a run of the
     c columns over all b rows, counted in elements (start and count are multiples of b), all c of
     them but in huge tensors (the chunk plan's whole rows stream best). A chunk first sums its
     subsets' squares into their second moments, then updates its elements, reading them again
     (from cache for a row subset's chunk; a column chunk's rows are too many to stay there).
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

#include "fused_cpu_specs.h"  /* per kernel: its rows, scalars, flag bits and states (fastoptim/specs.py) */


/* One scalar argument: a shared value (stride 0) or one value per tensor (stride 1). A pointer,
   not a value, so a tensor lr or clip coefficient is read here without a host sync in Python. */
typedef struct { const float *values; int64_t stride; } Scalar;

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
   one fp32 absmax each, and per element the index of a code of its role's table (fused_cpu_specs.h):
   a magnitude k divided by its table's largest, top. The float-like tables' magnitudes are fp16
   numbers with 3 mantissa bits (magnitude k has the fp16 bits k << 7; SIGNED: k up to 127 with a
   sign, zero at index 127; UNSIGNED: k up to 247); LINEAR's are the whole numbers k up to 127, with
   a sign, zero at index 127. Every chunk starts on a block (the chunk plan makes sure), so each
   thread owns its blocks. It dequantizes a block's states into buffers on its stack, updates them
   there, and requantizes them: no dequantized copy of a state exists beyond those buffers. Adan's
   bf16 g_prev is widened into a buffer too: the update loop then reads and writes fp32 only, in 8
   lanes, where bf16 made GCC spill (measured 4% faster).
   With fp32 or bf16 states, a whole run is one block and the states are updated where they are.

   Converting is most of an 8-bit step's work, and GCC does not vectorise fp16 conversions, so the
   block functions come twice: with AVX2 and F16C's conversions, 8 elements an instruction, where
   the CPU has them, and portable C that finds the same codes from fp32 bits. LINEAR's come twice
   too, their AVX2 path taken with the float-like tables' (use_f16c).

   A non-finite element keeps an index of its own that decodes to itself (UNSIGNED: +inf at 248,
   NaN at 255; SIGNED and LINEAR: NaN at 255, for ±inf too), and the block's absmax is its finite
   elements'. Such blocks are rare: the vectorised quantizer leaves them to the portable one. */
#define BLOCK 256
enum { BF16_VALUES = CODE_TABLES };  /* no code table: Adan's g_prev, bf16 */

INLINE float table_top(int table) { return table == SIGNED ? 1.875f : table == LINEAR ? 127.f : 61440.f; }
INLINE int32_t last(int table) { return table == UNSIGNED ? 247 : 127; }
enum { UNSIGNED_INF_INDEX = 248, NAN_INDEX = 255 };
#define INF_BITS 0x7f800000  /* +inf's bits: |x|'s bits are at least these where x is not finite */

/* Magnitude k as fp32 (exact): LINEAR's is k; a float-like one is fp16's bits moved into fp32's,
   its exponent rebased from fp16's bias (15) to fp32's (127), and below 8 an fp16 subnormal, k·2^-17. */
INLINE float magnitude(int32_t k, int table) {
    if (table == LINEAR) return (float)k;
    const int32_t bits = (k << 20) + ((127 - 15) << 23);
    float normal;
    memcpy(&normal, &bits, sizeof normal);
    return k < 8 ? (float)k * 0x1p-17f : normal;
}

INLINE float dequantize(uint8_t index, float absmax, int table) {
    if (index > (table == UNSIGNED ? last(table) : 127 + last(table)))  /* not a code: a non-finite value */
        return table == UNSIGNED && index == UNSIGNED_INF_INDEX ? INFINITY : NAN;
    const int32_t k = table == UNSIGNED ? index : index - 127;
    const float code = magnitude(k < 0 ? -k : k, table) * (1 / table_top(table));  /* a product: no division */
    return (k < 0 ? -code : code) * absmax;
}

/* t rounded to a whole number, a tie going up (t + 0.5 would round some t below a tie up first). */
INLINE int32_t round_half_up(float t) {
    const float whole = floorf(t);
    return (int32_t)whole + (t - whole >= 0.5f);
}

/* The index of the magnitude nearest to t = |x|·scale, a tie going up. LINEAR: t rounded whole.
   Float-like: from t's fp32 bits, rounding away the 20 bits below fp16's 3 and rebasing the
   exponent; below fp16's normal range (2^-14), by rounding t·2^17 whole. */
INLINE uint8_t quantize(float x, float scale, int table) {
    if (!isfinite(x)) return table == UNSIGNED && x > 0 ? UNSIGNED_INF_INDEX : NAN_INDEX;
    const float t = fabsf(x) * scale;
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    const int32_t normal = ((bits + (1 << 19)) >> 20) - ((127 - 15) << 3);
    const int32_t subnormal = round_half_up((t < 0x1p-14f ? t : 0x1p-14f) * 0x1p17f);  /* clamped: no overflow */
    int32_t k = table == LINEAR ? round_half_up(t) : t < 0x1p-14f ? subnormal : normal;
    k = k > last(table) ? last(table) : k;
    return (uint8_t)(table == UNSIGNED ? k : x < 0 ? 127 - k : 127 + k);
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

/* quantize() of LINEAR on 32 elements at a time: t = |x|·scale rounded whole, a tie going up, as
   the floor plus whether t's fraction is at least 1/2 (exact); the sign from x's sign bit. */
F16C static void quantize_linear_avx2(const float *restrict values, int64_t n, uint8_t *restrict codes, float scale) {
    const __m256 scale8 = _mm256_set1_ps(scale), half = _mm256_set1_ps(0.5f);
    const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX));
    const __m256i largest = _mm256_set1_epi32(last(LINEAR)), zero = _mm256_set1_epi32(127);
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        __m256i index[4];
        for (int j = 0; j < 4; j++) {
            const __m256 x = _mm256_loadu_ps(values + k + 8 * j), t = _mm256_mul_ps(_mm256_and_ps(x, no_sign), scale8);
            const __m256 whole = _mm256_floor_ps(t);
            const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(_mm256_sub_ps(t, whole), half, _CMP_GE_OQ));
            const __m256i m = _mm256_min_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(whole), up), largest);  /* up: -1 */
            index[j] = _mm256_add_epi32(_mm256_sign_epi32(m, _mm256_castps_si256(x)), zero);
        }
        /* the packs interleave the four quarters' 128-bit lanes; the permute puts them back in order */
        const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(index[0], index[1]),
                                                  _mm256_packs_epi32(index[2], index[3]));
        _mm256_storeu_si256((__m256i *)(codes + k), _mm256_permutevar8x32_epi32(bytes, in_order));
    }
    for (; k < n; k++) codes[k] = quantize(values[k], scale, LINEAR);
}

F16C static void dequantize_linear_avx2(const uint8_t *restrict codes, float absmax, int64_t n,
                                       float *restrict values) {
    const __m256 absmax8 = _mm256_set1_ps(absmax), inverse_top = _mm256_set1_ps(1 / table_top(LINEAR));
    const __m256 nan = _mm256_set1_ps(NAN);
    const __m256i zero = _mm256_set1_epi32(127), nan_index = _mm256_set1_epi32(NAN_INDEX);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + k)));
        const __m256 code = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(index, zero)), inverse_top);
        const __m256 not_code = _mm256_castsi256_ps(_mm256_cmpeq_epi32(index, nan_index));
        _mm256_storeu_ps(values + k, _mm256_blendv_ps(_mm256_mul_ps(code, absmax8), nan, not_code));
    }
    for (; k < n; k++) values[k] = dequantize(codes[k], absmax, LINEAR);
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
    if (use_f16c && finite && table == LINEAR) quantize_linear_avx2(values, n, codes, scale);
    else if (use_f16c && finite) quantize_block_f16c(values, n, codes, scale, table);
    else IVDEP for (int64_t k = 0; k < n; k++) codes[k] = quantize(values[k], scale, table);
    *absmax = top;
}

INLINE void dequantize_block(const uint8_t *restrict codes, float absmax, int64_t n, float *restrict values, int table) {
    if (use_f16c && table == LINEAR) dequantize_linear_avx2(codes, absmax, n, values);
    else if (use_f16c) dequantize_block_f16c(codes, absmax, n, values, table);
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
   the functions below, so each walk is specialised for it). */
typedef struct {
    void *data;
    float *absmax;        /* Q8: one per block; NULL for a state without codes (fp32 or bf16) */
    int table;            /* Q8: its code table; BF16_VALUES for bf16 values, held in the block
                             too, so that the update loop reads and writes fp32 only */
    float *block;         /* Q8: the values of the block being updated */
    int64_t first;        /* Q8: that block's first element */
} State;

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

/* --- The algorithms --------------------------------------------------------------------------

   Every algorithm runs on one walk over memory (walk(), below). The walk sees an element as x, its
   values by row of the pointer table (fused_cpu_specs.h): x[PARAM], x[GRAD] unscaled (the
   algorithm applies grad_scale) and x[<state row>], all fp32 whatever the formats; under sn, a
   reduced state's value is its subset's. An algorithm `name` (X(name, NAME) in FOR_EACH_KERNEL)
   provides:
     name_scalars, name_scalars_of(w, t)  its scalars, as its functions take them, loaded for tensor
                                          t (reciprocals once per tensor: one division per element
                                          is what the core can afford)
     name_squared(s, x)                   q, whose square its second moment takes (in the subset
                                          sums x holds only the states readable in place: fp32 or
                                          bf16, not 8-bit codes)
     name_second_moments(s, x, q, form, flags)  its reduced states after q (one form, below),
                                          amsgrad's maximum included
     name_step_scale(s, x, flags)         the scale its update takes from the second moment
     name_update(s, x, scale, flags)      the new x[PARAM] and per-element states, given that scale
     NAME_VARIANTS(V, ...)                the flag combinations its kernels are compiled for
   An algorithm with no second moment writes the three functions about it as stubs: the walk's
   subset paths never run for it, but they compile. */

/* The forms of a second moment's update, v = β·v + (1−β)·Σq², each rounded in the order its path
   always has: an element's, (1−β)·q·q in torch's addcmul order (q² alone overflows sooner); a
   subset's, from the sum of its q²; a column's, decayed, then fed one row's q at a time, then
   whole. */
enum { ELEMENT, SUBSET, COLUMN_DECAY, COLUMN_ADD, COLUMN_END };

INLINE float average_of_squares(float v, float q, float beta, float one_minus_beta, int form) {
    switch (form) {
        case ELEMENT: return v * beta + one_minus_beta * q * q;
        case SUBSET: return v * beta + q * one_minus_beta;  /* q: the sum of the subset's q² */
        case COLUMN_DECAY: return v * beta;
        case COLUMN_ADD: return v + q * q * one_minus_beta;
        default: return v;
    }
}

/* Whether the second moment is whole after ``form`` (not a column's partial sum): what follows
   from it (amsgrad's maximum) is taken then. A partial sum changes the second moment only. */
INLINE int whole(int form) { return form != COLUMN_DECAY && form != COLUMN_ADD; }

/* --- Adan ----------------------------------------------------------------------------------- */

typedef struct {
    float beta1, beta2, beta3, one_minus_beta1, one_minus_beta2, one_minus_beta3, eps, grad_scale;
    float pre_grad_weight, inv_bias_correction3_sqrt, step_size, diff_ratio, decay_mul, inv_decay_div;
} adan_scalars;

/* 1 − β comes from Python, computed in double as the reference does, not from the rounded β. */
INLINE adan_scalars adan_scalars_of(const Work *w, int64_t t) {
    return (adan_scalars){
        scalar(w, ADAN_BETA1, t), scalar(w, ADAN_BETA2, t), scalar(w, ADAN_BETA3, t),
        scalar(w, ADAN_ONE_MINUS_BETA1, t), scalar(w, ADAN_ONE_MINUS_BETA2, t), scalar(w, ADAN_ONE_MINUS_BETA3, t),
        scalar(w, ADAN_EPS, t), scalar(w, GRAD_SCALE, t), scalar(w, ADAN_PRE_GRAD_WEIGHT, t),
        1 / scalar(w, ADAN_BIAS_CORRECTION3_SQRT, t), scalar(w, ADAN_STEP_SIZE, t), scalar(w, ADAN_DIFF_RATIO, t),
        scalar(w, ADAN_DECAY_MUL, t), 1 / scalar(w, ADAN_DECAY_DIV, t)};
}

typedef struct { float neg_g, d, u; } AdanTerms;

INLINE AdanTerms adan_terms(const adan_scalars *s, const float *x) {
    const float neg_g = x[GRAD] * -s->grad_scale;
    const float d = (x[ADAN_NEG_PRE_GRAD] - neg_g) * s->pre_grad_weight;  /* g − g_prev (0 at a first step) */
    return (AdanTerms){neg_g, d, d * s->beta2 - neg_g};                   /* u = g + β2·d */
}

INLINE float adan_squared(const adan_scalars *s, const float *x) { return adan_terms(s, x).u; }

/* exp_avg_sq: n = β3·n + (1−β3)·u² */
INLINE void adan_second_moments(const adan_scalars *s, float *x, float u, int form, int flags) {
    x[ADAN_EXP_AVG_SQ] = average_of_squares(x[ADAN_EXP_AVG_SQ], u, s->beta3, s->one_minus_beta3, form);
}

/* step_size / denom, from exp_avg_sq (the element's or its subset's). */
INLINE float adan_step_scale(const adan_scalars *s, const float *x, int flags) {
    return s->step_size / (sqrtf(x[ADAN_EXP_AVG_SQ]) * s->inv_bias_correction3_sqrt + s->eps);
}

/* After exp_avg_sq: the moments m and v, g_prev, and the new value of param p. */
INLINE void adan_update(const adan_scalars *s, float *x, float scale, int flags) {
    const AdanTerms a = adan_terms(s, x);
    const float m = x[ADAN_EXP_AVG] * s->beta1 - a.neg_g * s->one_minus_beta1;
    const float v = x[ADAN_EXP_AVG_DIFF] * s->beta2 + a.d * s->one_minus_beta2;
    const float p = x[PARAM] * s->decay_mul - m * scale - v * (scale * s->diff_ratio);  /* 1 − lr·wd with no_prox */
    x[PARAM] = p * s->inv_decay_div;                                                     /* 1 + lr·wd: prox */
    x[ADAN_EXP_AVG] = m, x[ADAN_EXP_AVG_DIFF] = v, x[ADAN_NEG_PRE_GRAD] = a.neg_g;
}

#define ADAN_VARIANTS(V, ...) V(__VA_ARGS__, plain, 0)

/* --- AdamW, AdamWSN and RMSPropSN ------------------------------------------------------------- */

typedef struct {
    float one_minus_beta1, beta2, one_minus_beta2, eps, grad_scale, decay_mul, decay_after, step_size;
    float inv_bias_correction2_sqrt;
} adamw_scalars;

INLINE adamw_scalars adamw_scalars_of(const Work *w, int64_t t) {
    return (adamw_scalars){
        scalar(w, ADAMW_ONE_MINUS_BETA1, t), scalar(w, ADAMW_BETA2, t), scalar(w, ADAMW_ONE_MINUS_BETA2, t),
        scalar(w, ADAMW_EPS, t), scalar(w, GRAD_SCALE, t), scalar(w, ADAMW_DECAY_MUL, t),
        scalar(w, ADAMW_DECAY_AFTER, t), scalar(w, ADAMW_STEP_SIZE, t),
        1 / scalar(w, ADAMW_BIAS_CORRECTION2_SQRT, t)};
}

INLINE float adamw_squared(const adamw_scalars *s, const float *x) { return x[GRAD] * s->grad_scale; }  /* g */

/* exp_avg_sq: v = β2·v + (1−β2)·g²; with amsgrad, max_exp_avg_sq: v̂ = max(v̂, v). */
INLINE void adamw_second_moments(const adamw_scalars *s, float *x, float g, int form, int flags) {
    x[ADAMW_EXP_AVG_SQ] = average_of_squares(x[ADAMW_EXP_AVG_SQ], g, s->beta2, s->one_minus_beta2, form);
    if (flags & ADAMW_AMSGRAD && whole(form))
        x[ADAMW_MAX_EXP_AVG_SQ] = larger(x[ADAMW_MAX_EXP_AVG_SQ], x[ADAMW_EXP_AVG_SQ]);
}

/* step_size / denom, from the second moment (the element's or its subset's; v̂ with amsgrad). */
INLINE float adamw_step_scale(const adamw_scalars *s, const float *x, int flags) {
    const float v = x[flags & ADAMW_AMSGRAD ? ADAMW_MAX_EXP_AVG_SQ : ADAMW_EXP_AVG_SQ];
    return s->step_size / (sqrtf(v) * s->inv_bias_correction2_sqrt + s->eps);
}

/* After the second moment: the first moment (the numerator; g itself without one) and the new
   value of param p. Weight decay multiplies before the update (AdamW) or after it (AdamWSN). */
INLINE void adamw_update(const adamw_scalars *s, float *x, float scale, int flags) {
    const float g = adamw_squared(s, x);
    float numerator = g;
    if (flags & ADAMW_FIRST_MOMENT) {
        x[ADAMW_EXP_AVG] += (g - x[ADAMW_EXP_AVG]) * s->one_minus_beta1;  /* lerp */
        numerator = x[ADAMW_EXP_AVG];
    }
    x[PARAM] = (x[PARAM] * s->decay_mul - numerator * scale) * s->decay_after;
}

/* amsgrad (with a first moment), AdamW's and AdamWSN's, and RMSPropSN's (no first moment) */
#define ADAMW_VARIANTS(V, ...) V(__VA_ARGS__, ams, ADAMW_AMSGRAD | ADAMW_FIRST_MOMENT) \
    V(__VA_ARGS__, plain, ADAMW_FIRST_MOMENT) V(__VA_ARGS__, rms, 0)

/* --- Lion ------------------------------------------------------------------------------------ */

typedef struct { float beta1, one_minus_beta1, beta2, one_minus_beta2, lr, decay_mul, grad_scale; } lion_scalars;

INLINE lion_scalars lion_scalars_of(const Work *w, int64_t t) {
    return (lion_scalars){
        scalar(w, LION_BETA1, t), scalar(w, LION_ONE_MINUS_BETA1, t), scalar(w, LION_BETA2, t),
        scalar(w, LION_ONE_MINUS_BETA2, t), scalar(w, LION_LR, t), scalar(w, LION_DECAY_MUL, t),
        scalar(w, GRAD_SCALE, t)};
}

/* Lion keeps no second moment. */
INLINE float lion_squared(const lion_scalars *s, const float *x) { return 0; }
INLINE void lion_second_moments(const lion_scalars *s, float *x, float q, int form, int flags) {}
INLINE float lion_step_scale(const lion_scalars *s, const float *x, int flags) { return 0; }

/* torch.sign, which the loop engine takes: ±1, and 0 at ±0 and at NaN ((0 < x) − (x < 0)). */
INLINE float sign(float x) { return x > 0 ? 1.f : x < 0 ? -1.f : 0.f; }

/* The sums are written (1−β)·g first: that is the product a CPU with FMA fuses into the sum, as
   torch's add_(g, alpha=1−β) does, so exp_avg and c match the loop engine's bit for bit there.
   p·(1 − lr·wd) − lr·sign(c) is one FMA, one rounding fewer than the loop's mul_ then sub_: written
   as one, since the compiler contracted it in some of the walk's specialisations and not in others
   (a bf16 param with a master remainder then left the fp32 run by an ulp). */
INLINE void lion_update(const lion_scalars *s, float *x, float scale, int flags) {
    const float g = x[GRAD] * s->grad_scale;
    const float c = g * s->one_minus_beta1 + x[LION_EXP_AVG] * s->beta1;      /* β1·m + (1−β1)·g */
    x[PARAM] = fmaf(x[PARAM], s->decay_mul, -s->lr * sign(c));                 /* decay_mul = 1 − lr·wd */
    x[LION_EXP_AVG] = g * s->one_minus_beta2 + x[LION_EXP_AVG] * s->beta2;    /* m = β2·m + (1−β2)·g */
}

#define LION_VARIANTS(V, ...) V(__VA_ARGS__, plain, 0)

/* --- Muon's momentum ------------------------------------------------------------------------ */

/* The elementwise half of a Muon step: x[PARAM] is the direction it writes (a buffer of the
   param's dtype, which the Newton-Schulz iterations then read), not a param. */
typedef struct { float momentum, one_minus_momentum, grad_scale; } muon_momentum_scalars;

INLINE muon_momentum_scalars muon_momentum_scalars_of(const Work *w, int64_t t) {
    return (muon_momentum_scalars){scalar(w, MUON_MOMENTUM_MOMENTUM, t), scalar(w, MUON_MOMENTUM_ONE_MINUS_MOMENTUM, t),
                                   scalar(w, GRAD_SCALE, t)};
}

/* Muon keeps no second moment. */
INLINE float muon_momentum_squared(const muon_momentum_scalars *s, const float *x) { return 0; }
INLINE void muon_momentum_second_moments(const muon_momentum_scalars *s, float *x, float q, int form, int flags) {}
INLINE float muon_momentum_step_scale(const muon_momentum_scalars *s, const float *x, int flags) { return 0; }

/* torch's lerp, start + w·(end − start) for |w| < 0.5, else end − (1 − w)·(end − start) with 1 − w
   taken in fp32; each is one FMA where the CPU has it, as torch's vectorized lerp. */
INLINE float lerp(float start, float end, float w) {
    const float difference = end - start;
    return fabsf(w) < 0.5f ? w * difference + start : (w - 1.f) * difference + end;
}

/* The grad times its scale, rounded to fp32 as the reference's scaled grad is: a plain product here
   would be contracted into the lerps' FMAs that are its only uses, unrounded (fma with -0 keeps the
   product's sign of zero). */
INLINE void muon_momentum_update(const muon_momentum_scalars *s, float *x, float scale, int flags) {
    const float g = fmaf(x[GRAD], s->grad_scale, -0.0f);
    const float m = lerp(x[MUON_MOMENTUM_MOMENTUM_BUFFER], g, s->one_minus_momentum);  /* μ·B + (1−μ)·g */
    x[MUON_MOMENTUM_MOMENTUM_BUFFER] = m;
    x[PARAM] = flags & MUON_MOMENTUM_NESTEROV ? lerp(g, m, s->momentum) : m;          /* g + μ·(B − g) */
}

#define MUON_MOMENTUM_VARIANTS(V, ...) V(__VA_ARGS__, nesterov, MUON_MOMENTUM_NESTEROV) V(__VA_ARGS__, plain, 0)

/* --- Muon's update ---------------------------------------------------------------------------- */

/* The elementwise second half of a Muon step: x[GRAD] is the orthogonalized direction O (a bf16 row
   whatever the param's dtype: MUON_APPLY_GRAD), which the grad scale does not touch. */
typedef struct { float decay_mul, step_size; } muon_apply_scalars;

INLINE muon_apply_scalars muon_apply_scalars_of(const Work *w, int64_t t) {
    return (muon_apply_scalars){scalar(w, MUON_APPLY_DECAY_MUL, t), scalar(w, MUON_APPLY_STEP_SIZE, t)};
}

/* Muon's update keeps no state. */
INLINE float muon_apply_squared(const muon_apply_scalars *s, const float *x) { return 0; }
INLINE void muon_apply_second_moments(const muon_apply_scalars *s, float *x, float q, int form, int flags) {}
INLINE float muon_apply_step_scale(const muon_apply_scalars *s, const float *x, int flags) { return 0; }

/* p·(1 − lr·wd) rounded (decay_mul is 1 without weight decay: p as it is), then p − step_size·O in
   one FMA, as torch's addcmul_ (and torch.optim.Muon's add_ with an alpha) computes it. */
INLINE void muon_apply_update(const muon_apply_scalars *s, float *x, float scale, int flags) {
    const float decayed = x[PARAM] * s->decay_mul;
    x[PARAM] = fmaf(-x[GRAD], s->step_size, decayed);
}

#define MUON_APPLY_VARIANTS(V, ...) V(__VA_ARGS__, plain, 0)

/* --- The walk --------------------------------------------------------------------------------

   walk() updates one chunk of one tensor for any algorithm: dense, each element with its own
   second moment; rows (c = 1), the subsets' sums of q², then their elements; columns, the same
   column by column. 8-bit states are opened and closed block by block around the elements. It is
   specialised (always-inline) for the kernel, the param dtype, its rounding, the flags and
   the states' format, all compile-time constants, so every branch on them below folds away. The
   kernel is an index, by which the walk calls its algorithm's functions. */

#define KERNEL_INDEX(name, NAME) KERNEL_##NAME,
enum { FOR_EACH_KERNEL(KERNEL_INDEX) };
#undef KERNEL_INDEX

#define SCALARS_MEMBER(name, NAME) name##_scalars name;
typedef union { FOR_EACH_KERNEL(SCALARS_MEMBER) } Scalars;

/* An algorithm's functions by its kernel index: each call folds to the one of its kernel. */
#define CALL_SCALARS_OF(name, NAME) if (kernel == KERNEL_##NAME) s.name = name##_scalars_of(w, t);
#define CALL_SQUARED(name, NAME) if (kernel == KERNEL_##NAME) return name##_squared(&s->name, x);
#define CALL_SECOND_MOMENTS(name, NAME) if (kernel == KERNEL_##NAME) name##_second_moments(&s->name, x, q, form, flags);
#define CALL_STEP_SCALE(name, NAME) if (kernel == KERNEL_##NAME) return name##_step_scale(&s->name, x, flags);
#define CALL_UPDATE(name, NAME) if (kernel == KERNEL_##NAME) name##_update(&s->name, x, scale, flags);
INLINE Scalars scalars_of(int kernel, const Work *w, int64_t t) {
    Scalars s = {0};
    FOR_EACH_KERNEL(CALL_SCALARS_OF) return s;
}
INLINE float squared(int kernel, const Scalars *s, const float *x) { FOR_EACH_KERNEL(CALL_SQUARED) return 0; }
INLINE void second_moments(int kernel, const Scalars *s, float *x, float q, int form, int flags) {
    FOR_EACH_KERNEL(CALL_SECOND_MOMENTS)
}
INLINE float step_scale(int kernel, const Scalars *s, const float *x, int flags) {
    FOR_EACH_KERNEL(CALL_STEP_SCALE) return 0;
}
INLINE void update(int kernel, const Scalars *s, float *x, float scale, int flags) { FOR_EACH_KERNEL(CALL_UPDATE) }

/* A kernel's states: the end of their rows, and per row (the header's TABLES, REDUCED and NEEDS)
   its code table, whether it is per subset under sn, the flag it needs. */
typedef struct { int table, reduced, needs; } Role;
#define STATES_END_OF(name, NAME) if (kernel == KERNEL_##NAME) return NAME##_STATES_END;
#define ROLE_OF(name, NAME) if (kernel == KERNEL_##NAME) {                                                \
        static const int tables[] = NAME##_TABLES, reduced[] = NAME##_REDUCED, needs[] = NAME##_NEEDS;      \
        return (Role){tables[row - FIRST_STATE], reduced[row - FIRST_STATE], needs[row - FIRST_STATE]}; }
#define REMAINDER_OF(name, NAME) if (kernel == KERNEL_##NAME) return NAME##_REMAINDER;
#define GRAD_OF(name, NAME) if (kernel == KERNEL_##NAME && NAME##_GRAD >= 0) return NAME##_GRAD;
INLINE int states_end(int kernel) { FOR_EACH_KERNEL(STATES_END_OF) return FIRST_STATE; }
INLINE int remainder_row(int kernel) { FOR_EACH_KERNEL(REMAINDER_OF) return 0; }
INLINE Role role(int kernel, int row) { FOR_EACH_KERNEL(ROLE_OF) return (Role){0}; }
/* The format of the grad row beside params of format ``dtype``: theirs, unless the kernel declares its own. */
INLINE int grad_dtype(int kernel, int dtype) { FOR_EACH_KERNEL(GRAD_OF) return dtype; }

/* For each state row r of a kernel: unrolled, so that each state is its own variables. */
#define EACH_STATE(kernel, r) _Pragma("GCC unroll 8") for (int r = FIRST_STATE; r < states_end(kernel); r++)

/* Whether the flags keep state ``row``; whether it has a value per element (not per subset); and
   whether it is one kept per subset. */
INLINE int kept(int kernel, int row, int flags) { return !role(kernel, row).needs || flags & role(kernel, row).needs; }
INLINE int per_element(int kernel, int row, int flags, int subsets) {
    return kept(kernel, row, flags) && !(subsets && role(kernel, row).reduced);
}
INLINE int per_subset(int kernel, int row, int flags) { return kept(kernel, row, flags) && role(kernel, row).reduced; }

/* Whether ``row`` is the second moment the subset sums feed: the kernel's first reduced state. */
INLINE int summed(int kernel, int row) {
    EACH_STATE(kernel, r) if (role(kernel, r).reduced) return r == row;
    return 0;
}

/* One tensor of the walk: its algorithm's scalars, its states by row (none at PARAM and GRAD). */
typedef struct {
    Scalars s;
    State states[FIRST_STATE + MAX_STATES];
    void *param;
    const void *grad;
    void *remainder;  /* the param's master remainder (int8 or int16), under REMAINDER8 or REMAINDER16 */
    uint32_t seed;
    int64_t t;
} Tensor;

/* How a bf16 param holds its fp32 value (fastoptim/states/master.py): rounded to nearest even or
   stochastically, or beside an 8- or 16-bit remainder, which the param's bits shifted up plus the
   remainder (shifted by the bits it drops) make the fp32 master; the param alone where they make a
   NaN (a remainder left beside a value written behind the optimizer's back: a zero and a negative
   remainder, say). */
enum { NEAREST, STOCHASTIC, REMAINDER8, REMAINDER16 };
#define DROPPED_BITS 8  /* the low bits of the 16-bit difference that an 8-bit remainder drops */

INLINE float load_param(const Tensor *T, int64_t i, int dtype, int rounding) {
    if (rounding < REMAINDER8) return load(T->param, i, dtype);
    const float param = load(T->param, i, BF16);
    const int32_t low = rounding == REMAINDER16 ? ((const int16_t *)T->remainder)[i]
                                                : ((const int8_t *)T->remainder)[i] * (1 << DROPPED_BITS);
    uint32_t bits;
    memcpy(&bits, &param, sizeof bits);
    bits += (uint32_t)low;
    float x;
    memcpy(&x, &bits, sizeof x);
    return isnan(x) ? param : x;  /* a NaN param widens to a NaN: the param, as store_param writes it */
}

/* The fp32 result back into the param: rounded (store), or split into the param, the master's bits
   rounded to nearest with ties away from zero, and the remainder, their signed difference (for 8
   bits its top 8, rounded, at most 127). A NaN goes to the param with a zero remainder. */
INLINE void store_param(Tensor *T, int64_t i, float x, int dtype, int rounding) {
    if (rounding < REMAINDER8) {
        store(T->param, i, x, dtype, rounding == STOCHASTIC, T->seed, T->t);
        return;
    }
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t top = (bits + 0x8000u) & 0xffff0000u;
    const int32_t difference = (int32_t)(bits - top);
    const int32_t kept = (difference + (1 << (DROPPED_BITS - 1))) >> DROPPED_BITS;
    ((uint16_t *)T->param)[i] = isnan(x) ? (uint16_t)((bits >> 16) | 0x40u) : (uint16_t)(top >> 16);
    if (rounding == REMAINDER16) ((int16_t *)T->remainder)[i] = isnan(x) ? 0 : (int16_t)difference;
    else ((int8_t *)T->remainder)[i] = isnan(x) ? 0 : (int8_t)(kept < 127 ? kept : 127);
}

/* Element i: its values into x, its second moment's update when it has its own (dense) and else
   the scale of its subset's, the algorithm's update, and the values back. */
INLINE void update_element(int kernel, Tensor *T, int64_t i, float scale, int dense, int dtype, int rounding,
                           int flags, int states) {
    float x[FIRST_STATE + MAX_STATES] = {0};
    x[PARAM] = load_param(T, i, dtype, rounding);
    x[GRAD] = load(T->grad, i, grad_dtype(kernel, dtype));
    EACH_STATE(kernel, r) if (per_element(kernel, r, flags, !dense)) x[r] = get(&T->states[r], i, states);
    if (dense) {
        second_moments(kernel, &T->s, x, squared(kernel, &T->s, x), ELEMENT, flags);
        scale = step_scale(kernel, &T->s, x, flags);
    }
    update(kernel, &T->s, x, scale, flags);
    EACH_STATE(kernel, r) if (per_element(kernel, r, flags, !dense)) put(&T->states[r], i, x[r], states);
    store_param(T, i, x[PARAM], dtype, rounding);
}

/* q of element i for the subset sums, before the element's update: from its grad and the states
   readable where they are (fp32 or bf16; under Q8 the half ones, bf16), not from blocks. */
INLINE float squared_in_place(int kernel, const Tensor *T, int64_t i, int dtype, int flags, int states) {
    float x[FIRST_STATE + MAX_STATES] = {0};
    x[GRAD] = load(T->grad, i, grad_dtype(kernel, dtype));
    EACH_STATE(kernel, r)
        if (per_element(kernel, r, flags, 1) && (states != Q8 || role(kernel, r).table == BF16_VALUES))
            x[r] = load(T->states[r].data, i, states == Q8 ? BF16 : states);
    return squared(kernel, &T->s, x);
}

/* The second moments of subset (or column) k, fp32, one per subset, after q in ``form``. */
INLINE void subset_moments(int kernel, Tensor *T, int64_t k, float q, int form, int flags) {
    float x[FIRST_STATE + MAX_STATES] = {0};
    EACH_STATE(kernel, r) if (per_subset(kernel, r, flags)) x[r] = ((float *)T->states[r].data)[k];
    second_moments(kernel, &T->s, x, q, form, flags);
    EACH_STATE(kernel, r)
        if (per_subset(kernel, r, flags) && (whole(form) || summed(kernel, r))) ((float *)T->states[r].data)[k] = x[r];
}

INLINE float subset_scale(int kernel, const Tensor *T, int64_t k, int flags) {
    float x[FIRST_STATE + MAX_STATES] = {0};
    EACH_STATE(kernel, r) if (per_subset(kernel, r, flags)) x[r] = ((const float *)T->states[r].data)[k];
    return step_scale(kernel, &T->s, x, flags);
}

/* The sum of q² over elements [from, to), in SUM_LANES lanes (the element at from + i in lane i mod
   SUM_LANES, each lane in element order, with one rounding per element), whose totals then add
   pairwise: one order in every specialisation. An omp simd reduction lets the compiler pick its own
   lanes per specialisation: under AVX2, a bf16 param's subset sums and an fp32 param's of the same
   values differed, and a master_bits=32 master left its fp32 run by an ulp. A subset of fewer elements
   fills only the first ``used`` lanes (a power of two): the others would stay zeros, and adding a zero
   leaves every lane as it is (each is +0, a square or a NaN), so its sums start at the half of ``used``,
   the same number without 64 lanes' worth of adds per subset (a 4x4 matrix's rows spent most of their
   step there, its scalar stores stalling the vector adds that read them back). */
#define SUM_LANES 64  /* 4 AVX-512 or 8 AVX2 vectors of sums: FMAs that do not wait on each other */
INLINE float sum_of_squares(int kernel, const Tensor *T, int64_t from, int64_t to, int dtype, int flags, int states) {
    float lanes[SUM_LANES] = {0};  /* all of them, in vector stores, which the vector loads after read back */
    int used = SUM_LANES;
    if (to - from < SUM_LANES)
        for (used = 1; used < to - from; used *= 2) {}
    int64_t i = from;
    for (; i + SUM_LANES <= to; i += SUM_LANES)
        for (int j = 0; j < SUM_LANES; j++) {
            const float q = squared_in_place(kernel, T, i + j, dtype, flags, states);
            lanes[j] = fmaf(q, q, lanes[j]);
        }
    for (int j = 0; i + j < to; j++) {
        const float q = squared_in_place(kernel, T, i + j, dtype, flags, states);
        lanes[j] = fmaf(q, q, lanes[j]);
    }
    switch (used) {  /* each width a constant: unrolled adds, no loop branches to mispredict per subset */
#define HALVE(width) for (int j = 0; j < (width); j++) lanes[j] += lanes[j + (width)]
    case 64: HALVE(32);  /* fall through */
    case 32: HALVE(16);  /* fall through */
    case 16: HALVE(8);   /* fall through */
    case 8: HALVE(4);    /* fall through */
    case 4: HALVE(2);    /* fall through */
    case 2: HALVE(1);
#undef HALVE
    }
    return lanes[0];
}

enum { DENSE, ROWS, COLUMNS };  /* how update_elements finds an element's second moment */

/* Updates elements [from, to), block by block (one block, unless the states are 8-bit): dense,
   each with its own second moment; ROWS, subset k's elements [k·b, (k+1)·b) with its scale;
   COLUMNS, rows of c elements, each with the scale of its column's. */
INLINE void update_elements(int kernel, Tensor *T, int64_t from, int64_t to, int64_t b, int64_t c, int layout,
                            int dtype, int rounding, int flags, int states) {
    const int subsets = layout != DENSE;
    for (int64_t i0 = from, i1; i0 < to; i0 = i1) {
        i1 = block_end(i0, to, states);
        EACH_STATE(kernel, r) if (per_element(kernel, r, flags, subsets)) open_block(&T->states[r], i0, i1, states);
        if (!subsets) {
            IVDEP for (int64_t i = i0; i < i1; i++)
                update_element(kernel, T, i, 0, 1, dtype, rounding, flags, states);
        } else {
            const int64_t size = layout == ROWS ? b : c;  /* the block cut into subsets, or into rows */
            for (int64_t k = i0 / size; k * size < i1; k++) {
                const int64_t first = k * size > i0 ? k * size : i0, last = (k + 1) * size < i1 ? (k + 1) * size : i1;
                if (layout == ROWS) {
                    const float scale = subset_scale(kernel, T, k, flags);
                    IVDEP for (int64_t i = first; i < last; i++)
                        update_element(kernel, T, i, scale, 0, dtype, rounding, flags, states);
                } else {
                    IVDEP for (int64_t i = first; i < last; i++)
                        update_element(kernel, T, i, subset_scale(kernel, T, i - k * c, flags), 0, dtype, rounding,
                                       flags, states);
                }
            }
        }
        EACH_STATE(kernel, r) if (per_element(kernel, r, flags, subsets)) close_block(&T->states[r], i0, i1, states);
    }
}

/* ``states``: the format of the param-shaped states (see the top of the file). */
INLINE void walk(int kernel, const Work *w, int64_t t, int64_t start, int64_t count, int dtype, int rounding,
                 int flags, int states) {
    float blocks[MAX_STATES][BLOCK];
    Tensor T = {.s = scalars_of(kernel, w, t), .param = row(w, PARAM, t), .grad = row(w, GRAD, t),
                .remainder = row(w, remainder_row(kernel), t), .seed = (uint32_t)scalar(w, SEED, t), .t = t};
    EACH_STATE(kernel, r)  /* the rows of the states' block maxima follow the states' */
        if (kept(kernel, r, flags))
            T.states[r] = (State){row(w, r, t), row(w, r - FIRST_STATE + states_end(kernel), t), role(kernel, r).table,
                                  blocks[r - FIRST_STATE], 0};
    const int64_t b = layout(w, t, SUBSET_ROWS), c = layout(w, t, SUBSET_COLUMNS), end = start + count;
    if (b == 1) {                                           /* dense: each element its own second moment */
        update_elements(kernel, &T, start, end, b, c, DENSE, dtype, rounding, flags, states);
        return;
    }
    if (c == 1) {                                           /* rows: subset k is elements [k·b, (k+1)·b) */
        for (int64_t k = start / b; k < end / b; k++)
            subset_moments(kernel, &T, k, sum_of_squares(kernel, &T, k * b, (k + 1) * b, dtype, flags, states),
                           SUBSET, flags);
        update_elements(kernel, &T, start, end, b, c, ROWS, dtype, rounding, flags, states);
        return;
    }
    /* columns: the chunk's elements / b of b rows; under Q8 all c of them (the chunk plan makes
       sure), so the rows make one run of whole blocks */
    const int64_t j0 = start / b, j1 = end / b;
    IVDEP for (int64_t j = j0; j < j1; j++) subset_moments(kernel, &T, j, 0, COLUMN_DECAY, flags);
    for (int64_t r = 0; r < b; r++)
        IVDEP for (int64_t j = j0; j < j1; j++)
            subset_moments(kernel, &T, j, squared_in_place(kernel, &T, r * c + j, dtype, flags, states), COLUMN_ADD,
                           flags);
    IVDEP for (int64_t j = j0; j < j1; j++) subset_moments(kernel, &T, j, 0, COLUMN_END, flags);
    for (int64_t r = 0; r < (states == Q8 ? 1 : b); r++)
        update_elements(kernel, &T, states == Q8 ? 0 : r * c + j0, states == Q8 ? b * c : r * c + j1, b, c, COLUMNS,
                        dtype, rounding, flags, states);
}

/* The trivial-math twin of Adan's traffic (6 reads, 5 writes of fp32): the bandwidth it reaches
   is what the Adan kernel is measured against. */
INLINE void probe_body(const Work *w, int64_t t, int64_t start, int64_t count) {
    float *restrict p = (float *)row(w, PARAM, t) + start;
    const float *restrict g = (const float *)row(w, GRAD, t) + start;
    float *restrict a = (float *)row(w, ADAN_EXP_AVG, t) + start;
    float *restrict b = (float *)row(w, ADAN_EXP_AVG_SQ, t) + start;
    float *restrict c = (float *)row(w, ADAN_EXP_AVG_DIFF, t) + start;
    float *restrict e = (float *)row(w, ADAN_NEG_PRE_GRAD, t) + start;
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

/* The specialisations: one chunk function per (kernel, flag variant, dtype, rounding), which picks
   the walk for the tensor's state format. */
#define BY_STATES(w, t, BODY, ...) switch (layout(w, t, STATES)) {                                      \
        case BF16: BODY(__VA_ARGS__, BF16); break;                                                      \
        case Q8: BODY(__VA_ARGS__, Q8); break;                                                          \
        default: BODY(__VA_ARGS__, FP32); }
#define CHUNK(k) const int64_t t = w->chunks[4 * k], s = w->chunks[4 * k + 1], c = w->chunks[4 * k + 2]
#define WALK_CHUNK(NAME, KERNEL, DTYPE, SR, FLAGS) VECTORISED static void NAME(const Work *w, int64_t k) { \
    CHUNK(k); BY_STATES(w, t, walk, KERNEL, w, t, s, c, DTYPE, SR, FLAGS) }
#define VARIANT_CHUNKS(name, NAME, variant, FLAGS)                                   \
    WALK_CHUNK(name##_##variant##_fp32, KERNEL_##NAME, FP32, NEAREST, FLAGS)         \
    WALK_CHUNK(name##_##variant##_bf16, KERNEL_##NAME, BF16, NEAREST, FLAGS)         \
    WALK_CHUNK(name##_##variant##_bf16_sr, KERNEL_##NAME, BF16, STOCHASTIC, FLAGS)   \
    WALK_CHUNK(name##_##variant##_bf16_r8, KERNEL_##NAME, BF16, REMAINDER8, FLAGS)   \
    WALK_CHUNK(name##_##variant##_bf16_r16, KERNEL_##NAME, BF16, REMAINDER16, FLAGS) \
    WALK_CHUNK(name##_##variant##_fp16, KERNEL_##NAME, FP16, NEAREST, FLAGS)
#define KERNEL_CHUNKS(name, NAME) NAME##_VARIANTS(VARIANT_CHUNKS, name, NAME)
FOR_EACH_KERNEL(KERNEL_CHUNKS)
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
/* Elements per thread below which another thread is not woken: waking a parked thread can cost
   milliseconds on a shared machine, far more than such a share of work (torch's elementwise ops keep
   a grain of 32k elements for the same reason). Small steps run on the calling thread alone. */
#define GRAIN_NUMEL (1 << 16)

/* The first chunk in [begin, end) that does not start before element ``target``. */
static int64_t chunk_at(const int64_t *chunks, int64_t begin, int64_t end, int64_t target) {
    while (begin < end) {
        int64_t mid = begin + (end - begin) / 2;
        if (chunks[4 * mid + 3] < target) begin = mid + 1; else end = mid;
    }
    return begin;
}

/* Runs chunks [chunk_begin, chunk_end) on up to n_threads threads (the caller is one of them), one
   per GRAIN_NUMEL elements at most. */
static int run(ChunkFn chunk, const int64_t *pointers, int64_t n_tensors, const int64_t *chunks,
               int64_t chunk_begin, int64_t chunk_end, const int64_t *layouts, const Scalar *scalars,
               void *extra, int32_t n_threads) {
    if (!chunk) return -1;
    if (scalars && scalars[FOUND_INF].values[0] != 0) return 0;  /* GradScaler found inf: skip */
    const Work w = {.pointers = pointers, .n_tensors = n_tensors, .chunks = chunks, .layouts = layouts,
                    .scalars = scalars, .chunk = chunk, .extra = extra};
    const int64_t n_chunks = chunk_end - chunk_begin;
    const int64_t first = n_chunks ? chunks[4 * chunk_begin + 3] : 0;
    const int64_t total = n_chunks ? chunks[4 * (chunk_end - 1) + 3] + chunks[4 * (chunk_end - 1) + 2] - first : 0;
    int64_t n = n_threads < n_chunks ? n_threads : n_chunks;
    if (n > total / GRAIN_NUMEL) n = total / GRAIN_NUMEL;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n < 1) n = 1;
    Share shares[MAX_THREADS];
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

static ChunkFn pick(ChunkFn fp32, ChunkFn bf16, ChunkFn fp16, int32_t dtype) {
    switch (dtype) {
        case FP32: return fp32;
        case BF16: return bf16;
        case FP16: return fp16;
        default: return NULL;
    }
}

/* fastoptim_<name> for every kernel: the chunk function of its flags' variant (flags outside its
   variants are refused, as a dtype without a kernel is) and its dtype. */
#define PICK_VARIANT(name, NAME, variant, FLAGS)                                                          \
    if ((flags & ~STOCHASTIC_ROUNDING) == (FLAGS))                                                      \
        chunk = dtype == BF16_R8 ? name##_##variant##_bf16_r8                                            \
              : dtype == BF16_R16 ? name##_##variant##_bf16_r16                                          \
              : pick(name##_##variant##_fp32, flags & STOCHASTIC_ROUNDING ? name##_##variant##_bf16_sr       \
                     : name##_##variant##_bf16, name##_##variant##_fp16, dtype);
#define ENTRY_POINT(name, NAME)                                                                           \
    int fastoptim_##name(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t chunk_begin, \
                         int64_t chunk_end, const int64_t *layouts, const Scalar *scalars, int32_t dtype,         \
                         int32_t flags, int32_t n_threads) {                                                       \
        ChunkFn chunk = NULL;                                                                                     \
        NAME##_VARIANTS(PICK_VARIANT, name, NAME)                                                                  \
        return run(chunk, pointers, n_tensors, chunks, chunk_begin, chunk_end, layouts, scalars, NULL, n_threads); \
    }
FOR_EACH_KERNEL(ENTRY_POINT)

int fastoptim_probe(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t chunk_begin,
                    int64_t chunk_end, int32_t n_threads) {
    return run(probe_fp32, pointers, n_tensors, chunks, chunk_begin, chunk_end, NULL, NULL, NULL, n_threads);
}


/* ``inf``: the largest magnitude, else the sum of squares, of each chunk into partials[chunk]. */
int fastoptim_grad_norm(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t n_chunks,
                        int32_t dtype, int32_t inf, double *partials, int32_t n_threads) {
    ChunkFn chunk = inf ? pick(norm_inf_fp32, norm_inf_bf16, norm_inf_fp16, dtype)
                        : pick(norm2_fp32, norm2_bf16, norm2_fp16, dtype);
    return run(chunk, pointers, n_tensors, chunks, 0, n_chunks, NULL, NULL, partials, n_threads);
}

int fastoptim_scale_grads(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t n_chunks,
                          int32_t dtype, const float *factor, int32_t n_threads) {
    ChunkFn chunk = pick(scale_fp32, scale_bf16, scale_fp16, dtype);
    return run(chunk, pointers, n_tensors, chunks, 0, n_chunks, NULL, NULL, (void *)factor, n_threads);
}
