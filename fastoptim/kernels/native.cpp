/* The native layer: the C kernels of fused_cpu.c as torch ops, on the LibTorch stable ABI, so one
   binary serves every torch from the target version on (TORCH_TARGET_VERSION, set by setup.py).

   A fused step's tensors are *bound* once (fastoptim::bind): this library holds a reference to each
   param, state and block-maxima tensor, with the chunk table Python planned over them; a step's
   tables are bound into one call (fastoptim::bind_call), and each step (fastoptim::bound_step)
   passes only that call's handle, the grads, the scalars, the flags and the group's options. Every
   call re-reads each held tensor's data pointer, sizes, strides, dtype and device and each grad's,
   before the kernel runs: a held tensor that moved or changed its layout makes the call change
   nothing and answer STALE, and the caller binds afresh. So no pointer this library dereferences
   can outlive its tensor, and Python checks no tensor per step.

   A bound step may also clip: it sums the squares of all its tables' grads (the one order in which
   fastoptim sums a norm: dense_grad_norm_total's) and scales them by the clip coefficient in the kernels.

   The other ops are the clip kernels (dense_grad_norm_total, scale_dense_grads), the bandwidth probe, the 8-bit
   codes for the tests (quantize, dequantize) and the thread and F16C switches. Arguments that the
   kernels would read out of bounds are refused with an error before anything runs. */
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

extern "C" {
#include "fused_cpu_specs.h"

struct Scalar { const float *values; int64_t stride; };  // as fused_cpu.c declares it

#define DECLARE_ENTRY_POINT(name, NAME)                                                                        \
    int fastoptim_##name(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t chunk_begin, \
                         int64_t chunk_end, const int64_t *layouts, const Scalar *scalars, int32_t dtype,         \
                         int32_t flags, int32_t n_threads);
FOR_EACH_KERNEL(DECLARE_ENTRY_POINT)
#undef DECLARE_ENTRY_POINT
int fastoptim_probe(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t chunk_begin,
                    int64_t chunk_end, int32_t n_threads);
int fastoptim_grad_norm(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t n_chunks,
                        int32_t dtype, int32_t inf, double *partials, int32_t n_threads);
int fastoptim_scale_grads(const int64_t *pointers, int64_t n_tensors, const int64_t *chunks, int64_t n_chunks,
                          int32_t dtype, const float *factor, int32_t n_threads);
int fastoptim_quantize(const float *values, int64_t n, int32_t table, uint8_t *codes, float *absmax);
int fastoptim_dequantize(const uint8_t *codes, const float *absmax, int64_t n, int32_t table, float *values);
int fastoptim_use_openmp(const char *path);
int fastoptim_use_f16c(int32_t enable);
}

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

typedef int (*KernelFn)(const int64_t *, int64_t, const int64_t *, int64_t, int64_t, const int64_t *,
                        const Scalar *, int32_t, int32_t, int32_t);

// Its table's rows (up to its remainders'), and per state row from FIRST_STATE to states_end the flag bit
// that keeps it (0: always kept).
// The format of its grad row where it is not the params' (fused_cpu.c's BF16, say), else -1.
struct Kernel { const char *name; KernelFn run; int64_t n_rows, states_end; int64_t needs[MAX_STATES]; int32_t grad; };
#define KERNEL_ENTRY(name, NAME) \
    {#name, fastoptim_##name, NAME##_REMAINDER + 1, NAME##_STATES_END, NAME##_NEEDS, NAME##_GRAD},
const Kernel KERNELS[] = {FOR_EACH_KERNEL(KERNEL_ENTRY)};
#undef KERNEL_ENTRY

// The kernel named ``name``, or null.
const Kernel *find_kernel(const std::string &name) {
    for (const Kernel &kernel : KERNELS)
        if (name == kernel.name) return &kernel;
    return nullptr;
}

// The kernels' element format (fused_cpu.c's FP32, BF16, FP16) of a tensor of shim dtype code
// ``dtype``, or -1 where no kernel takes it.
const int32_t *kernel_dtypes() {
    static const int32_t codes[] = {aoti_torch_dtype_float32(), aoti_torch_dtype_bfloat16(),
                                    aoti_torch_dtype_float16()};
    return codes;
}

int32_t kernel_dtype(int32_t dtype) {
    const int32_t *codes = kernel_dtypes(), *found = std::find(codes, codes + 3, dtype);
    return found == codes + 3 ? -1 : static_cast<int32_t>(found - codes);
}

// The rows of kernel ``kernel``'s pointer table as this library was built (fused_cpu_specs.h), or -1 for no
// such kernel. Python compares them with its specs: a library built from other sources is not used.
int64_t kernel_rows(std::string kernel) {
    const Kernel *found = find_kernel(kernel);
    return found ? found->n_rows : -1;
}

int32_t threads() { return static_cast<int32_t>(torch::stable::get_num_threads()); }

// A tensor's pointer, dtype, device type, sizes and strides, read through the C shim directly: the
// stable Tensor's scalar_type() compares the code with every dtype, one shim call each, and these
// reads are most of what a bound step costs. ``readable`` is false where one cannot be read (a sparse
// tensor has no strides): a check answers that such a tensor does not fit, and Python names the
// problem, as it does on a step it checks; the other fields are then not to be used.
struct Read {
    void *data = nullptr;
    int32_t dtype = -1, device_type = -1, device_index = -1;
    int64_t dim = 0;
    int64_t *sizes = nullptr, *strides = nullptr;
    bool readable;

    explicit Read(const Tensor &t) : Read(t.get()) {}

    explicit Read(AtenTensorHandle h)
        : readable(aoti_torch_get_data_ptr(h, &data) == AOTI_TORCH_SUCCESS
                   && aoti_torch_get_dtype(h, &dtype) == AOTI_TORCH_SUCCESS
                   && aoti_torch_get_device_type(h, &device_type) == AOTI_TORCH_SUCCESS
                   && aoti_torch_get_device_index(h, &device_index) == AOTI_TORCH_SUCCESS
                   && aoti_torch_get_dim(h, &dim) == AOTI_TORCH_SUCCESS
                   && aoti_torch_get_sizes(h, &sizes) == AOTI_TORCH_SUCCESS
                   && aoti_torch_get_strides(h, &strides) == AOTI_TORCH_SUCCESS) {}

    bool empty() const { return std::find(sizes, sizes + dim, 0) != sizes + dim; }

    // One past the last byte its elements reach, or 0 when a stride is negative.
    uintptr_t end() const {
        int64_t last = 0;
        for (int64_t d = 0; d < dim; d++) {
            if (strides[d] < 0) return 0;
            last += (sizes[d] - 1) * strides[d];
        }
        return reinterpret_cast<uintptr_t>(data) + (last + 1) * aoti_torch_dtype_element_size(dtype);
    }

    // Whether its elements lie in ``owner``'s (a contiguous 1-d tensor's), on its device.
    bool within(const Read &owner) const {
        return !empty() && device_type == owner.device_type && device_index == owner.device_index && end() != 0
            && reinterpret_cast<uintptr_t>(data) >= reinterpret_cast<uintptr_t>(owner.data) && end() <= owner.end();
    }
};

// ``t``'s Read, for an op that refuses a tensor whose layout cannot be read.
Read read_for(const Tensor &t, const char *op) {
    Read r(t);
    STD_TORCH_CHECK(r.readable, op, ": a tensor whose layout cannot be read (a sparse one?)");
    return r;
}

// What a held tensor was when it was bound; a call whose tensor differs in any of it is STALE. An
// empty tensor has no memory to walk: only its dtype, device and sizes count.
struct Layout {
    void *data;
    int32_t dtype, device_type, device_index;
    bool empty;
    std::vector<int64_t> sizes, strides;

    explicit Layout(const Read &r)
        : data(r.data), dtype(r.dtype), device_type(r.device_type), device_index(r.device_index), empty(r.empty()),
          sizes(r.sizes, r.sizes + r.dim), strides(r.strides, r.strides + r.dim) {}

    bool on_device_of(const Read &r) const { return r.device_type == device_type && r.device_index == device_index; }

    // Whether a view of an owner no longer has the pointer, dtype, sizes and strides it had (set_,
    // .data =, resize_, share_memory_, a view as another dtype, t_() of a square one): the owner still
    // holds its memory, but the state the user sees is elsewhere, another thing, or in another order.
    bool moved_out(const Tensor &t) const {
        void *now;
        int32_t dtype_now;
        int64_t dim_now, *sizes_now, *strides_now;
        return aoti_torch_get_data_ptr(t.get(), &now) != AOTI_TORCH_SUCCESS || now != data
            || aoti_torch_get_dtype(t.get(), &dtype_now) != AOTI_TORCH_SUCCESS || dtype_now != dtype
            || aoti_torch_get_dim(t.get(), &dim_now) != AOTI_TORCH_SUCCESS
            || dim_now != static_cast<int64_t>(sizes.size())
            || aoti_torch_get_sizes(t.get(), &sizes_now) != AOTI_TORCH_SUCCESS
            || !std::equal(sizes.begin(), sizes.end(), sizes_now)
            || aoti_torch_get_strides(t.get(), &strides_now) != AOTI_TORCH_SUCCESS
            || !std::equal(strides.begin(), strides.end(), strides_now);
    }

    bool describes(const Tensor &t) const {
        const Read r(t);
        return r.readable && r.dtype == dtype && on_device_of(r) && (empty || r.data == data)
            && r.dim == static_cast<int64_t>(sizes.size()) && std::equal(sizes.begin(), sizes.end(), r.sizes)
            && (empty || std::equal(strides.begin(), strides.end(), r.strides));
    }
};

// Whether a tensor is walked as ``param`` is: on its device, with its sizes and the strides of every
// dim of more than one element (a size-1 dim's stride is free).
bool walked_as(const Read &r, const Layout &param) {
    if (!param.on_device_of(r) || r.dim != static_cast<int64_t>(param.sizes.size())) return false;
    for (int64_t d = 0; d < r.dim; d++)
        if (r.sizes[d] != param.sizes[d] || (!param.empty && r.sizes[d] != 1 && r.strides[d] != param.strides[d]))
            return false;
    return true;
}

// A grad fits its param when it has shim dtype ``dtype`` (the param's, unless its kernel reads grads of
// its own format) and is walked as the param is, from ``pointer`` (0 for an empty one, which is never read),
// and is not the param's own memory (``param.grad = param``), which the kernel would read as it writes it.
bool fits(const Read &r, const Layout &param, int32_t dtype, int64_t *pointer) {
    if (!r.readable || r.dtype != dtype || !walked_as(r, param) || (!param.empty && r.data == param.data)) return false;
    *pointer = param.empty ? 0 : reinterpret_cast<int64_t>(r.data);
    return true;
}

// The element format of bf16 params beside master remainders of shim dtype code ``dtype`` (int8:
// BF16_R8, int16: BF16_R16), or -1.
int32_t remainder_format(int32_t dtype) {
    return dtype == aoti_torch_dtype_int8() ? BF16_R8 : dtype == aoti_torch_dtype_int16() ? BF16_R16 : -1;
}

int64_t address(const Tensor &t) { return t.numel() ? reinterpret_cast<int64_t>(t.data_ptr()) : 0; }

// Whether a tensor's elements fill its span with no gaps or overlaps, in any order of its dims
// (contiguous, channels_last, a transpose), so that it can be walked as a flat array.
bool is_dense(const Read &r) {
    std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of more than one element
    for (int64_t d = 0; d < r.dim; d++) {
        if (r.sizes[d] == 0) return true;
        if (r.sizes[d] != 1) dims.emplace_back(r.strides[d], r.sizes[d]);
    }
    std::sort(dims.begin(), dims.end());
    int64_t expected = 1;
    for (const auto &[stride, size] : dims) {
        if (stride != expected) return false;
        expected *= size;
    }
    return true;
}

// A chunk table: int64 rows of (tensor, first element, element count, elements before it), each
// within its tensor's ``numels``.
const int64_t *chunk_rows(const Tensor &chunks, const char *op) {
    STD_TORCH_CHECK(chunks.is_cpu() && chunks.scalar_type() == ScalarType::Long && chunks.is_contiguous()
                        && chunks.dim() == 2 && chunks.size(1) == 4,
                    op, ": chunks must be a contiguous int64 CPU tensor of rows (tensor, start, count, before)");
    return static_cast<const int64_t *>(chunks.data_ptr());
}

const int64_t *checked_chunks(const Tensor &chunks, const std::vector<int64_t> &numels, const char *op) {
    const int64_t *rows = chunk_rows(chunks, op);
    for (int64_t k = 0; k < chunks.size(0); k++) {
        const int64_t t = rows[4 * k], start = rows[4 * k + 1], count = rows[4 * k + 2];
        STD_TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(numels.size()) && start >= 0 && count >= 0
                            && start + count <= numels[t],
                        op, ": chunk ", k, " reaches outside its tensor");
    }
    return rows;
}

