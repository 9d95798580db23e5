"""Global gradient-norm clipping whose coefficient stays a tensor (no host sync)."""
import torch

from .multi_tensor import buckets


def global_grad_norm(grads):
    """The 2-norm over every tensor in ``grads``, as an fp32 0-d tensor on the first grad's device.

    ``torch._foreach_norm`` reduces each tensor without a copy of it; only the per-tensor norms
    (one scalar each) are stacked.
    """
    device = grads[0].device
    squares = []
    for bucket in buckets(grads):
        tensors = [grads[i] for i in bucket]
        wide = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32  # never narrow float64
        norms = torch._foreach_norm(tensors, 2.0, dtype=wide)
        squares.append(torch.stack(norms).square().sum().to(device, torch.float32, non_blocking=True))
    return torch.stack(squares).sum().sqrt()


def clip_coefficient(grads, max_norm, eps, inv_scale=None):
    """``min(1, max_norm / (norm + eps))``, the factor official Adan scales every gradient by.
    ``inv_scale`` (GradScaler's 1/scale, a tensor) unscales the norm of still-scaled grads."""
    norm = global_grad_norm(grads)
    if inv_scale is not None:
        norm = norm * inv_scale
    return (max_norm / (norm + eps)).clamp(max=1.0)
