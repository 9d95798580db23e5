/* Part of fused_cpu.c, which includes its parts in this order as one translation unit: common.h,
   formats.h, algorithms.h, walk.h, clip.h, threads.h. */

/* --- The work table, its scalars, and loads and stores in the params' dtypes --------------- */

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