// A step's scalars as the kernels read them (fp32 values, shared or one per tensor): ``numbers``,
// one per scalar of every table in order, of which ``slots[j]`` is replaced by ``tensors[j]``, an
// fp32 or float64 CPU tensor, 0-d or with one value per tensor of its table (``table_of_slot``).
// Numbers and float64 values are converted here; fp32 tensors are read where they are.
struct StepScalars {
    std::vector<float> numbers;
    std::vector<std::vector<float>> converted;
    std::vector<Scalar> scalars;

    StepScalars(const std::vector<double> &values, const std::vector<Tensor> &tensors,
                const std::vector<int64_t> &slots, const std::vector<int64_t> &tensors_of_slot) {
        static const int32_t float32 = aoti_torch_dtype_float32(), float64 = aoti_torch_dtype_float64(),
                             cpu = aoti_torch_device_type_cpu();
        const char *op = "fastoptim::bound_step";
        STD_TORCH_CHECK(slots.size() == tensors.size(), op, ": one slot per tensor scalar");
        numbers.assign(values.begin(), values.end());
        for (size_t i = 0; i < numbers.size(); i++) scalars.push_back({&numbers[i], 0});
        converted.reserve(tensors.size());
        for (size_t j = 0; j < tensors.size(); j++) {
            STD_TORCH_CHECK(slots[j] >= 0 && slots[j] < static_cast<int64_t>(scalars.size()), op, ": slot ", slots[j],
                            " outside the scalars");
            const int64_t n = tensors_of_slot[slots[j]];
            const Read s(tensors[j]);
            STD_TORCH_CHECK(s.readable && s.device_type == cpu && (s.dtype == float32 || s.dtype == float64)
                                && (s.dim == 0 || (s.dim == 1 && s.sizes[0] == n && (s.strides[0] == 1 || n < 2))),
                            op, ": scalar ", slots[j], " must be a contiguous fp32 or float64 CPU tensor, 0-d or with "
                            "one value per tensor (", n, ")");
            const float *data = static_cast<const float *>(s.data);
            if (s.dtype == float64) {
                const double *wide = static_cast<const double *>(s.data);
                converted.emplace_back(wide, wide + (s.dim ? n : 1));
                data = converted.back().data();
            }
            scalars[slots[j]] = {data, s.dim};
        }
    }
};

// --- step rules: a bound step's scalars, computed here from the step counts its tables hold -------

// A rule computes a kernel's scalars (in its spec's order, from COMMON_SCALARS on; found_inf, the seed
// and the grad scale come with the call) from the group's ``options`` and ``t``, the count this step
// reaches, as the algorithm's ``arguments`` and ``kernel_scalars`` compute them in Python
// (fastoptim/optimizers/<algorithm>.py, whose ``rule`` names it and lists the options in this order):
// the same float64 operations in the same order, so the same numbers (tests/test_native_layer.py).
struct Rule {
    const char *name;
    int64_t n_options;
    bool counts;  // whether it reads a step count
    void (*scalars)(const double *options, double t, double *out);
    const char *kernel;  // the kernel whose scalars it computes
    int64_t n_scalars;  // that kernel's scalars, every one of which it writes past COMMON_SCALARS
    int64_t first_read_scalar;  // the scalar that is 0 where a param first reads its optional states, or -1
};

// The AdamW kernel's moment scalars, from options that begin lr, beta1, beta2, eps (both its rules').
void adamw_moments(const double *o, double *s) {
    s[ADAMW_ONE_MINUS_BETA1] = 1 - o[1];
    s[ADAMW_BETA2] = o[2];
    s[ADAMW_ONE_MINUS_BETA2] = 1 - o[2];
    s[ADAMW_EPS] = o[3];
}

// options: lr, beta1, beta2, eps, weight_decay (torch's AdamW: bias corrections of the count)
void adamw_rule(const double *o, double t, double *s) {
    const double lr = o[0], beta1 = o[1], beta2 = o[2];
    adamw_moments(o, s);
    s[ADAMW_DECAY_MUL] = 1 - lr * o[4];
    s[ADAMW_DECAY_AFTER] = 1.0;
    s[ADAMW_STEP_SIZE] = lr / (1 - std::pow(beta1, t));
    s[ADAMW_BIAS_CORRECTION2_SQRT] = std::sqrt(1 - std::pow(beta2, t));
}

// options: lr, beta1, beta2, eps, weight_decay, correct_bias (the subset-norm reference: both bias
// corrections in the step size, weight decay after the update)
void adamwsn_rule(const double *o, double t, double *s) {
    const double lr = o[0], beta1 = o[1], beta2 = o[2];
    adamw_moments(o, s);
    s[ADAMW_DECAY_MUL] = 1.0;
    s[ADAMW_DECAY_AFTER] = 1 - lr * o[4];
    s[ADAMW_STEP_SIZE] = o[5] != 0 ? lr * std::sqrt(1 - std::pow(beta2, t)) / (1 - std::pow(beta1, t)) : lr + 0 * t;
    s[ADAMW_BIAS_CORRECTION2_SQRT] = 1.0;
}

// options: lr, beta1, beta2, beta3, eps, weight_decay, no_prox (official Adan; g_prev's weight 0 at the
// first step)
void adan_rule(const double *o, double t, double *s) {
    const double lr = o[0], beta1 = o[1], beta2 = o[2], beta3 = o[3], decay = lr * o[5];
    const bool no_prox = o[6] != 0;
    s[ADAN_BETA1] = beta1;
    s[ADAN_BETA2] = beta2;
    s[ADAN_BETA3] = beta3;
    s[ADAN_ONE_MINUS_BETA1] = 1 - beta1;
    s[ADAN_ONE_MINUS_BETA2] = 1 - beta2;
    s[ADAN_ONE_MINUS_BETA3] = 1 - beta3;
    s[ADAN_EPS] = o[4];
    s[ADAN_PRE_GRAD_WEIGHT] = t > 1 ? 1.0 : 0.0;
    s[ADAN_BIAS_CORRECTION3_SQRT] = std::sqrt(1 - std::pow(beta3, t));
    s[ADAN_STEP_SIZE] = lr / (1 - std::pow(beta1, t));
    s[ADAN_DIFF_RATIO] = beta2 * (1 - std::pow(beta1, t)) / (1 - std::pow(beta2, t));
    s[ADAN_DECAY_MUL] = no_prox ? 1 - decay : 1.0;
    s[ADAN_DECAY_DIV] = no_prox ? 1.0 : 1 + decay;
}

