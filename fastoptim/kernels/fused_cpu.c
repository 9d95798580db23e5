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
   algorithm's math is written once, as inline functions of one element (cpu/algorithms.h); one
   walk over memory serves them all (cpu/walk.h): a dense tensor, the subsets of a subset-norm one,
   8-bit blocks (their formats: cpu/formats.h). The gradient norms and scaling of clipping are in
   cpu/clip.h, the threads in cpu/threads.h, what they all share in cpu/common.h; this file includes
   those parts, in that order, as one translation unit, and instantiates the chunk functions and
   entry points. Its rows, scalars, flags and states come from the kernel specs,
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

#include "cpu/common.h"
#include "cpu/formats.h"
#include "cpu/algorithms.h"
#include "cpu/walk.h"
#include "cpu/clip.h"
#include "cpu/threads.h"

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
