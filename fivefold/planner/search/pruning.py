"""What the search drops without sizing every variant: a model state that cannot fit whatever the
activations, a DP mode a less sharded one dominates, a micro-batch larger than one that did not
fit, and the CP exchange's twins sized once.
"""
from __future__ import annotations

from fivefold.config.schema import Config
from fivefold.config.precision import Precision
from fivefold.pipeline.schedules import microbatch_problem
from fivefold.planner.layout import Plan
from fivefold.planner.memory.kinds import MemoryAssumptions
from fivefold.planner.memory.states import after_step_gathers, model_state, rank_params, state_bytes_per_param
from fivefold.planner.presets.hardware import Hardware


GiB = 2**30


def cp_twin(cfg: Config) -> tuple:
    """What tells `cfg`'s layout from its twins of another CP exchange (p2p, a2a): its parallel fields
    but `cp_comm_type`, and whether it gathers K and V (the one way the memory model reads the exchange)."""
    p = cfg.parallel
    return tuple(v for k, v in vars(p).items() if k != "cp_comm_type") + (p.cp_comm_type == "allgather",)


SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Data-parallel modes from the least sharded: the search sizes them in this order."""
DOMINATED = ("a less sharded DP mode fits at this micro-batch with no more recompute (sharding gradients or "
             "parameters moves more bytes for no time: it only pays in memory)")


def state_problem(cfg: Config, hw: Hardware, mem: MemoryAssumptions = MemoryAssumptions(),
                  layout: Plan | None = None) -> str | None:
    """Why `cfg` cannot fit whatever its activations (weights + gradients + optimizer state as sized,
    ZeRO-2/3's whole buffers and gathered units included, with the allocator overhead and the runtime
    reserve, exceed the GPU), or None (`layout`: a Plan of the same layout, to take its layout-only
    properties from)."""
    plan = Plan(cfg) if layout is None else layout.with_training(cfg)
    t = cfg.training
    per_param = tuple(state_bytes_per_param(t, plan.precision, d) for d in (plan.dp * plan.cp, plan.edp))
    prec = Precision.of(t, plan.precision)
    for r in dict.fromkeys(plan.rank_classes):  # ranks of one shape hold the same parameters
        state = model_state(plan, r, *rank_params(plan, r), per_param, prec, t.sharding_strategy)
        need = sum(state) * (1 + mem.allocator_overhead) + mem.runtime_reserve
        if need > hw.memory_bytes:
            return (f"needs {need / GiB:.1f} GiB on pipeline rank {r} for model state alone, "
                    f"{(need - hw.memory_bytes) / GiB:.1f} GiB over the {hw.memory_bytes / GiB:.0f} GiB of a {hw.name}")
    return None


PP_DOMINATED = ("under pipeline parallelism this DP mode holds at least what the distributed optimizer "
                "(ZeRO-1) holds, with the same activations, and moves no fewer bytes: it never fits where "
                "ZeRO-1 does not, and is never faster")


def sharded_under_pp(cfg: Config, layout: Plan) -> str | None:
    """`PP_DOMINATED` when `cfg` is ZeRO-2/3 under PP and holds no less than its ZeRO-1 twin on any
    pipeline rank, else None. Under our PP schedules, ZeRO-2 keeps whole gradient buffers for the step
    and reduce-scatters them once, as ZeRO-1 (`memory.states.zero2_full_buffers`): the same state and bytes.
    ZeRO-3 keeps its units whole from their first forward to the step's end (`zero3_gathered`), so it
    holds ZeRO-1's weights plus its 1/d shards, and gathers nothing after the step where ZeRO-1 does
    (at most two buckets per domain, `optimizer_phase`, the one term it holds less of): dominated
    where the shards outweigh those buckets, on every rank shape (tests/test_planner_search.py: the
    search equals the exhaustive one with ZeRO-2/3 in it). Megatron-FSDP reduces every microbatch
    (`Plan.reduce_every_microbatch`): it holds less, and is sized."""
    mode = cfg.training.sharding_strategy
    if layout.pp == 1 or mode not in ("optim_grads", "optim_grads_params"):
        return None
    plan, t = layout.with_training(cfg), cfg.training
    if plan.reduce_every_microbatch:
        return None
    if mode == "optim_grads":
        return PP_DOMINATED
    prec = Precision.of(t, plan.precision)
    (dense_shard, _, _), (expert_shard, _, _) = (state_bytes_per_param(t, plan.precision, d)
                                                 for d in (plan.dp * plan.cp, plan.edp))
    for r in dict.fromkeys(plan.rank_classes):
        dense, expert = rank_params(plan, r)
        if dense * dense_shard + expert * expert_shard < after_step_gathers(plan, dense, expert, prec):
            return None
    return PP_DOMINATED


def _larger(mbs: int, why: str) -> str:
    """Why a variant is dropped unsized: the same recompute mode did not fit at a smaller micro-batch."""
    return f"{why} (at micro-batch {mbs}; a larger one holds no less)"


def _may_break(cfg: Config, dp: int) -> bool:
    """Whether a variant of a valid base (micro-batch 1, no recompute) can break a rule: the rules that
    read the micro-batch are the global batch's divisibility (the search skips those sizes) and the
    schedule's microbatch rule (`microbatch_problem`, on B / (mbs DP) microbatches, in the variant's
    group); the recompute fields `_variant` writes are valid together. So a full check is needed only
    where that rule refuses (it then gives the message)."""
    p, t = cfg.parallel, cfg.training
    return microbatch_problem(p.pipeline_schedule, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
                              t.global_batch_size // (t.micro_batch_size * dp), p.microbatch_group_size_per_vp_stage) is not None
