"""Learning-rate schedule: linear warm-up, then cosine (or linear, or constant) decay to min_lr.

For optimizer step s = 0, 1, ..., T-1 (T = train_iters, W = lr_warmup_iters):
  s < W:  lr = lr_max * (s + 1) / W
  s >= W: r = (s - W) / max(1, T - W),  lr = min_lr + f(r) * (lr_max - min_lr)
          cosine f(r) = (1 + cos(pi r)) / 2,  linear f(r) = 1 - r,  constant f(r) = 1
As Megatron's, with the decay ending at the last step.
"""
from __future__ import annotations

import math

from fivefold.config.schema import TrainingConfig
from fivefold.errors import UserError

DECAY_STYLES = ("cosine", "linear", "constant")


def lr_at(step: int, training: TrainingConfig) -> float:
    t = training
    if t.lr_decay_style not in DECAY_STYLES:
        raise UserError(f"training.lr_decay_style={t.lr_decay_style!r}: must be one of {', '.join(DECAY_STYLES)}")
    if step < t.lr_warmup_iters:
        return t.lr * (step + 1) / t.lr_warmup_iters
    r = min(1.0, (step - t.lr_warmup_iters) / max(1, t.train_iters - t.lr_warmup_iters))
    f = {"cosine": 0.5 * (1 + math.cos(math.pi * r)), "linear": 1 - r, "constant": 1.0}[t.lr_decay_style]
    return t.min_lr + f * (t.lr - t.min_lr)
