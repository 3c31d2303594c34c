"""Megatron's `--split` (data.split): the proportions of the train / validation / test sets, and the rule
they must meet, read by validation before any rank starts and by the data loader (fivefold.data.indexed)."""
from __future__ import annotations

import re


def split_weights(split: str) -> list[float]:
    """The proportions of `split` ("969,30,1", "98 2", "90/10", or "'99,1,0'" as Megatron's example scripts
    quote it), read as Megatron reads them (its numbers, by the pattern [.0-9]+); ValueError when `split`
    holds anything but numbers, separators (, / space) and quotes, or a number such as 1.2.3."""
    if re.search(r"[^0-9.,/\s'\"]", split):
        raise ValueError(split)
    return [float(w) for w in re.findall(r"[.0-9]+", split)]


def split_problem(split: str) -> str | None:
    """Why `split` is not Megatron's `--split` (up to three non-negative proportions), or None."""
    try:
        weights = split_weights(split)
    except ValueError:
        return "give comma-separated proportions, e.g. 969,30,1"
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        return "give up to three non-negative proportions (train, validation, test), e.g. 969,30,1"
    return None
