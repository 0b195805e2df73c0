"""Without a GPU, run the triton LoRA kernels through Triton's interpreter on CPU tensors (set
before any test imports the kernels; Triton reads it when a kernel is decorated). On a GPU
machine it is left alone, so the kernels compile for real."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
