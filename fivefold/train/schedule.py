"""Learning-rate schedule: linear warm-up, then cosine (or linear, or constant) decay to min_lr, as
Megatron-LM's OptimizerParamScheduler computes it.

The schedule runs in units — iterations, or samples when training.train_samples is set (Megatron's
samples-based schedule: its scheduler advances by the global batch per step). For optimizer step
s = 0, 1, ..., x = s (iterations) or s * B (samples, B = global batch), the units consumed before it:
  W = warm-up (lr_warmup_iters / lr_warmup_samples, or lr_warmup_fraction * D),
  D = decay span (lr_decay_iters / lr_decay_samples, default train_iters / train_samples)
  W > 0 and x <= W:  lr = lr_init + (lr_max - lr_init) * x / W   (lr_init: lr_warmup_init, default 0)
  constant:          lr = lr_max
  x > D:             lr = min_lr
  else:              r = (x - W) / (D - W),  lr = min_lr + f(r) * (lr_max - min_lr)
                     cosine f(r) = (1 + cos(pi r)) / 2,  linear f(r) = 1 - r
So the first step runs at lr_warmup_init and no step exceeds lr_max, whatever the warm-up's length (a
fraction of a step included). Under a step batch-size schedule (fivefold.config.batch_sizes) x is the
samples consumed before the step, and iteration spans count training.global_batch_size samples each, as
Megatron's scheduler. tests/test_train_parts.py and tests/test_batch_sizes.py check every step against
megatron-core's scheduler.
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
        x, span = sizes.start(step), (1 if samples else t.global_batch_size)
    else:
        x, span = step * (t.global_batch_size if samples else 1), 1
    decay = (t.lr_decay_samples or t.train_samples) if samples else (t.lr_decay_iters or t.train_iters) * span
    warmup = t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None else \
        (t.lr_warmup_samples if samples else t.lr_warmup_iters * span)
    if warmup > 0 and x <= warmup:
        return t.lr_warmup_init + (t.lr - t.lr_warmup_init) * x / warmup
    if t.lr_decay_style == "constant":
        return t.lr
    if x > decay:
        return t.min_lr
    r = (x - warmup) / (decay - warmup)
    f = 0.5 * (math.cos(math.pi * r) + 1.0) if t.lr_decay_style == "cosine" else 1.0 - r
    return t.min_lr + f * (t.lr - t.min_lr)