// options: lr, beta1, beta2, weight_decay
void lion_rule(const double *o, double, double *s) {
    const double lr = o[0], beta1 = o[1], beta2 = o[2];
    s[LION_BETA1] = beta1;
    s[LION_ONE_MINUS_BETA1] = 1 - beta1;
    s[LION_BETA2] = beta2;
    s[LION_ONE_MINUS_BETA2] = 1 - beta2;
    s[LION_LR] = lr;
    s[LION_DECAY_MUL] = 1 - lr * o[3];
}

const Rule RULES[] = {{"adamw", 5, true, adamw_rule, "adamw", ADAMW_BIAS_CORRECTION2_SQRT + 1, -1},
                      {"adamwsn", 6, true, adamwsn_rule, "adamw", ADAMW_BIAS_CORRECTION2_SQRT + 1, -1},
                      {"adan", 7, true, adan_rule, "adan", ADAN_DECAY_DIV + 1, ADAN_PRE_GRAD_WEIGHT},
                      {"lion", 4, false, lion_rule, "lion", LION_DECAY_MUL + 1, -1}};

const Rule *find_rule(const std::string &name) {
    for (const Rule &rule : RULES)
        if (name == rule.name) return &rule;
    return nullptr;
}

// The scalars rule ``name`` computes from ``options`` at count ``t`` (all of the kernel's: those the
// call brings are 0 here), for the tests that hold it to the Python that it restates.
std::vector<double> rule_scalars(std::string name, std::vector<double> options, double t, int64_t n_scalars) {
    const char *op = "fastoptim::rule_scalars";
    const Rule *rule = find_rule(name);
    STD_TORCH_CHECK(rule && static_cast<int64_t>(options.size()) == rule->n_options, op, ": no rule ", name, " of ",
                    options.size(), " options");
    STD_TORCH_CHECK(n_scalars == rule->n_scalars, op, ": rule ", name, " computes the ", rule->n_scalars,
                    " scalars of the ", rule->kernel, " kernel, not ", n_scalars);
    std::vector<double> out(n_scalars, 0.0);
    rule->scalars(options.data(), t, out.data());
    return out;
}

// A float64 CPU tensor of ``values`` (0-d for one value), made here: a compiled step's op makes a
// dozen at every call, and the dispatcher's factories cost more than the rule.
Tensor float64_tensor(const std::vector<double> &values, bool one) {
    const int64_t size = static_cast<int64_t>(values.size()), stride = 1;
    AtenTensorHandle made;
    STD_TORCH_CHECK(aoti_torch_empty_strided(one ? 0 : 1, &size, &stride, aoti_torch_dtype_float64(),
                                             aoti_torch_device_type_cpu(), 0, &made) == AOTI_TORCH_SUCCESS,
                    "fastoptim::ruled_scalars: no memory for its scalars");
    Tensor out(made);
    std::copy(values.begin(), values.end(), static_cast<double *>(out.data_ptr()));
    return out;
}

// A traced CPU step's scalars past COMMON_SCALARS (fastoptim::step_scalars's: see
// fastoptim/optimizers/scalars.py), computed by rule ``name`` from ``options`` at the count each param
// reaches (``counts``: a group's 0-d count, the params' 1-d counts or their 0-d ones, each + 1), as
// float64 CPU tensors: 0-d, or for the scalars at the indices ``per_param`` one value per param of
// ``owners`` (all ``n``: none listed). Where the counts differ, those values are each param's own,
// rounded to fp32 first with ``round_to_float`` (as Python makes them in the params' dtype), and the
// others are the first param's. With ``first_reads`` (each param's 0 where this step first reads its
// optional states, else 1: see StepInputs), the rule's first-read scalar, where it has one, is
// multiplied by it. Empty, computing nothing, where a count or ``first_reads`` is not a float CPU
// tensor of at most one dimension (fp32 for ``first_reads``, one value per param) or a count reaches
// below 1 (or NaN): Python then computes them, as it would answer.
std::vector<Tensor> ruled_scalars(std::string name, std::vector<double> options, std::vector<Tensor> counts,
                                  std::optional<Tensor> first_reads, std::vector<int64_t> per_param,
                                  std::vector<int64_t> owners, int64_t n, bool round_to_float) {
    const char *op = "fastoptim::ruled_scalars";
    const Rule *rule = find_rule(name);
    STD_TORCH_CHECK(rule && static_cast<int64_t>(options.size()) == rule->n_options, op, ": no rule ", name, " of ",
                    options.size(), " options");
    std::vector<double> reached;
    for (const Tensor &count : counts) {
        const Read r = read_for(count, op);
        const bool single = r.dtype == aoti_torch_dtype_float32();
        if (r.device_type != aoti_torch_device_type_cpu() || r.dim > 1
            || !(single || r.dtype == aoti_torch_dtype_float64()))
            return {};
        for (int64_t i = 0, size = r.dim ? r.sizes[0] : 1; i < size; i++) {
            const int64_t at = r.dim ? i * r.strides[0] : 0;
            const double value = single ? static_cast<const float *>(r.data)[at] : static_cast<const double *>(r.data)[at];
            if (!(value + 1 >= 1)) return {};
            reached.push_back(value + 1);
        }
    }
    if (rule->counts && reached.empty()) return {};
    const float *first_read = nullptr;
    if (first_reads.has_value() && rule->first_read_scalar >= 0) {  // (a rule without one does not read them)
        const Read r = read_for(*first_reads, op);
        if (r.device_type != aoti_torch_device_type_cpu() || r.dtype != aoti_torch_dtype_float32() || r.dim != 1
            || r.sizes[0] != n || (n > 1 && r.strides[0] != 1)
            || std::find(per_param.begin(), per_param.end(), rule->first_read_scalar) == per_param.end())
            return {};
        first_read = static_cast<const float *>(r.data);
    }
    for (int64_t owner : owners) STD_TORCH_CHECK(owner >= 0 && owner < n, op, ": owner ", owner, " of ", n, " params");
    for (int64_t j : per_param)
        STD_TORCH_CHECK(j >= COMMON_SCALARS && j < rule->n_scalars, op, ": no per-param scalar ", j);
    const bool shared = std::adjacent_find(reached.begin(), reached.end(), std::not_equal_to<>()) == reached.end();
    if (!shared && !per_param.empty() && static_cast<int64_t>(reached.size()) != n) return {};
    const int64_t n_scalars = rule->n_scalars;
    std::vector<double> first(n_scalars);
    rule->scalars(options.data(), reached.empty() ? 1.0 : reached[0], first.data());
    std::vector<std::vector<double>> own;  // each param's scalars, where the counts differ
    if (!shared && !per_param.empty()) {
        own.assign(n, std::vector<double>(n_scalars));
        for (int64_t i = 0; i < n; i++) rule->scalars(options.data(), reached[i], own[i].data());
    }
    const int64_t size = owners.empty() ? n : static_cast<int64_t>(owners.size());
    std::vector<Tensor> out;
    for (int64_t j = COMMON_SCALARS; j < n_scalars; j++) {
        if (std::find(per_param.begin(), per_param.end(), j) == per_param.end()) {
            out.push_back(float64_tensor({first[j]}, true));
            continue;
        }
        std::vector<double> values(size, first[j]);
        for (int64_t i = 0; i < size && !own.empty(); i++) {
            const double value = own[owners.empty() ? i : owners[i]][j];
            values[i] = round_to_float ? static_cast<double>(static_cast<float>(value)) : value;
        }
        if (j == rule->first_read_scalar && first_read)
            for (int64_t i = 0; i < size; i++) values[i] *= first_read[owners.empty() ? i : owners[i]];
        out.push_back(float64_tensor(values, false));
    }
    return out;
}

// --- bound tables ------------------------------------------------------------------------------

// Held tensors (the params, the states that lie in no owner, then the owners), the states that lie
// in an owner (``views``: only their pointers, dtypes, sizes and strides are checked, see moved_out),
// and the kernel's tables over them. ``watched`` tensors are not walked, but what the table holds
// follows from them (a param that the table holds a view of, a step count): they are checked as held
// ones are. ``pointers`` is [row][tensor], the grads' row filled in at each call;
// ``layouts`` is [tensor][3] or empty. A table that runs nothing (run is null: a GPU kernel's, which
// Python launches) is only checked, by check_bound.
struct Bound {
    KernelFn run;
    const Kernel *kernel = nullptr;
    std::vector<bool> rows_bound;  // per row of the pointer table, whether bind gave it tensors
    int32_t dtype;
    int32_t grad_dtype;  // the shim dtype its grads must have: the params', or its kernel's grad format
    int64_t n_tensors, n_rows, n_scalars;
    std::vector<Tensor> held, views, watched;
    std::vector<Layout> layouts_then, views_then, watched_then;  // one per held tensor, view, watched tensor
    std::vector<Layout> grads_like;  // per tensor, what else its grad may be walked as (empty: the param only)
    const Rule *rule = nullptr;  // what computes its scalars in a ruled call (see bound_step)
    std::vector<Tensor> counts;  // the step counts it reads and advances: none, the group's, or one per tensor
    std::vector<Layout> counts_then;
    std::vector<int64_t> pointers, chunks, layouts;
    // Held by a step while it checks and runs the table, whose grads' row it writes: two native steps
    // of one table take turns instead of racing. (An optimizer, as torch's, is not to be stepped from
    // two threads at once: what Python does around the call, its counts included, is not locked.)
    std::mutex busy;
};

