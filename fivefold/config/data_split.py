"""Megatron's `--split` (data.split): the proportions of the train / validation / test sets, and the rule
they must meet, read by validation before any rank starts and by the data loader (fivefold.data.indexed)."""
from __future__ import annotations


def split_weights(split: str) -> list[float]:
    """The proportions of `split` ("969,30,1", "98 2", "90/10"); ValueError when one is not a number."""
    return [float(w) for w in split.replace(",", " ").replace("/", " ").split()]


def split_problem(split: str) -> str | None:
    """Why `split` is not Megatron's `--split` (up to three non-negative proportions), or None."""
    try:
        weights = split_weights(split)
    except ValueError:
        return "give comma-separated proportions, e.g. 969,30,1"
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        return "give up to three non-negative proportions (train, validation, test), e.g. 969,30,1"
    return None
