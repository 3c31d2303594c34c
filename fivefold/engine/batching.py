"""Token-budget micro-batching with the same micro-batch count on every DP rank.

RL batches hold sequences of very different lengths. Each rank groups its sequences into micro-batches
whose padded size (count x longest) stays within `max_tokens` (first-fit over the sequences longest
first); a lone sequence longer than the budget is a micro-batch of its own. The ranks must then run
the same number of micro-batches — with data parallelism a rank that runs one more backward waits
forever for the others' gradient reduction — so every rank plans from every rank's lengths (one
all-gather of n integers) and takes the largest count: a rank with fewer micro-batches splits its
largest ones, and where it has fewer sequences than that count, its last micro-batches are empty
(no tokens: `Engine.train_batch` runs a padding row's zero-loss forward and backward there, so the
collectives of a micro-batch run on every rank). `balanced_split` first
gives the ranks contiguous shares of the global batch with near-equal tokens (seed 003's balanced
DP split, fivefold.data.sampler.balanced_partition).
"""
from __future__ import annotations

from fivefold.data.sampler import balanced_partition


def _cost(bin_: list[int], lengths: list[int]) -> int:
    return len(bin_) * max((lengths[i] for i in bin_), default=0)


def pack(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped so that each group's count x longest <= max_tokens (unless one
    sequence alone is longer); first fit, longest first. Groups keep their indices sorted."""
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b in bins:
            if _cost(b + [i], lengths) <= max_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def plan(lengths_per_rank: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Each rank's micro-batches (indices into its own sequences), every rank with the same count."""
    packed = [pack(lengths, max_tokens) for lengths in lengths_per_rank]
    count = max(len(p) for p in packed)
    for bins in packed:
        while len(bins) < count and any(len(b) > 1 for b in bins):
            big = max((b for b in bins if len(b) > 1), key=len)
            bins.remove(big)
            bins += [big[: len(big) // 2], big[len(big) // 2:]]
        bins += [[] for _ in range(count - len(bins))]
    return packed


def balanced_split(lengths: list[int], dp_size: int) -> list[range]:
    """Contiguous shares of a global batch, one per DP rank, balanced by tokens."""
    bounds = balanced_partition(lengths, dp_size)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
