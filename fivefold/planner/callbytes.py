"""Communication per step per rank in the runtime's counting convention (call bytes, by tag), so the
planner can be checked against `fivefold.runtime.traffic` byte for byte.

Call bytes (runtime/traffic.py): the full tensor a collective produces or consumes. all-reduce: the
tensor; all-gather: the gathered output; reduce-scatter: the unscattered input; all-to-all: the
input; send and recv: each counted on its own rank. What leaves a rank over the wire is call bytes x
2(n-1)/n for an all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for p2p:
`steptime.py` reports those (`StepEstimate.comm_bytes`) and times them.

Per optimizer step of one rank (m microbatches of b sequences of s tokens):
  dp-grad  every local gradient, all-reduced once over DP x CP in buckets (GradReducer; fp32
           gradients whatever the precision: 4 bytes per local parameter, the tied embedding once).
           With the distributed optimizer: reduce-scatter of the gradients (4P) + all-gather of the
           parameters (weight bytes x P) instead.
"""
from __future__ import annotations

from fivefold.planner.layout import Plan
from fivefold.planner.memory import rank_params, state_bytes_per_param

GRAD_BYTES = 4
"""Gradients are fp32 (main grads) under every precision."""


def call_bytes(plan: Plan, pp_rank: int = 0) -> dict[str, float]:
    """Call bytes per step of one rank of pipeline rank `pp_rank`, by runtime traffic tag."""
    out: dict[str, float] = {}
    dense, expert = rank_params(plan, pp_rank)
    weight = state_bytes_per_param(plan.precision, False, 1)[0]
    distopt = plan.config.training.use_distributed_optimizer
    grads = 0.0
    for count, d in ((dense, plan.dp * plan.cp), (expert, plan.edp)):
        if count and d > 1:
            grads += GRAD_BYTES * count + (weight * count if distopt else 0.0)
    if grads:
        out["dp-grad"] = grads
    return out
