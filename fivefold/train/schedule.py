"""Learning-rate schedule: linear warm-up, then cosine (or linear, or constant) decay to min_lr.

The schedule runs in units — iterations, or samples when training.train_samples is set (Megatron's
samples-based schedule: its scheduler advances by the global batch per step). For optimizer step
s = 0, 1, ..., with x = s (iterations) or s * B (samples, B = global batch), u = 1 or B one step:
  W = warm-up (lr_warmup_iters / lr_warmup_samples, or lr_warmup_fraction * D),
  D = decay span (lr_decay_iters / lr_decay_samples, default train_iters / train_samples)
  x < W:  lr = lr_init + (lr_max - lr_init) * (x + u) / W   (lr_init: lr_warmup_init, default 0)
  x >= W: r = min(1, (x - W) / max(u, D - W)),  lr = min_lr + f(r) * (lr_max - min_lr)
          cosine f(r) = (1 + cos(pi r)) / 2,  linear f(r) = 1 - r,  constant f(r) = 1
The decay is Megatron's (OptimizerParamScheduler; min_lr past D; tests/test_train_parts.py checks it
against megatron-core's). Under a step batch-size schedule (fivefold.config.batch_sizes) x is the
samples consumed before the step, u its batch, and iteration spans count training.global_batch_size
samples each, as Megatron's scheduler. Difference: Megatron's step s uses (x / W) during warm-up, so its first
step runs at lr 0; fivefold's first step already uses lr_max * u / W.
"""
from __future__ import annotations

import math

from fivefold.config.schema import TrainingConfig
from fivefold.config.batch_sizes import BatchSizes
from fivefold.config.supported import DECAY_STYLES
from fivefold.errors import UserError


def lr_at(step: int, training: TrainingConfig) -> float:
    t = training
    if t.lr_decay_style not in DECAY_STYLES:
        raise UserError(f"training.lr_decay_style={t.lr_decay_style!r}: must be one of {', '.join(DECAY_STYLES)}")
    samples = t.train_samples is not None
    if t.step_batch_size_schedule:  # samples, each step its own batch; iteration spans x global_batch_size
        sizes = BatchSizes.of(t)
        x, u, span = sizes.start(step), sizes.size(step), (1 if samples else t.global_batch_size)
    else:
        u = t.global_batch_size if samples else 1
        x, span = step * u, 1
    decay = (t.lr_decay_samples or t.train_samples) if samples else (t.lr_decay_iters or t.train_iters) * span
    warmup = t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None else \
        (t.lr_warmup_samples if samples else t.lr_warmup_iters * span)
    if x < warmup:
        return t.lr_warmup_init + (t.lr - t.lr_warmup_init) * (x + u) / warmup
    r = min(1.0, (x - warmup) / max(u, decay - warmup))
    f = {"cosine": 0.5 * (1 + math.cos(math.pi * r)), "linear": 1 - r, "constant": 1.0}[t.lr_decay_style]
    return t.min_lr + f * (t.lr - t.min_lr)
