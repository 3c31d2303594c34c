"""Counting routed assignments per expert on the device they live on."""
from __future__ import annotations

import torch


def bincount(indices: torch.Tensor, n: int) -> torch.Tensor:
    """torch.bincount(indices, minlength=n) for indices in [0, n), without the host sync that CUDA's
    bincount makes to size its output (it reads the indices' largest value): ones added at the
    indices, exact integer sums. One flat index tensor of any shape."""
    flat = indices.reshape(-1)
    return torch.zeros(n, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
