/* Part of fused_cpu.c, which includes its parts in this order as one translation unit: common.h,
   formats.h, algorithms.h, walk.h, clip.h, threads.h. */

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
