"""The global batch of each step: fixed, or Megatron-LM's step batch-size schedule
(--step-batch-size-schedule "0:16 2.4B:320 4.8B:624 ...").

A schedule is THRESHOLD:BATCH entries; a step whose consumed samples (the sum of the batches before
it) reach a threshold runs that entry's batch. Thresholds are tokens (Megatron passes the sequence
length, so `250B` = 250e9 tokens = 250e9 // seq_length samples) with K/M/B/T suffixes; the first is 0,
they increase strictly, and the last entry's batch is the global batch (so --global-batch-size may not
be given too: Megatron refuses both, and training.global_batch_size keeps its default, micro batch x
DP). Megatron's learning-rate scheduler then counts samples: each step advances it by the step's
batch, and an iteration span (lr_warmup_iters, lr_decay_iters, train_iters) is that many times
training.global_batch_size samples — micro batch x DP, not the schedule's batch: Megatron's rule,
kept (fivefold.train.schedule). Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

import numpy as np

from fivefold.errors import UserError

if TYPE_CHECKING:
    from fivefold.config.schema import Config

_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _number(text: str, entry: str, schedule: str) -> int:
    t = text.strip().upper()
    scale = _SUFFIX.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise UserError(f"training.step_batch_size_schedule={schedule!r}: {text!r} in {entry!r} is not a number "
                        "(K, M, B and T suffixes allowed)") from None
    return int(value)


def parse_schedule(text: str, seq_length: int) -> list[tuple[int, int]]:
    """(threshold in samples, global batch) entries, in order; UserError naming a bad entry."""
    example = "e.g. \"0:16 2.4B:320\" (tokens consumed : global batch)"
    entries = []
    for entry in text.replace(",", " ").split():
        threshold, colon, batch = entry.partition(":")
        if not colon:
            raise UserError(f"training.step_batch_size_schedule={text!r}: entry {entry!r} is not THRESHOLD:BATCH; "
                            + example)
        entries.append((_number(threshold, entry, text) // seq_length, _number(batch, entry, text)))
    entries.sort()
    if not entries or entries[0][0] != 0:
        raise UserError(f"training.step_batch_size_schedule={text!r}: the first entry's threshold must be 0; {example}")
    for (a, _), (b, _) in zip(entries, entries[1:]):
        if b <= a:
            raise UserError(f"training.step_batch_size_schedule={text!r}: thresholds must increase strictly "
                            f"(two entries at {a} samples of {seq_length} tokens)")
    if any(batch < 1 for _, batch in entries):
        raise UserError(f"training.step_batch_size_schedule={text!r}: every batch size must be >= 1")
    return entries


@dataclass(frozen=True)
class BatchSizes:
    """Each step's global batch and the samples consumed before it."""
    entries: tuple[tuple[int, int], ...]
    """(threshold in samples, batch); one entry (0, B) for a fixed batch."""
    steps: int

    @staticmethod
    def of(training) -> BatchSizes:
        t = training
        return _sizes(t.step_batch_size_schedule, t.seq_length, t.global_batch_size, t.train_iters)

    @property
    def fixed(self) -> bool:
        return len(self.entries) == 1

    @property
    def final(self) -> int:
        return self.entries[-1][1]

    @cached_property
    def _starts(self) -> np.ndarray:
        """Samples consumed before step s, s = 0 .. steps (the last: after the whole run)."""
        starts = np.zeros(self.steps + 1, dtype=np.int64)
        thresholds = [t for t, _ in self.entries]
        consumed = 0
        for s in range(self.steps):
            starts[s] = consumed
            consumed += self.entries[np.searchsorted(thresholds, consumed, side="right") - 1][1]
        starts[self.steps] = consumed
        return starts

    def start(self, step: int) -> int:
        return step * self.final if self.fixed else int(self._starts[step])

    def size(self, step: int) -> int:
        return self.final if self.fixed else int(self._starts[step + 1] - self._starts[step])

    def sizes(self) -> list[int]:
        """The distinct batch sizes the run's steps use."""
        return sorted({self.size(s) for s in range(self.steps)}) if not self.fixed else [self.final]

    def steps_for_samples(self, samples: int) -> int:
        """Megatron's iteration count for --train-samples: samples // batch for a fixed batch; under a
        schedule, steps until at least `samples` are consumed (megatron/training/training.py)."""
        if self.fixed:
            return samples // self.final
        thresholds = [t for t, _ in self.entries]
        consumed = steps = 0
        while consumed < samples:
            consumed += self.entries[np.searchsorted(thresholds, consumed, side="right") - 1][1]
            steps += 1
        return steps


@lru_cache(maxsize=8)
def _sizes(schedule: str | None, seq_length: int, global_batch_size: int, steps: int) -> BatchSizes:
    """One BatchSizes per run (its per-step table is built once)."""
    if schedule:
        return BatchSizes(tuple(parse_schedule(schedule, seq_length)), steps)
    return BatchSizes(((0, global_batch_size),), steps)


def microbatches_per_step(config: Config, dp_size: int) -> int:
    """Microbatches each DP rank runs per step: global_batch_size / (micro_batch_size x DP)."""
    t = config.training
    return t.global_batch_size // (t.micro_batch_size * dp_size)
