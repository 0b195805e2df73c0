"""Without a GPU, run the triton MoE kernels through Triton's interpreter on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any
test imports the kernels. On a GPU machine it is left alone, so the GPU tests compile
real kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
