/* AdamW's step over 8-bit states in two formats, for benchmarks/eight_bit_speed.py (issue 33): a
   prototype walk, not a kernel of the library. It runs one AdamW step over [begin, end) in blocks of
   256 elements, each block's states decoded into fp32, updated, and encoded back, as the fused CPU
   kernel's walk does with its 8-bit states:
   - FP32: the states are fp32 arrays, read and written in place (no codec): the bytes' reference;
   - BLOCKWISE: fastoptim's format, through the library's own codecs (fastoptim_quantize and
     fastoptim_dequantize of fastoptim/kernels/fused_cpu.c, passed in as function pointers);
   - COMPANDED: the table-free format of benchmarks/eight_bit_formats.py (FlashOptim's), written here:
     groups of 32 with an fp16 scale; m as round(254 · softsign(m / absmax)), v as round(255 · √v / max).
   Non-finite values are not handled by the companded codec (the library's format spends a compare per
   element on them): its figures are a lower bound of what a kernel of it would cost. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#define BLOCK 256
#ifndef GROUP
#define GROUP 32  /* elements per fp16 scale: -DGROUP=256 builds the variant with the blockwise format's blocks */
#endif
enum { FP32, BLOCKWISE, COMPANDED };
enum { UNSIGNED, SIGNED };  /* the library's code tables (fused_cpu.c) */

#define VECTORISED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define INLINE static inline __attribute__((always_inline))
#define IVDEP _Pragma("GCC ivdep")

typedef int (*Quantize)(const float *values, int64_t n, int32_t table, uint8_t *codes, float *absmax);
typedef int (*Dequantize)(const uint8_t *codes, const float *absmax, int64_t n, int32_t table, float *values);

INLINE float largest_magnitude(const float *x) {
    float top = 0;
    _Pragma("omp simd reduction(max:top)")
    for (int k = 0; k < GROUP; k++) top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
    return top;
}

/* The groups' scales of a run of n elements (a multiple of GROUP, at most BLOCK): each group's largest
   magnitude rounded to fp16, and its reciprocal in fp32 (0 for a group of zeros). All the groups'
   maxima first, then their reciprocals in one vectorised loop: one division per group on its own
   would wait for the group's maximum. */
INLINE void group_scales(const float *x, int64_t n, _Float16 *scales, float *inverses) {
    float tops[BLOCK / GROUP];
    for (int64_t g = 0; g < n / GROUP; g++) tops[g] = largest_magnitude(x + g * GROUP);
    IVDEP for (int64_t g = 0; g < n / GROUP; g++) {
        scales[g] = (_Float16)tops[g];
        inverses[g] = (float)scales[g] > 0 ? 1 / (float)scales[g] : 0;
    }
}

/* m to codes, round(254 · softsign(m / scale)): a scale rounded below the absmax is clamped to. */
INLINE void encode_first(const float *x, int64_t n, int8_t *codes, _Float16 *scales) {
    float inverses[BLOCK / GROUP];
    group_scales(x, n, scales, inverses);
    for (int64_t g = 0; g < n / GROUP; g++) {
        const float inverse = inverses[g];
        IVDEP for (int k = 0; k < GROUP; k++) {
            float t = x[g * GROUP + k] * inverse;
            t = t > 1 ? 1 : t < -1 ? -1 : t;
            codes[g * GROUP + k] = (int8_t)nearbyintf(t / (1 + fabsf(t)) * 254);
        }
    }
}

INLINE void decode_first(const int8_t *codes, int64_t n, const _Float16 *scales, float *x) {
    for (int64_t g = 0; g < n / GROUP; g++) {
        const float top = scales[g];
        IVDEP for (int k = 0; k < GROUP; k++) {
            const float y = codes[g * GROUP + k] * (1.f / 254);
            x[g * GROUP + k] = y / (1 - fabsf(y)) * top;
        }
    }
}

/* v to codes of √v, round(255 · √v / scale). */
INLINE void encode_second(const float *x, int64_t n, uint8_t *codes, _Float16 *scales) {
    float root[BLOCK], inverses[BLOCK / GROUP];
    IVDEP for (int64_t k = 0; k < n; k++) root[k] = sqrtf(x[k]);
    group_scales(root, n, scales, inverses);
    for (int64_t g = 0; g < n / GROUP; g++) {
        const float inverse = inverses[g];
        IVDEP for (int k = 0; k < GROUP; k++) {
            const float t = root[g * GROUP + k] * inverse;
            codes[g * GROUP + k] = (uint8_t)nearbyintf((t > 1 ? 1 : t) * 255);
        }
    }
}

