"""The planner's estimate of one rank of a config beside what that rank measured (pure: takes the
measurement as numbers; `fivefold.testing.measure` produces them on CPU).

Bytes: `callbytes.call_bytes` per model-communication tag vs the traffic counter's (bookkeeping tags
such as "loss" and "grad-norm" are left out of both). Memory: `memory.peak.memory_per_rank` under
`CPU_EAGER` (tensor bytes, no allocator overhead or reserve) vs MemTracker's peak of live tensors,
by kind: weights ~ Parameter, grads ~ Gradient, optimizer ~ Optstate, and the rest (activations,
logits and loss temporaries, buffers, scratch) ~ Activation + Temp.

A forward-only model (`compare_forward_rank`: planner/search/forward.py against `measure_forward`, one
`Engine.forward` of a frozen engine): its forward call bytes (`callbytes.forward_call_bytes`), and its
memory against the measured peak.
"""
from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.schema import Config
from fivefold.planner.measured.callbytes import call_bytes, forward_call_bytes
from fivefold.planner.search.forward import FORWARD_CHUNK, forward_config, forward_memory_per_rank
from fivefold.planner.layout import Plan
from fivefold.planner.memory.kinds import CPU_EAGER, MemoryAssumptions, RankMemory
from fivefold.planner.memory.peak import memory_per_rank
from fivefold.planner.calibration.runtime import apply, profile

BOOKKEEPING_TAGS = ("loss", "grad-norm", "found-inf", "metrics", "moe-metrics", "checkpoint")
"""Traffic tags of scalars for logging, clipping, loss scaling and checkpoint agreement, not model tensors."""

MEASURED_KINDS = {"weights": ("Parameter", "Buffer"), "grads": ("Gradient",), "optimizer": ("Optstate",),
                  "transient": ("Activation", "Temp", "Other")}
"""Planner kind -> the MemTracker kinds it is compared with."""


@dataclass
class RankComparison:
    rank: int
    pp_rank: int
    est_bytes: dict[str, float]
    """Call bytes per model-communication tag, estimated."""
    meas_bytes: dict[str, int]
    """The same, measured (every model tag the counter saw)."""
    est_memory: RankMemory
    meas_kinds: dict[str, int]
    """MemTracker's live bytes at the peak, by its kinds."""
    meas_peak: int

    @property
    def tags(self) -> list[str]:
        return sorted(set(self.est_bytes) | set(self.meas_bytes))

    def bytes_ratio(self, tag: str) -> float:
        """estimated / measured (1.0 when both are 0; inf when only the estimate is non-zero)."""
        e, m = self.est_bytes.get(tag, 0.0), self.meas_bytes.get(tag, 0)
        if m == 0:
            return 1.0 if e == 0 else float("inf")
        return e / m

    @property
    def est_peak(self) -> float:
        return self.est_memory.total

    @property
    def memory_ratio(self) -> float:
        return self.est_peak / self.meas_peak

    def est_kinds(self) -> dict[str, float]:
        r = self.est_memory
        return {"weights": r.weights, "grads": r.grads, "optimizer": r.optimizer,
                "transient": r.activations + r.logits + r.buffers + r.scratch}

    def measured_by_planner_kind(self) -> dict[str, int]:
        return {k: sum(self.meas_kinds.get(x, 0) for x in xs) for k, xs in MEASURED_KINDS.items()}


def compare_rank(config: Config, rank: int, pp_rank: int, bytes_by_tag: dict[str, int], peak_by_kind: dict[str, int],
                 peak: int, assume: MemoryAssumptions = CPU_EAGER) -> RankComparison:
    plan = Plan(apply(config, profile("fivefold")))  # our runtime's sends (an all-to-all whatever the dispatcher)
    model_bytes = {t: b for t, b in bytes_by_tag.items() if t not in BOOKKEEPING_TAGS}
    return RankComparison(rank=rank, pp_rank=pp_rank, est_bytes=call_bytes(plan, pp_rank), meas_bytes=model_bytes,
                          est_memory=memory_per_rank(plan, assume)[pp_rank], meas_kinds=dict(peak_by_kind),
                          meas_peak=peak)


def compare_forward_rank(config: Config, rank: int, pp_rank: int, bytes_by_tag: dict[str, int],
                         peak_by_kind: dict[str, int], peak: int, assume: MemoryAssumptions = CPU_EAGER,
                         chunk: int = FORWARD_CHUNK) -> RankComparison:
    """One rank's forward-only estimate beside `fivefold.testing.measure.measure_forward`."""
    plan = Plan(forward_config(apply(config, profile("fivefold"))))
    model_bytes = {t: b for t, b in bytes_by_tag.items() if t not in BOOKKEEPING_TAGS}
    return RankComparison(rank=rank, pp_rank=pp_rank, est_bytes=forward_call_bytes(plan, pp_rank),
                          meas_bytes=model_bytes, est_memory=forward_memory_per_rank(plan, assume, chunk)[pp_rank],
                          meas_kinds=dict(peak_by_kind), meas_peak=peak)
