"""Shared fixtures. Triton runs in its interpreter on CPU-only machines (set before any import)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