std::mutex registry_lock;
std::unordered_map<int64_t, std::shared_ptr<Bound>> registry;
int64_t next_handle = 1;

// The ``what`` (a table or a call) of ``handle`` in ``bound_things``, one of the maps under registry_lock.
template <typename T>
std::shared_ptr<T> find_bound(const std::unordered_map<int64_t, std::shared_ptr<T>> &bound_things, int64_t handle,
                              const char *what, const char *op) {
    std::lock_guard<std::mutex> guard(registry_lock);
    auto found = bound_things.find(handle);
    STD_TORCH_CHECK(found != bound_things.end(), op, ": no bound ", what, " ", handle);
    return found->second;
}

std::shared_ptr<Bound> bound(int64_t handle, const char *op) { return find_bound(registry, handle, "table", op); }

// A bound step's call: its tables (in the order its grads and scalars come), per table whether it runs
// once per tensor and whether its rule computes its scalars, and the order to lock them in (their
// handles': no two calls deadlock). Made once per plan (bind_call), so each step names one handle.
struct Call {
    std::vector<std::shared_ptr<Bound>> tables;
    std::vector<int64_t> per_tensor, ruled;
    bool views = true;  // whether its grads may come as their tables' grads_like views (see bind_call)
    std::vector<size_t> lock_order;
    std::vector<int64_t> norm_order;  // the order its clip adds its grads' squares in (see bind_call)
};

std::unordered_map<int64_t, std::shared_ptr<Call>> calls;  // under registry_lock, as the tables

// A call's tables, each locked while it lives.
struct Locked {
    std::vector<std::unique_lock<std::mutex>> locks;

    explicit Locked(const Call &call) {
        for (size_t k : call.lock_order) locks.emplace_back(call.tables[k]->busy);
    }
};

/* Bind ``held`` (row ``rows[k]`` of the table holds tensors held[k * n_tensors ...], in tensor order;
   row 0 holds the params, row GRAD is left to the calls, and the last row, n_rows - 1, holds the master
   remainders of bf16 params where they keep them: fastoptim/specs.py), the chunk table and the layouts
   ([tensor][3] int64, or None for all dense fp32) to CPU kernel ``kernel``. With ``runs`` false the
   table is checked as ``kernel``'s (its rows, its grads' format) and runs nothing: a GPU kernel's, whose
   tensors may be on any device. Returns the handle.

   ``owners`` are flat state buffers (contiguous 1-d tensors): a state whose elements lie in one is
   checked through it, so a call reads a few buffers' layouts instead of every state's. Its pointer stays
   within memory that the held buffer owns while the buffer keeps its pointer and size; of the state
   itself a call reads only its pointer, dtype, sizes and strides (moved_out).

   ``watched`` tensors must keep their layouts too, though no row holds them: the step counts of the
   params. ``grads_like`` (empty, or one per tensor) is what else each grad may be laid out as, read
   once, here: the (a, b, c) view of a subset-norm param that a checked step hands its grad in (the table
   holds the user's param, whose grad a bound step passes as it is). Such a view is the plan's own,
   which nothing else changes, and has the pointer of the param it views, which is checked. */
int64_t bind(std::string kernel, std::vector<Tensor> held, std::vector<int64_t> rows, int64_t n_tensors,
             int64_t n_rows, int64_t n_scalars, Tensor chunks, std::optional<Tensor> layouts,
             std::vector<Tensor> owners, std::vector<Tensor> watched, std::vector<Tensor> grads_like,
             std::string rule, std::vector<Tensor> counts, bool runs) {
    const char *op = "fastoptim::bind";
    STD_TORCH_CHECK(n_tensors > 0 && static_cast<int64_t>(held.size()) == n_tensors * static_cast<int64_t>(rows.size())
                        && !rows.empty() && rows[0] == PARAM,
                    op, ": held must be the params' row, then other rows, n_tensors each");
    auto table = std::make_shared<Bound>();
    const Kernel *named = find_kernel(kernel);
    STD_TORCH_CHECK(named, op, ": no fused kernel named '", kernel, "'");
    STD_TORCH_CHECK(n_rows == named->n_rows, op, ": the ", kernel, " kernel reads ", named->n_rows,
                    " rows of pointers, not ", n_rows);
    table->run = runs ? named->run : nullptr;
    table->kernel = named;
    table->rows_bound.assign(n_rows, false);
    const Read first = read_for(held[0], op);
    table->dtype = kernel_dtype(first.dtype);
    STD_TORCH_CHECK(table->dtype >= 0, op, ": no kernel for the params' dtype");
    table->grad_dtype = named->grad >= 0 ? kernel_dtypes()[named->grad] : first.dtype;
    table->n_tensors = n_tensors;
    table->n_rows = n_rows;
    table->n_scalars = n_scalars;
    table->pointers.assign(n_rows * n_tensors, 0);
    std::vector<Read> flat;
    for (const Tensor &owner : owners) {
        flat.push_back(read_for(owner, op));
        STD_TORCH_CHECK(flat.back().dim == 1 && flat.back().strides[0] == 1 && !flat.back().empty()
                            && (!table->run || owner.is_cpu()),
                        op, ": an owner must be a non-empty contiguous 1-d tensor (on the CPU for a CPU kernel)");
    }
    std::vector<int64_t> numels(n_tensors);
    for (size_t k = 0; k < rows.size(); k++) {
        STD_TORCH_CHECK(rows[k] >= 0 && rows[k] < n_rows && rows[k] != GRAD, op, ": bad row ", rows[k]);
        for (int64_t t = 0; t < n_tensors; t++) {
            const Tensor &tensor = held[k * n_tensors + t];
            STD_TORCH_CHECK(!table->run || tensor.is_cpu(), op, ": tensor ", t, " of row ", rows[k], " is not on the CPU");
            const Read read = read_for(tensor, op);
            const bool owned =
                k > 0 && std::any_of(flat.begin(), flat.end(), [&](const Read &o) { return read.within(o); });
            (owned ? table->views : table->held).push_back(tensor);
            (owned ? table->views_then : table->layouts_then).emplace_back(read);
            if (k == 0) {
                numels[t] = tensor.numel();
                STD_TORCH_CHECK(read.dtype == first.dtype, op, ": the params mix dtypes");
            } else if (rows[k] == n_rows - 1) {  // the remainders: the params are read beside them
                const int32_t format = remainder_format(read.dtype);
                STD_TORCH_CHECK(first.dtype == aoti_torch_dtype_bfloat16() && format >= 0
                                    && (t == 0 || format == table->dtype) && walked_as(read, table->layouts_then[t]),
                                op, ": the master remainders must be int8 or int16 tensors, one dtype for all, each ",
                                "walked as its bf16 param");
                table->dtype = format;
            }
            table->pointers[rows[k] * n_tensors + t] = address(tensor);
        }
        table->rows_bound[rows[k]] = true;
    }
    for (size_t k = 0; k < owners.size(); k++) {  // after the params, which are the first n_tensors held
        table->held.push_back(owners[k]);
        table->layouts_then.emplace_back(flat[k]);
    }
    STD_TORCH_CHECK(grads_like.empty() || static_cast<int64_t>(grads_like.size()) == n_tensors, op,
                    ": grads_like must be empty or hold one tensor per param");
    for (int64_t t = 0; t < static_cast<int64_t>(grads_like.size()); t++) {
        const Read like = read_for(grads_like[t], op);
        STD_TORCH_CHECK(like.dtype == first.dtype && like.dim >= 0 && grads_like[t].numel() == numels[t]
                            && (!table->run || grads_like[t].is_cpu()),
                        op, ": grads_like[", t, "] must have its param's dtype, elements and device");
        table->grads_like.emplace_back(like);
    }
    for (const Tensor &tensor : watched) {
        table->watched_then.emplace_back(read_for(tensor, op));
        table->watched.push_back(tensor);
    }
    table->rule = rule.empty() ? nullptr : find_rule(rule);
    STD_TORCH_CHECK(rule.empty() || (table->rule && table->run), op, ": no rule named ", rule, " (or no kernel)");
    STD_TORCH_CHECK(!table->rule || (kernel == table->rule->kernel && n_scalars == table->rule->n_scalars), op,
                    ": rule ", rule, " computes the ", table->rule ? table->rule->n_scalars : 0, " scalars of the ",
                    table->rule ? table->rule->kernel : "", " kernel, not ", n_scalars, " of ", kernel, "'s");
    STD_TORCH_CHECK(counts.empty() || counts.size() == 1 || static_cast<int64_t>(counts.size()) == n_tensors, op,
                    ": counts must be none, the group's or one per tensor");
    for (const Tensor &count : counts) {
        const Read r = read_for(count, op);
        STD_TORCH_CHECK(count.is_cpu() && r.dim == 0 && r.dtype == aoti_torch_dtype_float32(), op,
                        ": a step count must be a 0-d fp32 CPU tensor");
        table->counts.push_back(count);
        table->counts_then.emplace_back(r);
    }
    const int64_t *rows_of_chunks = checked_chunks(chunks, numels, op);
    table->chunks.assign(rows_of_chunks, rows_of_chunks + 4 * chunks.size(0));
    if (layouts.has_value()) {
        const Tensor &l = *layouts;
        STD_TORCH_CHECK(l.is_cpu() && l.scalar_type() == ScalarType::Long && l.is_contiguous() && l.dim() == 2
                            && l.size(0) == n_tensors && l.size(1) == 3,
                        op, ": layouts must be contiguous int64 rows (b, c, states format), one per tensor");
        const int64_t *values = static_cast<const int64_t *>(l.data_ptr());
        table->layouts.assign(values, values + 3 * n_tensors);
    }
    std::lock_guard<std::mutex> guard(registry_lock);
    registry[next_handle] = std::move(table);
    return next_handle++;
}

