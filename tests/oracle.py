"""Float64 re-statements of the published equations, and peers loaded for comparison."""
import math

import torch

SHAPES = [(7,), (5, 3), (2, 3, 2, 2), (1,), (1, 1)]


def make_params(shapes=SHAPES, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in shapes]


def grad_sequence(shapes, steps, seed=1, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) * scale for shape in shapes] for _ in range(steps)]


def run(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for param, grad in zip(params, grads):
            param.grad = grad.to(param.dtype).clone()
        optimizer.step()


def clip_factor(grads, max_grad_norm, eps):
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    return min(1.0, max_grad_norm / (norm + eps)) if max_grad_norm > 0 else 1.0


def adan(params, grads_per_step, lr, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0, no_prox=False,
         max_grad_norm=0.0, maximize=False, round_to=None):
    """Algorithm 1 of the Adan paper in the official code's conventions, in float64."""
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
            n[i] = b3 * n[i] + (1 - b3) * (g + b2 * d) ** 2
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
          maximize=False, max_grad_norm=0.0, round_to=None):
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
            v[i] = b2 * v[i] + (1 - b2) * g * g
            vmax[i] = torch.maximum(vmax[i], v[i])
            denom = (vmax[i] if amsgrad else v[i]).sqrt() / math.sqrt(1 - b2**t) + eps
            p[i] = p[i] - lr / (1 - b1**t) * m[i] / denom
            if round_to is not None:
                p[i] = p[i].to(round_to).double()
    return p


def relative_error(actual, expected):
    """Largest per-tensor ‖actual − expected‖ / ‖expected‖."""
    return max(float((a.detach().double() - e.detach().double()).norm() / e.detach().double().norm().clamp_min(1e-30))
               for a, e in zip(actual, expected))


