"""The bytes of an optimizer's AdamW state. AdamW itself and the global-norm clipping are
fivefold.parallel.optimizer's (the math every data-parallel mode shares), re-exported here."""
from __future__ import annotations

from fivefold.parallel.optimizer import build_adamw, build_optimizer, clip_grad_norm  # noqa: F401


def state_bytes(optimizer) -> int:
    """Bytes of the AdamW moments (exp_avg + exp_avg_sq) this rank holds."""
    return sum(v.nbytes for s in optimizer.state.values() for k, v in s.items() if k != "step")