// A call of tables ``handles``, each listed once (``op`` names the caller in its errors).
std::shared_ptr<Call> make_call(const std::vector<int64_t> &handles, std::vector<int64_t> per_tensor,
                                std::vector<int64_t> ruled, const char *op) {
    STD_TORCH_CHECK(per_tensor.size() == handles.size() && ruled.size() == handles.size(), op,
                    ": one per_tensor and ruled entry per table");
    auto call = std::make_shared<Call>();
    for (int64_t handle : handles) call->tables.push_back(bound(handle, op));
    call->per_tensor = std::move(per_tensor);
    call->ruled = std::move(ruled);
    call->lock_order.resize(handles.size());
    std::iota(call->lock_order.begin(), call->lock_order.end(), 0);
    std::sort(call->lock_order.begin(), call->lock_order.end(),
              [&](size_t a, size_t b) { return handles[a] < handles[b]; });
    for (size_t k = 1; k < handles.size(); k++)
        STD_TORCH_CHECK(handles[call->lock_order[k]] != handles[call->lock_order[k - 1]], op, ": table ",
                        handles[call->lock_order[k]], " listed twice");
    return call;
}

/* The call of bound_step over tables ``handles``: table k runs once per tensor with ``per_tensor[k]``
   (as the seeds' FusedAdan steps), else in one kernel call, and its rule computes its scalars with
   ``ruled[k]`` (see bound_step). With ``views``, a grad may also come laid out as its table's
   grads_like view (a checked step's); without, only as its param (a bound step's: the user's grads,
   refused in another layout as a checked step refuses them). ``norm_order``, where not empty, is the
   order in which a clip adds its tensors' squares: a permutation of the tables' tensors (numbered in
   the tables' order), so that the norm is summed in the order a checked step sums it, whatever order
   the tables list their tensors in (Muon's, by shape). Returns its handle, which unbind releases; it
   holds its tables while it lives. */
int64_t bind_call(std::vector<int64_t> handles, std::vector<int64_t> per_tensor, std::vector<int64_t> ruled,
                  bool views, std::vector<int64_t> norm_order) {
    const char *op = "fastoptim::bind_call";
    std::shared_ptr<Call> call = make_call(handles, std::move(per_tensor), std::move(ruled), op);
    call->views = views;
    int64_t n_tensors = 0;
    for (const std::shared_ptr<Bound> &table : call->tables) {
        STD_TORCH_CHECK(table->run, op, ": a table that runs nothing (bound with runs=False)");
        n_tensors += table->n_tensors;
    }
    if (!norm_order.empty()) {
        std::vector<bool> seen(static_cast<size_t>(n_tensors));
        STD_TORCH_CHECK(static_cast<int64_t>(norm_order.size()) == n_tensors, op, ": norm_order must list each of the ",
                        n_tensors, " tensors of its tables once");
        for (int64_t k : norm_order) {
            STD_TORCH_CHECK(k >= 0 && k < n_tensors && !seen[static_cast<size_t>(k)], op,
                            ": norm_order must list each of the ", n_tensors, " tensors of its tables once");
            seen[static_cast<size_t>(k)] = true;
        }
        call->norm_order = std::move(norm_order);
    }
    std::lock_guard<std::mutex> guard(registry_lock);
    calls[next_handle] = std::move(call);
    return next_handle++;
}

// Release a table or a call (a call's tables live while it does).
void unbind(int64_t handle) {
    std::lock_guard<std::mutex> guard(registry_lock);
    registry.erase(handle);
    calls.erase(handle);
}

enum { STEPPED = 0, STALE = 1, GRADS_UNFIT = 2 };

// Checking thousands of tensors after a step has streamed the caches away misses on each one's
// metadata (a handle's tensor, then its TensorImpl: 2000 params with Adan's states cost 2.4 ms, the
// kernel 6). So a check loop asks for them ahead: the handle ``AHEAD`` tensors on, and the TensorImpl
// of the one half as far on, through the pointer that an AtenTensorHandle's at::Tensor holds first.
// Only hints: a prefetch of a wrong address cannot fault, and the pointer read is within the tensor.
// That its first word is the TensorImpl's address is how the shim lays out a handle today (an
// at::Tensor), not a promise of the stable ABI: were it not, the prefetches would miss, not fail.
constexpr size_t AHEAD = 16;

template <typename Handle>
void prefetch_ahead(const Handle *handles, size_t i, size_t n, AtenTensorHandle (*handle_of)(const Handle &)) {
    if (i + AHEAD < n) __builtin_prefetch(handle_of(handles[i + AHEAD]));
    if (i + AHEAD / 2 < n) {
        const AtenTensorHandle handle = handle_of(handles[i + AHEAD / 2]);
        if (handle == nullptr) return;
        const char *impl = *reinterpret_cast<char *const *>(handle);
        for (int line = 0; line < 4; line++) __builtin_prefetch(impl + 64 * line);
    }
}

AtenTensorHandle handle_of_tensor(const Tensor &t) { return t.get(); }
AtenTensorHandle handle_of_handle(const AtenTensorHandle &h) { return h; }

// Whether ``flags`` keep only states that ``table`` was bound with: a flag set by an option that changed
// where the step's plan did not see it (AdamWSN's β1 from 0, edited in place in its list) would have the
// kernel walk a row of null pointers. The step then plans again (STALE).
bool keeps_bound_rows(const Bound &table, int64_t flags) {
    for (int64_t row = FIRST_STATE; row < table.kernel->states_end; row++) {
        const int64_t needs = table.kernel->needs[row - FIRST_STATE];
        if ((!needs || flags & needs) && !table.rows_bound[row]) return false;
    }
    return true;
}

// STALE where a tensor that ``table`` holds, watches or counts with moved or changed its layout.
int64_t check_held(const Bound &table) {
    for (size_t i = 0; i < table.held.size(); i++) {
        prefetch_ahead(table.held.data(), i, table.held.size(), handle_of_tensor);
        if (!table.layouts_then[i].describes(table.held[i])) return STALE;
    }
    for (size_t i = 0; i < table.views.size(); i++) {
        prefetch_ahead(table.views.data(), i, table.views.size(), handle_of_tensor);
        if (table.views_then[i].moved_out(table.views[i])) return STALE;
    }
    for (size_t i = 0; i < table.watched.size(); i++) {
        prefetch_ahead(table.watched.data(), i, table.watched.size(), handle_of_tensor);
        if (!table.watched_then[i].describes(table.watched[i])) return STALE;
    }
    for (size_t i = 0; i < table.counts.size(); i++)
        if (!table.counts_then[i].describes(table.counts[i])) return STALE;
    return STEPPED;
}

// STALE where a tensor that any of ``tables`` holds, watches or counts with moved or changed its layout.
// Every table's, before any grad is looked at: a caller told GRADS_UNFIT learns that they all hold.
int64_t check_all_held(const std::vector<std::shared_ptr<Bound>> &tables) {
    for (const std::shared_ptr<Bound> &table : tables)
        if (check_held(*table) != STEPPED) return STALE;
    return STEPPED;
}

// Whether ``table``'s grads, from ``first`` of ``grads``, fit (its held tensors checked already: see
// check_all_held): GRADS_UNFIT when a grad is not walked as its param (or, with ``views``, as its
// grads_like view), else STEPPED, with the table's grads' row refreshed.
int64_t check(Bound &table, const std::vector<AtenTensorHandle> &grads, size_t first, bool views, const char *op) {
    const int64_t n = table.n_tensors;
    STD_TORCH_CHECK(first + n <= grads.size(), op, ": fewer grads than the tables take");
    for (int64_t t = 0; t < n; t++) {
        prefetch_ahead(grads.data() + first, t, n, handle_of_handle);
        int64_t *pointer = &table.pointers[GRAD * n + t];
        if (grads[first + t] == nullptr) return GRADS_UNFIT;
        const Read grad(grads[first + t]);  // read once: it may fit the param's view or the param
        if (!fits(grad, table.layouts_then[t], table.grad_dtype, pointer)
            && (!views || table.grads_like.empty()
                || !fits(grad, table.grads_like[t], table.grads_like[t].dtype, pointer)))
            return GRADS_UNFIT;
    }
    return STEPPED;
}

// --- norms and scaling of dense grads ------------------------------------------------------------

// A grad as the norm and scale kernels walk it: flat, from its first element (it is dense).
struct Span {
    int64_t pointer, numel;
    int32_t format;  // fused_cpu.c's FP32, BF16 or FP16
};

constexpr int64_t NORM_CHUNK_NUMEL = 1 << 15;  // a thread's share is whole chunks

// Spans cut into chunks of NORM_CHUNK_NUMEL elements, a chunk table per format, and where each span's
// chunks are. A norm's partial sums are then each chunk's, whichever grads come with it: a total
// summed in span order is the same number wherever those spans are listed in that order.
struct Chunked {
    std::vector<int64_t> pointers[3], chunks[3];
    std::vector<int64_t> first_chunk, n_chunks;  // per span, in its format's table

