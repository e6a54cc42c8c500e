"""Seeding every random number generator a run uses."""

from __future__ import annotations

import os
import random

import torch

__all__ = ["seed_everything"]


def seed_everything(seed: int) -> int:
    """Seed Python's ``random``, NumPy (if installed) and torch (CPU and CUDA)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}.")
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed
