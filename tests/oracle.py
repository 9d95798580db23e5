"""Float64 re-statements of the published equations, and peers loaded for comparison."""
import math

import torch

SHAPES = [(7,), (5, 3), (2, 3, 2, 2), (1,), (1, 1)]


def drawn(shape, generator):
    """Normal values drawn on the CPU (the same on every machine), on the default device."""
    return torch.randn(shape, generator=generator, device="cpu").to(torch.get_default_device())


def make_params(shapes=SHAPES, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(drawn(shape, generator).to(dtype)) for shape in shapes]


def grad_sequence(shapes, steps, seed=1, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [[drawn(shape, generator) * scale for shape in shapes] for _ in range(steps)]


def run(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for param, grad in zip(params, grads):
            param.grad = grad.to(param.dtype).clone()
        optimizer.step()


def ulps_apart(a, b):
    """The most units in the last place of fp32 by which two tensors differ (0: the same bits)."""
    ordered = [t.detach().float().flatten().view(torch.int32).long() for t in (a, b)]
    ordered = [torch.where(i < 0, -(i & 0x7FFFFFFF), i) for i in ordered]  # sign-magnitude to a line of ints
    return int((ordered[0] - ordered[1]).abs().max()) if ordered[0].numel() else 0


def clip_factor(grads, max_grad_norm, eps):
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    return min(1.0, max_grad_norm / (norm + eps)) if max_grad_norm > 0 else 1.0


def subset_sums(x, subset_size):
    """Each element of x replaced by the sum of its subset, under the seed's partitions: subset_size
    None sums a 2-D tensor over its smaller dimension (rows when m >= n) and leaves other shapes
    alone; k > 0 cuts the flattened tensor into runs of s, the largest divisor of numel up to k;
    -k takes k' = int(√numel / k). A second moment kept expanded this way equals the reduced one."""
    if subset_size is None:
        if x.dim() != 2:
            return x
        return x.sum(1 if x.shape[0] >= x.shape[1] else 0, keepdim=True).expand_as(x)
    n = x.numel()
    k = subset_size if subset_size > 0 else max(1, int(math.sqrt(n) / -subset_size))
    s = max(d for d in range(1, min(k, n) + 1) if n % d == 0)
    return x.reshape(-1, s).sum(1, keepdim=True).expand(-1, s).reshape(x.shape)


def second_moment_input(x, sn, subset_size):
    return subset_sums(x, subset_size) if sn else x


def adan(params, grads_per_step, lr, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0, no_prox=False,
         max_grad_norm=0.0, maximize=False, round_to=None, sn=False, subset_size=None):
    """Algorithm 1 of the Adan paper in the official code's conventions, in float64 (with ``sn``,
    the squared term summed over each subset)."""
    b1, b2, b3 = betas
    p = [x.detach().double() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    n = [torch.zeros_like(x) for x in p]
    prev = None
    for t, grads in enumerate(grads_per_step, 1):
        grads = [g.double().to(x.dtype) for g, x in zip(grads, p)]
        c = clip_factor(grads, max_grad_norm, eps) * (-1 if maximize else 1)
        grads = [g * c for g in grads]
        prev = grads if prev is None else prev
        for i, g in enumerate(grads):
            d = g - prev[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * d
            n[i] = b3 * n[i] + (1 - b3) * second_moment_input((g + b2 * d) ** 2, sn, subset_size)
            denom = n[i].sqrt() / math.sqrt(1 - b3**t) + eps
            update = lr / (1 - b1**t) * m[i] / denom + lr * b2 / (1 - b2**t) * v[i] / denom
            if no_prox:
                p[i] = p[i] * (1 - lr * weight_decay) - update
            else:
                p[i] = (p[i] - update) / (1 + lr * weight_decay)
            if round_to is not None:
                p[i] = p[i].to(round_to).double()
        prev = grads
    return p


def adamw(params, grads_per_step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
          maximize=False, max_grad_norm=0.0, round_to=None, sn=False, subset_size=None):
    """AdamW (Loshchilov & Hutter, Algorithm 2 as torch.optim.AdamW states it), in float64."""
    b1, b2 = betas
    p = [x.detach().double() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    vmax = [torch.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, 1):
        grads = [g.double() for g in grads]
        c = clip_factor(grads, max_grad_norm, eps) * (-1 if maximize else 1)
        for i, g in enumerate(grads):
            g = g * c
            p[i] = p[i] * (1 - lr * weight_decay)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * second_moment_input(g * g, sn, subset_size)
            vmax[i] = torch.maximum(vmax[i], v[i])
            denom = (vmax[i] if amsgrad else v[i]).sqrt() / math.sqrt(1 - b2**t) + eps
            p[i] = p[i] - lr / (1 - b1**t) * m[i] / denom
            if round_to is not None:
                p[i] = p[i].to(round_to).double()
    return p


def adamw_sn(params, grads_per_step, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, subset_size=None,
             correct_bias=True, sn=True, maximize=False, max_grad_norm=0.0):
    """The seed's AdamwSN (Hugging Face's AdamW with a subset-norm second moment), in float64: eps
    outside the bias correction, which goes into the step size, and weight decay after the update."""
    b1, b2 = betas
    p = [x.detach().double() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, 1):
        grads = [g.double() for g in grads]
        c = clip_factor(grads, max_grad_norm, eps) * (-1 if maximize else 1)
        for i, g in enumerate(grads):
            g = g * c
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * second_moment_input(g * g, sn, subset_size)
            step = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if correct_bias else lr
            p[i] = p[i] - step * m[i] / (v[i].sqrt() + eps)
            p[i] = p[i] - lr * weight_decay * p[i]
    return p


def relative_error(actual, expected):
    """Largest per-tensor ‖actual − expected‖ / ‖expected‖."""
    return max(float((a.detach().double() - e.detach().double()).norm() / e.detach().double().norm().clamp_min(1e-30))
               for a, e in zip(actual, expected))


def lion(params, grads_per_step, lr, betas=(0.9, 0.99), weight_decay=0.0, maximize=False, max_grad_norm=0.0,
         round_to=None, interpolations=None):
    """Lion (Chen et al., 2023, Program 1, as timm's Lion computes it), in float64: decoupled weight
    decay, a step of ``lr`` against the sign of β1·m + (1−β1)·g, then m = β2·m + (1−β2)·g. The clip
    eps is torch's clip_grad_norm_'s (Lion has none of its own). ``interpolations``: a list that
    collects, per step, each tensor's β1·m + (1−β1)·g and the scale of its terms β1·|m| + (1−β1)·|g|
    (an fp32 step may take the other sign where the first is within rounding of 0)."""
    b1, b2 = betas
    p = [x.detach().double() for x in params]
    m = [torch.zeros_like(x) for x in p]
    for grads in grads_per_step:
        grads = [g.double() for g in grads]
        c = clip_factor(grads, max_grad_norm, 1e-6) * (-1 if maximize else 1)
        step = []
        for i, g in enumerate(grads):
            g = g * c
            interpolation = b1 * m[i] + (1 - b1) * g
            step.append((interpolation, b1 * m[i].abs() + (1 - b1) * g.abs()))
            p[i] = p[i] * (1 - lr * weight_decay) - lr * interpolation.sign()
            m[i] = b2 * m[i] + (1 - b2) * g
            if round_to is not None:
                p[i] = p[i].to(round_to).double()
        if interpolations is not None:
            interpolations.append(step)
    return p
