/* Part of fused_cpu.c, which includes its parts in this order as one translation unit: common.h,
   formats.h, algorithms.h, walk.h, clip.h, threads.h. */

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