    explicit Chunked(const std::vector<Span> &spans) {
        for (const Span &span : spans) {
            std::vector<int64_t> &rows = chunks[span.format];
            const int64_t tensor = static_cast<int64_t>(pointers[span.format].size());
            pointers[span.format].push_back(span.pointer);
            first_chunk.push_back(static_cast<int64_t>(rows.size() / 4));
            for (int64_t start = 0; start < span.numel; start += NORM_CHUNK_NUMEL) {
                const int64_t before = rows.empty() ? 0 : rows[rows.size() - 1] + rows[rows.size() - 2];
                rows.insert(rows.end(), {tensor, start, std::min(NORM_CHUNK_NUMEL, span.numel - start), before});
            }
            n_chunks.push_back(static_cast<int64_t>(rows.size() / 4) - first_chunk.back());
        }
    }
};

// The sum of squares (or with ``inf`` the largest magnitude) of every element of ``spans``: each
// chunk's partial in float64, then the partials added in span order, chunk after chunk (a NaN stays).
double total_of(const std::vector<Span> &spans, bool inf) {
    const Chunked chunked(spans);
    std::vector<double> partials[3];
    for (int32_t format = 0; format < 3; format++) {
        const std::vector<int64_t> &rows = chunked.chunks[format];
        partials[format].resize(rows.size() / 4);
        if (!rows.empty())
            fastoptim_grad_norm(chunked.pointers[format].data(), static_cast<int64_t>(chunked.pointers[format].size()),
                                rows.data(), static_cast<int64_t>(rows.size() / 4), format, inf,
                                partials[format].data(), threads());
    }
    double total = 0;
    for (size_t i = 0; i < spans.size(); i++) {
        const double *part = partials[spans[i].format].data() + chunked.first_chunk[i];
        for (int64_t k = 0; k < chunked.n_chunks[i]; k++) {
            if (!inf) total += part[k];
            else if (total == total && !(part[k] <= total)) total = part[k];  // the larger, or a NaN, which stays
        }
    }
    return total;
}

// The clip coefficient ``min(1, max_norm / (norm + eps))`` of grads whose sum of squares is
// ``total``, the norm first multiplied by GradScaler's 1/scale where one is given: in fp32, each
// operation as torch's tensor arithmetic does it (fastoptim.clip.coefficient_of; torch divides a number
// by a tensor as its reciprocal times the number), with no fused multiply-add (none is compiled in).
float clip_coefficient(double total, double max_norm, double eps, const float *inv_scale) {
    float norm = static_cast<float>(std::sqrt(total));
    if (inv_scale) norm = norm * *inv_scale;
    const float coefficient = (1.0f / (norm + static_cast<float>(eps))) * static_cast<float>(max_norm);
    return coefficient > 1.0f ? 1.0f : coefficient;  // a NaN stays, as torch's clamp keeps it
}

/* One step of bound call ``handle`` (see bind_call): its table k takes the next n_tensors of ``grads``
   and the next n_scalars of the scalars (``numbers``, some replaced by ``tensor_scalars``: see
   StepScalars) and its flag bits ``flags[k]``. Every table is checked, and each one's flags found
   to have a kernel variant, before any runs, so an answer other than STEPPED changed nothing: STALE
   when a held tensor moved or changed its layout, GRADS_UNFIT when a grad is not a tensor its param's
   walk takes.

   A ruled table computes its scalars after the first three (found_inf, seed, grad scale) by its
   rule (see Rule), from its next ``options``, at the count each tensor reaches (its count + 1: a step
   GradScaler skips reads none; one that reaches less than 1, or NaN, makes the call STALE); after every
   kernel ran, each count its ruled tables hold is advanced once, by 1, or by 0 where found_inf is set.
   Scalars with one value per tensor where counts differ.

   With ``amp_scale`` (GradScaler's scale, one fp32 or float64 CPU value), each table's grad scale is
   multiplied by its inverse, as fp32 from a float64 reciprocal (as torch's unscale rounds it). With
   ``clip`` (max_norm, eps), the grads of all tables are clipped by their norm as one: each table's
   grad scale is then multiplied by the clip coefficient of the sum of squares of every grad, in the
   call's norm_order (else the tables' order; see total_of), the norm unscaled by that inverse. */
int64_t bound_step(int64_t handle, const std::vector<AtenTensorHandle> &grads, std::vector<double> numbers,
                   std::vector<Tensor> tensor_scalars, std::vector<int64_t> slots, std::vector<int64_t> flags,
                   std::vector<double> options, std::vector<double> clip, std::optional<Tensor> amp_scale) {
    const char *op = "fastoptim::bound_step";
    const std::shared_ptr<Call> call = find_bound(calls, handle, "call", op);
    const std::vector<std::shared_ptr<Bound>> &tables = call->tables;
    const std::vector<int64_t> &per_tensor = call->per_tensor, &ruled = call->ruled;
    STD_TORCH_CHECK(flags.size() == tables.size(), op, ": one flags entry per table");
    for (int64_t bits : flags)
        STD_TORCH_CHECK(bits >= 0 && bits <= INT32_MAX, op, ": flags ", bits, " are not a kernel's flag bits");
    const Locked locked(*call);
    if (check_all_held(tables) != STEPPED) return STALE;  // a refused call runs none
    std::vector<int64_t> tensors_of_slot, first_scalars;
    size_t first_grad = 0;
    for (const std::shared_ptr<Bound> &held_table : tables) {
        Bound &table = *held_table;
        const int64_t status = check(table, grads, first_grad, call->views, op);
        if (status != STEPPED) return status;
        if (!keeps_bound_rows(table, flags[&held_table - tables.data()])) return STALE;
        first_grad += table.n_tensors;
        first_scalars.push_back(static_cast<int64_t>(tensors_of_slot.size()));
        tensors_of_slot.insert(tensors_of_slot.end(), table.n_scalars, table.n_tensors);
    }
    STD_TORCH_CHECK(first_grad == grads.size() && tensors_of_slot.size() == numbers.size(), op,
                    ": the grads and scalars must be the tables' own, all of them");
    const StepScalars values(numbers, tensor_scalars, slots, tensors_of_slot);
    std::vector<Scalar> scalars = values.scalars;
    std::vector<std::vector<float>> ruled_values(tables.size());
    std::vector<std::pair<float *, float>> advanced;  // each count a ruled table holds, and its increment
    size_t at = 0;
    for (size_t k = 0; k < tables.size(); k++) {
        if (!ruled[k]) continue;
        const Bound &table = *tables[k];
        const Rule *rule = table.rule;
        STD_TORCH_CHECK(rule && at + rule->n_options <= options.size() && (!rule->counts || !table.counts.empty()),
                        op, ": table ", k, " has no rule, its options or its counts");
        const double *table_options = options.data() + at;
        at += rule->n_options;
        Scalar *s = scalars.data() + first_scalars[k];
        const float increment = s[FOUND_INF].values[0] == 0 ? 1.0f : 0.0f;
        std::vector<double> reached;
        for (const Layout &count : table.counts_then) {  // where check found each count: no second read
            float *value = static_cast<float *>(count.data);
            reached.push_back(static_cast<double>(*value) + 1);
            // a count written in place that is no whole number >= 0 (below 0 or NaN: its bias corrections
            // divide by zero; 1.5 or inf): the checked step refuses it by name, as it does a count set anew;
            // nothing has run yet
            const double whole = reached.back();
            if (!(whole >= 1 && std::isfinite(whole) && whole == std::floor(whole))) return STALE;
            advanced.emplace_back(value, increment);
        }
        const bool shared = std::adjacent_find(reached.begin(), reached.end(), std::not_equal_to<>()) == reached.end();
        const int64_t n = shared ? 1 : table.n_tensors, n_scalars = table.n_scalars;
        std::vector<double> out(n_scalars);
        std::vector<float> &computed = ruled_values[k];
        computed.assign(n_scalars * n, 0.0f);
        for (int64_t i = 0; i < n; i++) {
            if (i == 0 || reached[i] != reached[i - 1])  // a run of params at one count shares its scalars
                rule->scalars(table_options, reached.empty() ? 1.0 : reached[i], out.data());
            for (int64_t j = COMMON_SCALARS; j < n_scalars; j++) computed[j * n + i] = static_cast<float>(out[j]);
        }
        for (int64_t j = COMMON_SCALARS; j < n_scalars; j++) s[j] = {&computed[j * n], shared ? 0 : 1};
    }
    STD_TORCH_CHECK(at == options.size(), op, ": more options than the ruled tables take");
    std::vector<float> grad_scales(tables.size());  // each table's, where GradScaler or the clip scale it
    float inverse;
    const float *inv_scale = nullptr;
    if (amp_scale.has_value()) {
        const Read r = read_for(*amp_scale, op);
        STD_TORCH_CHECK(amp_scale->is_cpu() && amp_scale->numel() == 1
                            && (r.dtype == aoti_torch_dtype_float32() || r.dtype == aoti_torch_dtype_float64()),
                        op, ": amp_scale must be one fp32 or float64 CPU value");
        const double scale = r.dtype == aoti_torch_dtype_float64() ? *static_cast<const double *>(r.data)
                                                                   : *static_cast<const float *>(r.data);
        inverse = static_cast<float>(1.0 / scale);
        inv_scale = &inverse;
        for (size_t k = 0; k < tables.size(); k++) {
            Scalar &grad_scale = scalars[first_scalars[k] + GRAD_SCALE];
            STD_TORCH_CHECK(grad_scale.stride == 0, op, ": a table's grad scale must be one value under GradScaler");
            grad_scales[k] = grad_scale.values[0] * inverse;
            grad_scale = {&grad_scales[k], 0};
        }
    }
    if (!clip.empty()) {
        STD_TORCH_CHECK(clip.size() == 2, op, ": clip must be (max_norm, eps) or empty");
        std::vector<Span> spans;
        for (const std::shared_ptr<Bound> &table : tables)
            for (int64_t t = 0; t < table->n_tensors; t++) {
                const Layout &param = table->layouts_then[t];
                int64_t numel = 1;
                for (int64_t size : param.sizes) numel *= size;
                spans.push_back({table->pointers[GRAD * table->n_tensors + t], numel, kernel_dtype(table->grad_dtype)});
            }
        if (!call->norm_order.empty()) {
            std::vector<Span> ordered;
            ordered.reserve(spans.size());
            for (int64_t k : call->norm_order) ordered.push_back(spans[static_cast<size_t>(k)]);
            spans.swap(ordered);
        }
        const float coefficient = clip_coefficient(total_of(spans, false), clip[0], clip[1], inv_scale);
        for (size_t k = 0; k < tables.size(); k++) {
            Scalar &scale = scalars[first_scalars[k] + GRAD_SCALE];
            STD_TORCH_CHECK(scale.stride == 0, op, ": a clipped table's grad scale must be one value");
            grad_scales[k] = coefficient * scale.values[0];
            scale = {&grad_scales[k], 0};
        }
    }
    for (size_t k = 0; k < tables.size(); k++) {  // a kernel over no chunks answers whether its flags have a variant
        const Bound &table = *tables[k];
        const int status = table.run(table.pointers.data(), table.n_tensors, table.chunks.data(), 0, 0, nullptr,
                                     scalars.data() + first_scalars[k], table.dtype, static_cast<int32_t>(flags[k]), 1);
        STD_TORCH_CHECK(status == 0, op, ": the kernel has no variant for dtype code ", table.dtype, " with flags ",
                        flags[k]);
    }
    for (size_t k = 0; k < tables.size(); k++) {
        Bound &table = *tables[k];
        const int64_t n = table.n_tensors;
        const int64_t *chunks = table.chunks.data(), n_chunks = static_cast<int64_t>(table.chunks.size() / 4);
        const int64_t *layouts = table.layouts.empty() ? nullptr : table.layouts.data();
        for (int64_t begin = 0, end; begin < n_chunks; begin = end) {
            end = n_chunks;
            if (per_tensor[k])  // the chunks of one tensor are consecutive rows
                for (end = begin + 1; end < n_chunks && chunks[4 * end] == chunks[4 * begin]; end++) {}
            const int status = table.run(table.pointers.data(), n, chunks, begin, end, layouts,
                                         scalars.data() + first_scalars[k],
                                         table.dtype, static_cast<int32_t>(flags[k]), threads());
            STD_TORCH_CHECK(status == 0, op, ": the kernel has no variant for dtype code ", table.dtype,
                            " with flags ", flags[k]);
        }
    }
    if (!std::is_sorted(advanced.begin(), advanced.end()))  // counts in a flat buffer come in its order
        std::sort(advanced.begin(), advanced.end());
    for (size_t i = 0; i < advanced.size(); i++)  // a group's count, which each of its tables holds, once
        if (i == 0 || advanced[i].first != advanced[i - 1].first)
            *advanced[i].first = *advanced[i].first + advanced[i].second;
    return STEPPED;
}

