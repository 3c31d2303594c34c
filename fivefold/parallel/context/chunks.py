"""The load-balanced sequence split of context parallelism (Megatron's, for causal attention): a
sequence of s tokens cut into 2n chunks of s/(2n); CP rank r keeps chunks r and 2n-1-r, in that
order (fivefold/parallel/context/context_parallel.py says why). Used by the split of the data, RoPE positions and every
CP exchange (the ring, the all-gather)."""
from __future__ import annotations

import torch


def chunk_ids(n: int, r: int) -> tuple[int, int]:
    """The two chunks (of 2n) CP rank r of n keeps: r and 2n-1-r."""
    return r, 2 * n - 1 - r


def split_sequence(x: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    """x (.., s, ..) -> (.., s/n, ..): chunks r and 2n-1-r of 2n along `dim`, concatenated."""
    if n == 1:
        return x
    if x.shape[dim] % (2 * n):
        raise ValueError(f"context parallelism: sequence of {x.shape[dim]} is not divisible by 2*CP={2 * n}")
    chunks = x.chunk(2 * n, dim)
    return torch.cat([chunks[i] for i in chunk_ids(n, r)], dim)


def local_positions(s_local: int, n: int, r: int, device=None) -> torch.Tensor:
    """The global positions (s_local,) of CP rank r's tokens (s_local = s/n): its RoPE positions."""
    return split_sequence(torch.arange(s_local * n, device=device), 0, n, r)
