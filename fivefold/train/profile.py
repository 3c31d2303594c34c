"""Megatron's --profile / --profile-ranks: a torch.profiler Chrome trace of two training steps per
profiled rank, written to OUT/profile/rank-R.pt.trace.json (open in chrome://tracing or Perfetto;
TensorBoard's profiler plugin reads the *.pt.trace.json name).

Which steps: Megatron's default window, iterations [10, 12) (--profile-step-start 10
--profile-step-end 12), so the first steps' warm-up stays out; a run shorter than 12 steps profiles its
last two, a run resumed past step 10 its first two. Each step is a "train_step N" range in the trace.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PROFILE_STEP_START, PROFILE_STEP_END = 10, 12
"""Megatron-LM's defaults of --profile-step-start / --profile-step-end (end excluded)."""


def profile_steps(start: int, train_iters: int) -> range:
    """The steps a run from `start` to `train_iters` profiles (see the module docstring)."""
    first = max(start, min(PROFILE_STEP_START, train_iters - (PROFILE_STEP_END - PROFILE_STEP_START)))
    return range(first, min(first + PROFILE_STEP_END - PROFILE_STEP_START, train_iters))


class StepProfiler:
    """`with profiler.step(k): <train step k>`: profiles the steps of `profile_steps` when enabled."""

    def __init__(self, enabled: bool, steps: range, out_dir: Path, rank: int, device: torch.device):
        self.enabled, self.steps = enabled and len(steps) > 0, steps
        self.path = out_dir / "profile" / f"rank-{rank}.pt.trace.json"
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if not self.enabled or step not in self.steps:
            yield
            return
        if self._prof is None:
            self._prof = profile(activities=self.activities, record_shapes=True)
            self._prof.__enter__()
        with record_function(f"train_step {step}"):
            yield
        if step == self.steps[-1]:
            self._prof.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prof.export_chrome_trace(str(self.path))
            self._prof = None
