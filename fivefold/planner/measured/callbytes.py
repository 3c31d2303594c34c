"""Communication per step per rank in the runtime's counting convention (call bytes, by traffic
tag), so the planner can be checked against `fivefold.runtime.traffic` byte for byte.

The calls themselves are listed once, in ../time/layer_collectives.py and rank_collectives.py (which
../time/steptime.py times from the same list); this sums their call bytes by tag.
"""
from __future__ import annotations

from fivefold.planner.time.layer_collectives import forward_layer_collectives
from fivefold.planner.time.rank_collectives import forward_stage_collectives, rank_collectives
from fivefold.planner.search.forward import forward_layer_groups
from fivefold.planner.layout import Plan


def call_bytes(plan: Plan, pp_rank: int = 0) -> dict[str, float]:
    """Call bytes per step of one rank of pipeline rank `pp_rank`, by runtime traffic tag."""
    out: dict[str, float] = {}
    for c, count in rank_collectives(plan, pp_rank):
        out[c.tag] = out.get(c.tag, 0.0) + c.call_bytes * count
    return {k: v for k, v in out.items() if v}


def forward_call_bytes(plan: Plan, pp_rank: int = 0) -> dict[str, float]:
    """Call bytes of a forward-only model's forward over the global batch (`Engine.forward`: its layers'
    forward calls and `forward_stage_collectives`, per microbatch) on one rank of pipeline rank
    `pp_rank`, by traffic tag; `plan` from `forward.forward_config`."""
    out: dict[str, float] = {}
    calls = [(c, n) for i, n in forward_layer_groups(plan, pp_rank) for c in forward_layer_collectives(plan, i)] \
        + [(c, 1) for c in forward_stage_collectives(plan, pp_rank)]
    for c, n in calls:
        out[c.tag] = out.get(c.tag, 0.0) + c.call_bytes * n * plan.microbatches
    return {k: v for k, v in out.items() if v}
