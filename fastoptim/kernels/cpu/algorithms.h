/* Part of fused_cpu.c, which includes its parts in this order as one translation unit: common.h,
   formats.h, algorithms.h, walk.h, clip.h, threads.h. */

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

/* torch's lerp, start + w·(end − start) for |w| < 0.5, else end − (1 − w)·(end − start) with 1 − w
   taken in fp32; each is one FMA, as torch's vectorized lerp: written out, as the compiler left a column
   walk's second branch a product and a sum (helper-109). */
INLINE float lerp(float start, float end, float w) {
    const float difference = end - start;
    return fabsf(w) < 0.5f ? fmaf(w, difference, start) : fmaf(w - 1.f, difference, end);
}

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

/* g: the grad times its scale, rounded, as the reference's scaled grad is (a plain product would be contracted
   into the lerp's FMA in some specialisations and not others: a bf16 param's step then left its fp32 twin's) */
INLINE float adamw_squared(const adamw_scalars *s, const float *x) { return fmaf(x[GRAD], s->grad_scale, -0.0f); }

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
        /* torch's lerp_: its second branch is exact where β1 <= 0.5 (m = g at β1 = 0, where m + (g − m)·1
           cancelled a large m to 0 and made inf of an inf grad, not torch's NaN: helper-106) */
        x[ADAMW_EXP_AVG] = lerp(x[ADAMW_EXP_AVG], g, s->one_minus_beta1);
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
