"""Communication per step per rank in the runtime's counting convention (call bytes, by tag), so the
planner can be checked against `fivefold.runtime.traffic` byte for byte.

Call bytes (runtime/traffic.py): the full tensor a collective produces or consumes. all-reduce: the
tensor; all-gather: the gathered output; reduce-scatter: the unscattered input; all-to-all: the
input; send and recv: each counted on its own rank. What leaves a rank over the wire is call bytes x
2(n-1)/n for an all-reduce, x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for p2p:
`steptime.py` reports those (`StepEstimate.comm_bytes`) and times them.

Per optimizer step of one rank (m microbatches of b sequences of s tokens; M = b s h x activation
bytes, 4 in fp32, 2 under bf16 autocast; L = the rank's decoder layers):
  tp       TP without SP, per microbatch: each layer's two column-parallel groups (q/k/v, gate/up)
           all-reduce dL/dX backward, its two row-parallel linears (o, down) all-reduce Y forward:
           4 M per layer; the vocab-parallel embedding all-reduces its output (M, first stage), the
           column-parallel output layer dL/dX (M, last stage).
  sp       TP with SP, per microbatch: a column-parallel group all-gathers X forward, all-gathers it
           again backward (only the shard is saved) and reduce-scatters dL/dX: 3 M; a row-parallel
           linear reduce-scatters Y forward and all-gathers dL/dY backward: 2 M; 10 M per layer; the
           embedding reduce-scatters forward and all-gathers backward (2 M), the output layer is a
           column-parallel group (3 M).
  tp-loss  vocab-parallel cross entropy, per microbatch on the last stage: the fp32 max and the
           (sum exp, target logit) pair of every token, 3 x 4 b s bytes.
  tp-grad  once per step under SP: the norm gains' gradients (each TP rank saw its sequence shard),
           one flat fp32 all-reduce of (2 L + final norm) h values. (KV heads replicated when
           TP > KV heads add their own all-reduce, not modelled here.)
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
    out.update(_tensor_parallel(plan, pp_rank))
    return {k: v for k, v in out.items() if v}


def _tensor_parallel(plan: Plan, pp_rank: int) -> dict[str, float]:
    if plan.tp == 1:
        return {}
    m = plan.config.model
    act = 4 if plan.precision == "fp32" else 2
    tokens = plan.mbs * plan.seq / plan.cp
    M = tokens * m.hidden_size * act
    layers = sum(n for _, _, n in plan.layer_groups(pp_rank))
    first, last = pp_rank == 0, pp_rank == plan.pp - 1
    per_mb = (10 if plan.sp else 4) * M * layers
    per_mb += first * (2 if plan.sp else 1) * M + last * (3 if plan.sp else 1) * M
    out = {"sp" if plan.sp else "tp": per_mb * plan.microbatches,
           "tp-loss": last * 3 * 4 * tokens * plan.microbatches}
    if plan.sp:
        out["tp-grad"] = GRAD_BYTES * m.hidden_size * (2 * layers + last)
    return out
