"""Without a GPU, Triton's kernels run in its interpreter on CPU tensors (see tests/test_triton.py).
It must be chosen before Triton's kernels are defined, when fastoptim is first imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