/* Check tables ``handles`` (as bound_step does, each taking the next n_tensors of ``grads``) and
   write their grads' data pointers, in order, into ``grad_pointers`` (int64, one per grad): what a
   GPU kernel's launch needs. STEPPED when all fit, else STALE (a table's tensor moved: every table's are
   checked first) or GRADS_UNFIT. */
int64_t check_bound(std::vector<int64_t> handles, const std::vector<AtenTensorHandle> &grads, Tensor grad_pointers) {
    const char *op = "fastoptim::check_bound";
    STD_TORCH_CHECK(grad_pointers.is_cpu() && grad_pointers.scalar_type() == ScalarType::Long
                        && grad_pointers.is_contiguous() && grad_pointers.numel() == static_cast<int64_t>(grads.size()),
                    op, ": grad_pointers must be a contiguous int64 CPU tensor with one entry per grad");
    const std::shared_ptr<Call> call =
        make_call(handles, std::vector<int64_t>(handles.size()), std::vector<int64_t>(handles.size()), op);
    const Locked locked(*call);
    if (check_all_held(call->tables) != STEPPED) return STALE;
    int64_t *out = static_cast<int64_t *>(grad_pointers.data_ptr());
    size_t first_grad = 0;
    for (const std::shared_ptr<Bound> &held_table : call->tables) {
        Bound &table = *held_table;
        const int64_t status = check(table, grads, first_grad, true, op);
        if (status != STEPPED) return status;
        std::copy_n(&table.pointers[GRAD * table.n_tensors], table.n_tensors, out + first_grad);
        first_grad += table.n_tensors;
    }
    STD_TORCH_CHECK(first_grad == grads.size(), op, ": the grads must be the tables' own, all of them");
    return STEPPED;
}

// Whether the tensors that bound tables ``handles`` hold, watch and count with are where and as they
// were bound (STEPPED, else STALE), their grads aside: a compiled step's op checks the other ops' tables
// of its step before its own runs, so that a step one of them refuses changes nothing.
int64_t holds_bound(std::vector<int64_t> handles) {
    const char *op = "fastoptim::holds_bound";
    const std::shared_ptr<Call> call =
        make_call(handles, std::vector<int64_t>(handles.size()), std::vector<int64_t>(handles.size()), op);
    const Locked locked(*call);
    return check_all_held(call->tables);
}

// A step's grads as the boxed call hands them: one tensor handle each, owned here and deleted with
// this, without the Tensor (and its shared count) that generic unboxing wraps each element in. A
// step's grads are most of its arguments (a call with 148 grads: 26 µs, against 33 unboxed generically).
struct GradHandles {
    std::vector<AtenTensorHandle> handles;

    explicit GradHandles(StableIValue list) {
        StableListHandle items = torch::stable::detail::to<StableListHandle>(list);
        size_t n = 0;
        bool read = torch_list_size(items, &n) == AOTI_TORCH_SUCCESS;
        handles.reserve(n);
        for (size_t i = 0; read && i < n; i++) {
            StableIValue item;
            read = torch_list_get_item(items, i, &item) == AOTI_TORCH_SUCCESS;
            if (read) handles.push_back(torch::stable::detail::to<AtenTensorHandle>(item));
        }
        torch_delete_list(items);
        if (!read) release();
        STD_TORCH_CHECK(read, "fastoptim: a list of grads that cannot be read");
    }
    GradHandles(const GradHandles &) = delete;
    GradHandles &operator=(const GradHandles &) = delete;
    ~GradHandles() { release(); }

    void release() {
        for (AtenTensorHandle h : handles)
            if (h != nullptr) aoti_torch_delete_tensor_object(h);
        handles.clear();
    }
};

// bound_step and check_bound, boxed by hand around their grads (argument 1; every other argument is
// unboxed as TORCH_BOX does).
void bound_step_boxed(StableIValue *stack, uint64_t num_args, uint64_t num_outputs) {
    using torch::stable::detail::to;
    STD_TORCH_CHECK(num_args == 9 && num_outputs == 1, "fastoptim::bound_step: a schema of 9 arguments, 1 output");
    auto handle = to<int64_t>(stack[0]);
    const GradHandles grads(stack[1]);
    auto numbers = to<std::vector<double>>(stack[2]);
    auto tensor_scalars = to<std::vector<Tensor>>(stack[3]);
    auto slots = to<std::vector<int64_t>>(stack[4]), flags = to<std::vector<int64_t>>(stack[5]);
    auto options = to<std::vector<double>>(stack[6]), clip = to<std::vector<double>>(stack[7]);
    auto amp_scale = to<std::optional<Tensor>>(stack[8]);
    stack[0] = torch::stable::detail::from(
        bound_step(handle, grads.handles, numbers, tensor_scalars, slots, flags, options, clip, amp_scale));
}

void check_bound_boxed(StableIValue *stack, uint64_t num_args, uint64_t num_outputs) {
    using torch::stable::detail::to;
    STD_TORCH_CHECK(num_args == 3 && num_outputs == 1, "fastoptim::check_bound: a schema of 3 arguments, 1 output");
    auto handles = to<std::vector<int64_t>>(stack[0]);
    const GradHandles grads(stack[1]);
    auto grad_pointers = to<Tensor>(stack[2]);
    stack[0] = torch::stable::detail::from(check_bound(handles, grads.handles, grad_pointers));
}

// --- the clip kernels, the probe and the 8-bit codes --------------------------------------------

// The pointer table's rows of ``tensors`` (n_rows rows of equal length), and their numels: false
// unless all are CPU tensors of one kernel dtype, each dense where ``dense``.
struct Rows {
    std::vector<int64_t> pointers, numels;
    int32_t dtype = -1;

