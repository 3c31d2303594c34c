"""The bytes of an optimizer's AdamW state (AdamW itself and the global-norm clipping live in
fivefold.parallel.optimizer, the math every data-parallel mode shares)."""
from __future__ import annotations


def state_bytes(optimizer) -> int:
    """Bytes of the AdamW moments (exp_avg + exp_avg_sq) this rank holds."""
    return sum(v.nbytes for s in optimizer.state.values() for k, v in s.items() if k != "step")
