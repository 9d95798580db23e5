/* Part of fused_cpu.c, which includes its parts in this order as one translation unit: common.h,
   formats.h, algorithms.h, walk.h, clip.h, threads.h. */

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