INLINE void decode_second(const uint8_t *codes, int64_t n, const _Float16 *scales, float *x) {
    for (int64_t g = 0; g < n / GROUP; g++) {
        const float top = scales[g];
        IVDEP for (int k = 0; k < GROUP; k++) {
            const float t = codes[g * GROUP + k] * (1.f / 255) * top;
            x[g * GROUP + k] = t * t;
        }
    }
}

/* The companded codec over n elements (a multiple of 32), for the benchmark to hold to its reference. */
VECTORISED void companded_roundtrip(const float *values, int64_t n, int second, float *out) {
    uint8_t codes[BLOCK];
    _Float16 scales[BLOCK / GROUP];
    for (int64_t i = 0; i < n; i += BLOCK) {
        const int64_t count = n - i < BLOCK ? n - i : BLOCK;
        if (second) encode_second(values + i, count, codes, scales), decode_second(codes, count, scales, out + i);
        else encode_first(values + i, count, (int8_t *)codes, scales), decode_first((int8_t *)codes, count, scales, out + i);
    }
}

typedef struct {
    float *param;
    const float *grad;
    void *m, *v;             /* FP32: float arrays; else one byte per element */
    void *m_scales, *v_scales;  /* BLOCKWISE: an fp32 absmax per 256; COMPANDED: an fp16 scale per 32 */
    float beta1, beta2, lr, weight_decay, eps, bias_correction1, bias_correction2_sqrt;
    int format;
    Quantize quantize;
    Dequantize dequantize;
    int64_t begin, end;      /* multiples of BLOCK */
} Step;

/* AdamW on n elements whose values are in arrays: fastoptim's adamw_update, written out. */
INLINE void adamw(const Step *s, float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                  int64_t n) {
    const float step_size = s->lr / s->bias_correction1, inverse_correction = 1 / s->bias_correction2_sqrt;
    const float decay = 1 - s->lr * s->weight_decay;
    IVDEP for (int64_t k = 0; k < n; k++) {
        v[k] = v[k] * s->beta2 + (1 - s->beta2) * g[k] * g[k];
        m[k] += (g[k] - m[k]) * (1 - s->beta1);
        p[k] = p[k] * decay - m[k] * (step_size / (sqrtf(v[k]) * inverse_correction + s->eps));
    }
}

VECTORISED static void walk(const Step *s) {
    float m[BLOCK], v[BLOCK];
    for (int64_t i = s->begin; i < s->end; i += BLOCK) {
        const int64_t n = s->end - i < BLOCK ? s->end - i : BLOCK;
        if (s->format == FP32) {
            adamw(s, s->param + i, s->grad + i, (float *)s->m + i, (float *)s->v + i, n);
            continue;
        }
        uint8_t *m_codes = (uint8_t *)s->m + i, *v_codes = (uint8_t *)s->v + i;
        if (s->format == BLOCKWISE) {
            float *m_absmax = (float *)s->m_scales + i / BLOCK, *v_absmax = (float *)s->v_scales + i / BLOCK;
            s->dequantize(m_codes, m_absmax, n, SIGNED, m);
            s->dequantize(v_codes, v_absmax, n, UNSIGNED, v);
            adamw(s, s->param + i, s->grad + i, m, v, n);
            s->quantize(m, n, SIGNED, m_codes, m_absmax);
            s->quantize(v, n, UNSIGNED, v_codes, v_absmax);
        } else {
            _Float16 *m_scales = (_Float16 *)s->m_scales + i / GROUP, *v_scales = (_Float16 *)s->v_scales + i / GROUP;
            decode_first((const int8_t *)m_codes, n, m_scales, m);
            decode_second(v_codes, n, v_scales, v);
            adamw(s, s->param + i, s->grad + i, m, v, n);
            encode_first(m, n, (int8_t *)m_codes, m_scales);
            encode_second(v, n, v_codes, v_scales);
        }
    }
}

static void *walk_thread(void *step) {
    walk(step);
    return 0;
}

/* One step over [0, n) (n a multiple of 256) on `threads` threads (at most 64), each a contiguous share. */
int adamw_step(const Step *step, int64_t n, int threads) {
    Step shares[64];
    pthread_t ids[64];
    const int64_t blocks = n / BLOCK;
    for (int t = 0; t < threads; t++) {
        shares[t] = *step;
        shares[t].begin = blocks * t / threads * BLOCK, shares[t].end = blocks * (t + 1) / threads * BLOCK;
        if (t && pthread_create(&ids[t], 0, walk_thread, &shares[t])) return 1;
    }
    walk(&shares[0]);
    for (int t = 1; t < threads; t++) pthread_join(ids[t], 0);
    return 0;
}
