"""What the planner needs from a pipeline schedule: peak in-flight activations per rank and the
pipeline's step time from per-stage microbatch times.

Closed forms (Narayanan et al. 2021, Megatron-LM's schedules), for m microbatches, p stages,
v model chunks per rank:
  GPipe        : every rank holds all m microbatches' activations; time (m - 1) * max_r t_r + sum_r t_r.
  1F1B         : rank r holds min(p - r, m) microbatches; same time as GPipe.
  interleaved  : rank r holds (p - r - 1) * 2 + (v - 1) * p + 1 chunk-microbatches (Megatron's
                 warm-up + 1), capped at m * v; time m * max_r t_r + (sum_r t_r - max_r t_r) / v.
With equal stage times t these give (m + p - 1) t and m t + (p - 1) t / v: bubble fractions
(p - 1) / (m + p - 1) and (p - 1) / (v m + p - 1).
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class PipelineProfile:
    inflight_chunks: tuple[int, ...]
    """Per pipeline rank: peak number of (microbatch, model chunk) forward activations held."""
    vpp: int
    """Model chunks per rank (1 without interleaving)."""

    def inflight_microbatches(self, rank: int) -> float:
        """Peak held activations of `rank` in units of its whole stage's per-microbatch activations."""
        return self.inflight_chunks[rank] / self.vpp


def pipeline_profile(schedule: str, pp: int, vpp: int | None, m: int) -> PipelineProfile:
    v = vpp or 1
    if schedule == "gpipe":
        held = [m] * pp
    elif schedule == "1f1b":
        held = [min(pp - r, m) for r in range(pp)]
    elif schedule == "interleaved":
        held = [min((pp - r - 1) * 2 + (v - 1) * pp + 1, m * v) for r in range(pp)]
    else:
        raise ValueError(f"the planner has no model of schedule {schedule!r}; use one of {SCHEDULES}")
    return PipelineProfile(inflight_chunks=tuple(held), vpp=v if schedule == "interleaved" else 1)


def pipeline_time(schedule: str, stage_times: list[float], vpp: int | None, m: int) -> float:
    """Step time of the pipeline part, from each rank's time for one microbatch (forward + backward)."""
    worst, total = max(stage_times), sum(stage_times)
    if schedule == "interleaved":
        return m * worst + (total - worst) / (vpp or 1)
    return (m - 1) * worst + total


def bubble_fraction(schedule: str, pp: int, vpp: int | None, m: int) -> float:
    """Idle share of the pipeline time with equal stages."""
    t = pipeline_time(schedule, [1.0] * pp, vpp, m)
    return 1.0 - m / t
