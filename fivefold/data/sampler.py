"""Which samples each step uses: the same global batches for every layout; each DP rank its share.

Global batch b holds samples order[b*G : (b+1)*G] of an endless stream of epochs, epoch e being a
permutation of all samples seeded by (seed, e). Nothing here depends on the DP size, so any layout
sees the same global batches; a DP rank then takes its share of each one:
  fixed-length samples: the contiguous slice [r*G/dp, (r+1)*G/dp);
  variable-length samples: a contiguous part chosen to balance target tokens per rank
  (AReaL's balanced DP partitioning, `SequenceSample.split`).
"""
from __future__ import annotations

import numpy as np


def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The sample order of one epoch: a permutation seeded by (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def global_batch_indices(step: int, global_batch_size: int, num_samples: int, seed: int,
                         shuffle: bool = True, *, start: int | None = None) -> np.ndarray:
    """Sample ids of global batch `step` (epochs wrap around; the order restarts reshuffled); `start`:
    the samples consumed before it when batches differ in size (default step x global_batch_size)."""
    if num_samples < 1:
        raise ValueError("no samples")
    first = step * global_batch_size if start is None else start
    positions = np.arange(first, first + global_batch_size, dtype=np.int64)
    if not shuffle:
        return positions % num_samples
    out = np.empty_like(positions)
    epochs = positions // num_samples
    for e in np.unique(epochs):
        mask = epochs == e
        out[mask] = epoch_order(num_samples, seed, int(e))[positions[mask] % num_samples]
    return out


def even_share(global_batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """Rank `dp_rank`'s contiguous slice of a global batch of fixed-length samples."""
    per_rank = global_batch_size // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def balanced_partition(weights: list[int] | np.ndarray, parts: int) -> list[int]:
    """Boundaries [0, b1, ..., len] of `parts` contiguous, non-empty parts of `weights` whose largest
    sum is as small as possible (the slowest DP rank sets the step time).

    Binary search on the cap C: a greedy left-to-right cut, which cuts as late as C allows while
    leaving one item for every remaining part, succeeds iff some partition has every sum <= C.
    """
    w = [int(x) for x in weights]
    n = len(w)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} samples into {parts} non-empty parts")
    lo, hi = max(w), sum(w)
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(w, parts, mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    return _greedy(w, parts, lo)


def _greedy(w: list[int], parts: int, cap: int) -> list[int] | None:
    bounds, total, n = [0], 0, len(w)
    for i, x in enumerate(w):
        left_after = n - i  # items from i on, for the current part and the parts after it
        parts_after = parts - len(bounds)
        if i > bounds[-1] and (total + x > cap or left_after == parts_after):
            bounds.append(i)
            total = 0
            if len(bounds) > parts:
                return None
        total += x
    bounds.append(n)
    return bounds if len(bounds) == parts + 1 else None