    bool read(const std::vector<Tensor> &tensors, int64_t n_rows, bool dense, const char *op) {
        static const int32_t cpu = aoti_torch_device_type_cpu();
        STD_TORCH_CHECK(n_rows > 0 && tensors.size() % n_rows == 0, op, ": a ragged table");
        const size_t n = tensors.size() / n_rows;
        for (size_t i = 0; i < tensors.size(); i++) {
            const Read r(tensors[i]);
            const int32_t code = kernel_dtype(r.dtype);
            if (!r.readable || r.device_type != cpu || code < 0 || (i > 0 && code != dtype)) return false;
            dtype = code;
            int64_t numel = 1;
            for (int64_t d = 0; d < r.dim; d++) numel *= r.sizes[d];
            if (dense && !is_dense(r)) return false;
            pointers.push_back(numel ? reinterpret_cast<int64_t>(r.data) : 0);
            if (i < n) numels.push_back(numel);
            else STD_TORCH_CHECK(numel == numels[i % n], op, ": the rows' tensors differ in size");
        }
        return true;
    }
};

enum { TAKEN = 0, NOT_TAKEN = 2 };

// The spans of ``grads`` into ``spans``: false unless each is a dense CPU tensor of a kernel dtype.
bool read_spans(const std::vector<Tensor> &grads, std::vector<Span> &spans) {
    static const int32_t cpu = aoti_torch_device_type_cpu();
    for (const Tensor &grad : grads) {
        const Read r(grad);
        const int32_t format = kernel_dtype(r.dtype);
        if (!r.readable || r.device_type != cpu || format < 0 || !is_dense(r)) return false;
        const int64_t numel = grad.numel();
        spans.push_back({numel ? reinterpret_cast<int64_t>(r.data) : 0, numel, format});
    }
    return true;
}

// The sum of squares (or with ``inf`` the largest magnitude) of the grads' elements, into ``total``
// (a float64 CPU scalar), in the one order fastoptim sums a norm in (see total_of): TAKEN, or NOT_TAKEN
// (nothing written) unless each grad is a dense CPU tensor of a kernel dtype.
int64_t dense_grad_norm_total(std::vector<Tensor> grads, bool inf, Tensor total) {
    const char *op = "fastoptim::dense_grad_norm_total";
    STD_TORCH_CHECK(total.is_cpu() && total.scalar_type() == ScalarType::Double && total.numel() == 1, op,
                    ": total must be one float64 CPU value");
    std::vector<Span> spans;
    if (!read_spans(grads, spans)) return NOT_TAKEN;
    *static_cast<double *>(total.data_ptr()) = total_of(spans, inf);
    return TAKEN;
}

// Multiplies the grads by ``factor`` (one fp32 CPU value, read here: no host sync): TAKEN, or NOT_TAKEN
// (nothing changed) unless each grad is a dense CPU tensor of a kernel dtype and no two share memory
// (threads would race on it).
int64_t scale_dense_grads(std::vector<Tensor> grads, Tensor factor) {
    const char *op = "fastoptim::scale_dense_grads";
    STD_TORCH_CHECK(factor.is_cpu() && factor.scalar_type() == ScalarType::Float && factor.numel() == 1, op,
                    ": factor must be one fp32 CPU value");
    std::vector<Span> spans;
    if (!read_spans(grads, spans)) return NOT_TAKEN;
    std::vector<std::pair<int64_t, int64_t>> extents;  // [first byte, past the last)
    for (const Span &span : spans)
        if (span.numel) extents.emplace_back(span.pointer, span.pointer + span.numel * (span.format == 0 ? 4 : 2));
    std::sort(extents.begin(), extents.end());
    for (size_t i = 1; i < extents.size(); i++)
        if (extents[i].first < extents[i - 1].second) return NOT_TAKEN;
    const Chunked chunked(spans);
    for (int32_t format = 0; format < 3; format++)
        if (!chunked.chunks[format].empty())
            fastoptim_scale_grads(chunked.pointers[format].data(),
                                  static_cast<int64_t>(chunked.pointers[format].size()), chunked.chunks[format].data(),
                                  static_cast<int64_t>(chunked.chunks[format].size() / 4), format,
                                  static_cast<const float *>(factor.data_ptr()), threads());
    return TAKEN;
}

// The bandwidth probe over ``tensors``: Adan's rows (param, grad and four states), fp32, dense.
void probe(std::vector<Tensor> tensors, Tensor chunks) {
    const char *op = "fastoptim::probe";
    const int64_t n_rows = ADAN_STATES_END;
    Rows rows;
    STD_TORCH_CHECK(rows.read(tensors, n_rows, true, op) && rows.dtype == 0, op, ": dense fp32 CPU tensors only");
    const int64_t *table = checked_chunks(chunks, rows.numels, op);
    fastoptim_probe(rows.pointers.data(), static_cast<int64_t>(tensors.size()) / n_rows, table, 0, chunks.size(0),
                    threads());
}

void check_codes(const Tensor &values, const Tensor &codes, const Tensor &absmax, const char *op) {
    const int64_t n = values.numel();
    STD_TORCH_CHECK(values.is_cpu() && values.scalar_type() == ScalarType::Float && values.is_contiguous()
                        && codes.is_cpu() && codes.scalar_type() == ScalarType::Byte && codes.is_contiguous()
                        && codes.numel() == n && absmax.is_cpu() && absmax.scalar_type() == ScalarType::Float
                        && absmax.is_contiguous() && absmax.numel() == (n + 255) / 256,
                    op, ": contiguous CPU tensors: fp32 values, as many uint8 codes, fp32 maxima per 256 values");
}

void quantize(Tensor values, int64_t table, Tensor codes, Tensor absmax) {
    check_codes(values, codes, absmax, "fastoptim::quantize");
    fastoptim_quantize(static_cast<const float *>(values.data_ptr()), values.numel(), static_cast<int32_t>(table),
                       static_cast<uint8_t *>(codes.data_ptr()), static_cast<float *>(absmax.data_ptr()));
}

void dequantize(Tensor codes, Tensor absmax, int64_t table, Tensor values) {
    check_codes(values, codes, absmax, "fastoptim::dequantize");
    fastoptim_dequantize(static_cast<const uint8_t *>(codes.data_ptr()), static_cast<const float *>(absmax.data_ptr()),
                         codes.numel(), static_cast<int32_t>(table), static_cast<float *>(values.data_ptr()));
}

int64_t use_openmp(std::string path) { return fastoptim_use_openmp(path.empty() ? nullptr : path.c_str()); }

int64_t use_f16c(bool enable) { return fastoptim_use_f16c(enable); }

}  // namespace

STABLE_TORCH_LIBRARY_FRAGMENT(fastoptim, m) {
    m.def("bind(str kernel, Tensor[] held, int[] rows, int n_tensors, int n_rows, int n_scalars, Tensor chunks, "
          "Tensor? layouts, Tensor[] owners, Tensor[] watched, Tensor[] grads_like, str rule, Tensor[] counts, "
          "bool runs=True) -> int");
    m.def("unbind(int handle) -> ()");
    m.def("kernel_rows(str kernel) -> int");
    m.def("bind_call(int[] handles, int[] per_tensor, int[] ruled, bool views, int[] norm_order=[]) -> int");
    m.def("bound_step(int call, Tensor[] grads, float[] numbers, Tensor[] tensor_scalars, int[] slots, int[] flags, "
          "float[] options, float[] clip, Tensor? amp_scale) -> int");
    m.def("rule_scalars(str rule, float[] options, float t, int n_scalars) -> float[]");
    m.def("ruled_scalars(str rule, float[] options, Tensor[] counts, Tensor? first_reads, int[] per_param, "
          "int[] owners, int n, bool round_to_float) -> Tensor[]");
    m.def("check_bound(int[] handles, Tensor[] grads, Tensor(a!) grad_pointers) -> int");
    m.def("holds_bound(int[] handles) -> int");
    m.def("dense_grad_norm_total(Tensor[] grads, bool inf, Tensor(a!) total) -> int");
    m.def("scale_dense_grads(Tensor(a!)[] grads, Tensor factor) -> int");
    m.def("probe(Tensor(a!)[] tensors, Tensor chunks) -> ()");
    m.def("quantize(Tensor values, int table, Tensor(a!) codes, Tensor(b!) absmax) -> ()");
    m.def("dequantize(Tensor codes, Tensor absmax, int table, Tensor(a!) values) -> ()");
    m.def("use_openmp(str path) -> int");
    m.def("use_f16c(bool enable) -> int");
}

STABLE_TORCH_LIBRARY_IMPL(fastoptim, CompositeExplicitAutograd, m) {
    m.impl("bind", TORCH_BOX(&bind));
    m.impl("unbind", TORCH_BOX(&unbind));
    m.impl("kernel_rows", TORCH_BOX(&kernel_rows));
    m.impl("bind_call", TORCH_BOX(&bind_call));
    m.impl("bound_step", &bound_step_boxed);
    m.impl("rule_scalars", TORCH_BOX(&rule_scalars));
    m.impl("ruled_scalars", TORCH_BOX(&ruled_scalars));
    m.impl("check_bound", &check_bound_boxed);
    m.impl("holds_bound", TORCH_BOX(&holds_bound));
    m.impl("dense_grad_norm_total", TORCH_BOX(&dense_grad_norm_total));
    m.impl("scale_dense_grads", TORCH_BOX(&scale_dense_grads));
    m.impl("probe", TORCH_BOX(&probe));
    m.impl("quantize", TORCH_BOX(&quantize));
    m.impl("dequantize", TORCH_BOX(&dequantize));
    m.impl("use_openmp", TORCH_BOX(&use_openmp));
    m.impl("use_f16c", TORCH_BOX(&use_f16c));
}
