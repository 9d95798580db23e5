/* Generated from the kernel specs (fastoptim/specs.py, each optimizer's SPEC) by
   `python -m fastoptim.kernels.header`: do not edit. tests/test_specs.py checks it. */

enum { PARAM, GRAD, FIRST_STATE };  /* the first rows of every pointer table */

enum { FP32, BF16, FP16, Q8, BF16_R8, BF16_R16 };  /* the element formats of params and states */

enum { FOUND_INF, SEED, GRAD_SCALE, COMMON_SCALARS };  /* every kernel's first scalars */

enum { UNSIGNED, SIGNED, LINEAR, CODE_TABLES };  /* the 8-bit code tables (fastoptim/states/blockwise8.py) */

enum { STOCHASTIC_ROUNDING = 1 };  /* every kernel's first flag bit */

enum { MAX_STATES = 4 };  /* the most states of any kernel */

/* adamw: rows param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, each state's block maxima, the remainders */
enum { ADAMW_EXP_AVG = FIRST_STATE, ADAMW_EXP_AVG_SQ, ADAMW_MAX_EXP_AVG_SQ, ADAMW_STATES_END };
enum { ADAMW_REMAINDER = 8 };
enum { ADAMW_ONE_MINUS_BETA1 = COMMON_SCALARS, ADAMW_BETA2, ADAMW_ONE_MINUS_BETA2, ADAMW_EPS, ADAMW_DECAY_MUL, ADAMW_DECAY_AFTER, ADAMW_STEP_SIZE, ADAMW_BIAS_CORRECTION2_SQRT };
enum { ADAMW_GRAD = -1 };  /* the grad row's format (-1: the param's) */
enum { ADAMW_AMSGRAD = 2, ADAMW_FIRST_MOMENT = 4 };
/* per state, in row order: its 8-bit code table, whether it is per subset under sn, the flag it needs */
#define ADAMW_TABLES {SIGNED, UNSIGNED, UNSIGNED}
#define ADAMW_REDUCED {0, 1, 1}
#define ADAMW_NEEDS {ADAMW_FIRST_MOMENT, 0, ADAMW_AMSGRAD}

/* adan: rows param, grad, exp_avg, exp_avg_sq, exp_avg_diff, neg_pre_grad, each state's block maxima, the remainders */
enum { ADAN_EXP_AVG = FIRST_STATE, ADAN_EXP_AVG_SQ, ADAN_EXP_AVG_DIFF, ADAN_NEG_PRE_GRAD, ADAN_STATES_END };
enum { ADAN_REMAINDER = 10 };
enum { ADAN_BETA1 = COMMON_SCALARS, ADAN_BETA2, ADAN_BETA3, ADAN_ONE_MINUS_BETA1, ADAN_ONE_MINUS_BETA2, ADAN_ONE_MINUS_BETA3, ADAN_EPS, ADAN_PRE_GRAD_WEIGHT, ADAN_BIAS_CORRECTION3_SQRT, ADAN_STEP_SIZE, ADAN_DIFF_RATIO, ADAN_DECAY_MUL, ADAN_DECAY_DIV };
enum { ADAN_GRAD = -1 };  /* the grad row's format (-1: the param's) */
/* per state, in row order: its 8-bit code table, whether it is per subset under sn, the flag it needs */
#define ADAN_TABLES {SIGNED, UNSIGNED, SIGNED, BF16_VALUES}
#define ADAN_REDUCED {0, 1, 0, 0}
#define ADAN_NEEDS {0, 0, 0, 0}

/* lion: rows param, grad, exp_avg, each state's block maxima, the remainders */
enum { LION_EXP_AVG = FIRST_STATE, LION_STATES_END };
enum { LION_REMAINDER = 4 };
enum { LION_BETA1 = COMMON_SCALARS, LION_ONE_MINUS_BETA1, LION_BETA2, LION_ONE_MINUS_BETA2, LION_LR, LION_DECAY_MUL };
enum { LION_GRAD = -1 };  /* the grad row's format (-1: the param's) */
/* per state, in row order: its 8-bit code table, whether it is per subset under sn, the flag it needs */
#define LION_TABLES {SIGNED}
#define LION_REDUCED {0}
#define LION_NEEDS {0}

/* muon_momentum: rows param, grad, momentum_buffer, each state's block maxima, the remainders */
enum { MUON_MOMENTUM_MOMENTUM_BUFFER = FIRST_STATE, MUON_MOMENTUM_STATES_END };
enum { MUON_MOMENTUM_REMAINDER = 4 };
enum { MUON_MOMENTUM_MOMENTUM = COMMON_SCALARS, MUON_MOMENTUM_ONE_MINUS_MOMENTUM };
enum { MUON_MOMENTUM_GRAD = -1 };  /* the grad row's format (-1: the param's) */
enum { MUON_MOMENTUM_NESTEROV = 2 };
/* per state, in row order: its 8-bit code table, whether it is per subset under sn, the flag it needs */
#define MUON_MOMENTUM_TABLES {LINEAR}
#define MUON_MOMENTUM_REDUCED {0}
#define MUON_MOMENTUM_NEEDS {0}

/* muon_apply: rows param, grad, each state's block maxima, the remainders */
enum { MUON_APPLY_STATES_END = FIRST_STATE };
enum { MUON_APPLY_REMAINDER = 2 };
enum { MUON_APPLY_DECAY_MUL = COMMON_SCALARS, MUON_APPLY_STEP_SIZE };
enum { MUON_APPLY_GRAD = BF16 };  /* the grad row's format (-1: the param's) */
/* per state, in row order: its 8-bit code table, whether it is per subset under sn, the flag it needs */
#define MUON_APPLY_TABLES {0}
#define MUON_APPLY_REDUCED {0}
#define MUON_APPLY_NEEDS {0}

/* X(name, NAME) for every kernel spec */
#define FOR_EACH_KERNEL(X) X(adamw, ADAMW) X(adan, ADAN) X(lion, LION) X(muon_momentum, MUON_MOMENTUM) X(muon_apply, MUON_APPLY)
