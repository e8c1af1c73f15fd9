"""Where the Triton kernels' tests run: the GPU when there is one, else the CPU under Triton's
interpreter. The variable must be in the environment before `triton` is first imported (a kernel
decorated before it is compiled for a GPU): import this module first (tests/kernels/conftest.py does)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
