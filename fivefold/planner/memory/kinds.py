"""What a rank's memory estimate is made of: `RankMemory`, its kinds in bytes, and the stated
`MemoryAssumptions` (allocator overhead, runtime reserve, the runtime's `ArchTraits`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.planner.memory.traits import EAGER_TRAITS, ArchTraits


GiB = 2**30


@dataclass(frozen=True)
class MemoryAssumptions:
    allocator_overhead: float = 0.05
    """Share of tensor memory lost to the caching allocator's fragmentation. Default 5%."""
    runtime_reserve: float = 1.0 * GiB
    """CUDA context and NCCL workspaces, outside the allocator (bytes). Default 1 GiB."""
    traits: ArchTraits = ArchTraits()


CPU_EAGER = MemoryAssumptions(allocator_overhead=0.0, runtime_reserve=0.0, traits=EAGER_TRAITS)
"""Our runtime on CPU in fp32: tensor bytes only (the CPU allocator does not cache blocks, and there
is no device context), the eager implementation's saved tensors (`EAGER_TRAITS`)."""

STEP_MARGIN = 1e-9
"""Share of a rank's total by which its activations must exceed its optimizer step's peak for
`_Ranks.sized` to leave out the ranks it covers: the totals' float rounding is ~1e-15 of them."""


@dataclass
class RankMemory:
    rank: int
    """Pipeline rank."""
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    buffers: float = 0.0
    scratch: float = 0.0
    """What the clip + optimizer-step temporaries add beyond the forward/backward peak."""
    overhead: float = 0.0
    reserve: float = 0.0
    params: float = 0.0
    """Parameters held (dense + expert)."""
    inflight: float = 0.0
    """Microbatches of this rank's activations held at the peak."""
    detail: dict[str, float] = field(default_factory=dict)
    """Per-microbatch activation bytes by tensor kind, summed over this rank's layers."""

    KINDS = ("weights", "grads", "optimizer", "activations", "logits", "buffers", "scratch", "overhead", "reserve")

    @property
    def total(self) -> float:
        # the KINDS in order, written out: the search reads this for every rank it sizes
        return (self.weights + self.grads + self.optimizer + self.activations + self.logits + self.buffers
                + self.scratch + self.overhead + self.reserve)

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.KINDS}
