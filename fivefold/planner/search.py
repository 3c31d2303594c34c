"""Search: every layout in `space.py`, checked by the foundation's rules, sized by the memory
model, timed by the step-time model, ranked by step time. Layouts that break a rule or do not fit
are kept with the reason."""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

from fivefold.config.rules import a2a_overlap_problems, sizes_of
from fivefold.config.schema import ClusterConfig, Config, ModelConfig, ParallelConfig, TrainingConfig
from fivefold.errors import UserError
from fivefold.config.precision import Precision
from fivefold.pipeline.schedules import microbatch_problem, smallest_group
from fivefold.planner.layout import Plan
from fivefold.planner.memory.kinds import MemoryAssumptions, RankMemory
from fivefold.planner.memory.states import after_step_gathers, model_state, rank_params, state_bytes_per_param
from fivefold.planner.memory.peak import peak_memory
from fivefold.planner.presets.hardware import Hardware
from fivefold.planner.runtime import megatron_fsdp as runs_megatron_fsdp
from fivefold.planner.space import SearchSpace, recompute_fields, recompute_modes, structures
from fivefold.planner.time.steptime import StepEstimate, step_time
from fivefold.planner.time.time_assumptions import TimeAssumptions
from fivefold.planner.validity import checked, config_errors, twin_errors

GiB = 2**30


@dataclass
class Candidate:
    config: Config
    memory: RankMemory
    """The pipeline rank with the largest memory."""
    estimate: StepEstimate | None = None
    problem: str | None = None
    """Why it is dropped (a broken rule, or how many GiB over); None when it fits."""

    @property
    def plan(self) -> Plan:
        return Plan(self.config)

    @property
    def sized(self) -> bool:
        """Whether its memory was computed (it fits, or needs more than the GPU has); not where it
        breaks a rule (`memory` is then empty)."""
        return self.problem is None or self.problem.startswith("needs")

    @property
    def label(self) -> str:
        return describe(self.config)


@dataclass
class SearchResult:
    ranked: list[Candidate]
    dropped: list[tuple[Config, str]] = field(default_factory=list)
    """(config, reason) of every layout that breaks a rule or does not fit (`describe` names it)."""
    tried: int = 0
    sized: int = 0
    """Layouts whose memory was computed (the rest were dropped by a rule or a bound, unsized)."""


def describe(cfg: Config) -> str:
    p, t = cfg.parallel, cfg.training
    plan = Plan(cfg)
    parts = [f"TP{plan.tp}" + ("+SP" if plan.sp else "")]
    if plan.cp > 1:
        parts.append(f"CP{plan.cp}({p.cp_comm_type})")
    parts.append(f"PP{plan.pp}")
    if plan.schedule == "interleaved":
        parts.append(f"VPP{plan.vpp}" + (f" group{plan.group}" if plan.group else ""))
    elif plan.schedule != "1f1b":
        parts.append(plan.schedule)
    if p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers:
        parts.append(f"split{p.decoder_first_pipeline_num_layers}/../{p.decoder_last_pipeline_num_layers}")
    if p.account_for_embedding_in_pipeline_split or p.account_for_loss_in_pipeline_split:
        parts.append("split+" + "emb" * p.account_for_embedding_in_pipeline_split
                     + "loss" * p.account_for_loss_in_pipeline_split)
    if cfg.model.is_moe:
        parts.append(f"EP{plan.ep} ETP{plan.etp}")
        if p.overlap_moe_expert_parallel_comm:
            parts.append(A2A_OVERLAP)
    parts.append(f"DP{plan.dp}")
    parts.append(f"mbs{t.micro_batch_size}")
    parts.append(recompute_label(t.recompute_granularity, plan.recompute_modules))
    parts += [DP_MODE_LABEL[t.sharding_strategy]] if DP_MODE_LABEL[t.sharding_strategy] else []
    # memory options beside the layout (counted by the planner; docs/precision.md)
    if t.optimizer_cpu_offload:
        parts.append(f"opt-offload{'' if t.optimizer_offload_fraction == 1 else t.optimizer_offload_fraction}")
    if (t.exp_avg_dtype, t.exp_avg_sq_dtype) != ("fp32", "fp32"):
        parts.append(f"moments-{t.exp_avg_dtype}" + ("" if t.exp_avg_dtype == t.exp_avg_sq_dtype else f"/{t.exp_avg_sq_dtype}"))
    if t.fp8_param_gather:
        parts.append("fp8-weights")
    if plan.offload_modules:
        parts.append(f"act-offload({','.join(sorted(plan.offload_modules))})")
    return " ".join(parts)


def recompute_label(granularity: str | None, modules) -> str:
    """rc-none, rc-sel, rc-full, or rc-sel(MODULE,...) for Megatron's --recompute-modules other than
    the attention core alone."""
    rc = {None: "rc-none", "selective": "rc-sel", "full": "rc-full"}[granularity]
    if granularity == "selective" and modules and set(modules) != {"core_attn"}:
        rc += f"({','.join(sorted(modules))})"
    return rc


A2A_OVERLAP = "a2a-overlap"
"""How a layout label says it runs Megatron's 1F1B all-to-all overlap (`plan --compare` reads it)."""
DP_MODE_LABEL = {"optim": "distopt", "optim_grads": "zero2", "optim_grads_params": "fsdp", "no_shard": ""}
"""How a layout label names its data-parallel mode (`plan --compare` reads the same words)."""


def make_config(model: ModelConfig, world: int, gpus_per_node: int, seq: int, global_batch: int,
                precision: str, parallel: dict, micro_batch: int = 1, recompute: str | None = None,
                distributed_optimizer: bool = True, grad_reduce_in_bf16: bool = False,
                recompute_modules: list[str] | None = None, dp_mode: str | None = None,
                a2a_overlap: bool = False, dispatcher: str = "alltoall", megatron_fsdp: bool = False,
                fp8_recipe: str = "delayed", tp_comm_overlap: bool = False) -> Config:
    """A planner config; `a2a_overlap`: with Megatron's 1F1B all-to-all overlap where its rules allow
    (`with_a2a_overlap`); `dispatcher`: the MoE token dispatcher; `megatron_fsdp`: ZeRO-2/3 as
    Megatron-FSDP (`runtime.megatron_fsdp`); `fp8_recipe`: the scaling under fp8; `tp_comm_overlap`: TP
    communication overlapped where the layout has TP with SP (`with_tp_overlap`)."""
    nodes = max(1, world // gpus_per_node)
    cfg = Config(cluster=ClusterConfig(num_nodes=nodes, gpus_per_node=gpus_per_node, world_size=world),
                 parallel=ParallelConfig(**{"moe_token_dispatcher_type": dispatcher, **parallel}), model=model,
                 training=TrainingConfig(seq_length=seq, global_batch_size=global_batch, micro_batch_size=micro_batch,
                                         precision=precision, recompute_granularity=recompute,
                                         recompute_modules=recompute_modules if recompute == "selective" else None,
                                         recompute_method="uniform" if recompute == "full" else None,
                                         recompute_num_layers=1 if recompute == "full" else None,
                                         use_distributed_optimizer=distributed_optimizer and dp_mode != "no_shard",
                                         data_parallel_sharding_strategy=dp_mode,
                                         use_megatron_fsdp=runs_megatron_fsdp(megatron_fsdp, dp_mode),
                                         grad_reduce_in_bf16=grad_reduce_in_bf16 and precision != "fp32",
                                         fp8_recipe=fp8_recipe))
    return with_overlaps(cfg, a2a_overlap, tp_comm_overlap)


def with_overlaps(cfg: Config, a2a_overlap: bool, tp_comm_overlap: bool) -> Config:
    """`cfg` with the overlaps `make_config` turns on (`with_tp_overlap`, `with_a2a_overlap`)."""
    cfg = with_tp_overlap(cfg) if tp_comm_overlap else cfg
    return with_a2a_overlap(cfg) if a2a_overlap else cfg


def with_layout(template: Config, parallel: dict, dispatcher: str) -> Config:
    """`template` (a `make_config` without parallel fields) with the layout `parallel` and MoE token
    `dispatcher`, as `make_config` writes them: its other sections are the template's (the same
    objects, read only: the rules write the parallel section alone), not made again for each layout."""
    cfg = object.__new__(Config)
    cfg.__dict__.update(template.__dict__)
    cfg.parallel = ParallelConfig(**{"moe_token_dispatcher_type": dispatcher, **parallel})
    return cfg


def with_tp_overlap(cfg: Config) -> Config:
    """`cfg` with TP communication overlapped where Megatron-LM's rule allows it (sequence parallelism,
    so TP > 1), else `cfg`."""
    if not cfg.parallel.sequence_parallel or cfg.parallel.tensor_model_parallel_size <= 1:
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp_comm_overlap=True))


def with_a2a_overlap(cfg: Config) -> Config:
    """`cfg` with Megatron's 1F1B all-to-all overlap where Megatron-LM's rules allow it (else `cfg`)."""
    if not cfg.model.is_moe or cfg.parallel.expert_model_parallel_size <= 1:
        return cfg
    on = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, overlap_moe_expert_parallel_comm=True))
    return cfg if a2a_overlap_problems(sizes_of(on)) else on


def with_group(cfg: Config, rule: str = "megatron") -> Config:
    """`cfg` with the microbatch group that lets interleaving run its microbatch count where the
    default group (PP) cannot, i.e. the count is not a multiple of PP (Megatron's
    --microbatch-group-size-per-virtual-pipeline-stage, the Llama 3 paper's tunable N), as the
    runtime's `rule` takes it (`smallest_group`); else `cfg`."""
    p, vpp = cfg.parallel, cfg.parallel.virtual_pipeline_model_parallel_size
    if p.pipeline_schedule not in ("1f1b", "interleaved") or not vpp or vpp < 2:
        return cfg
    m, pp = Plan(cfg).microbatches, p.pipeline_model_parallel_size
    group = smallest_group(pp, m, rule) if m % pp else None
    if group == p.microbatch_group_size_per_vp_stage:
        return cfg
    return dataclasses.replace(cfg, parallel=dataclasses.replace(p, microbatch_group_size_per_vp_stage=group))


def evaluate(cfg: Config, hw: Hardware, mem: MemoryAssumptions = MemoryAssumptions(),
             ta: TimeAssumptions = TimeAssumptions(), check: bool = True, plan: Plan | None = None,
             sized: RankMemory | None = None) -> Candidate:
    """Check, size and time one config (`plan`: its Plan, when the caller has one; `sized`: its peak
    memory, when the caller has sized a config the memory model cannot tell from it); `problem` says
    why it is dropped."""
    if check:
        broken = config_errors(cfg)
        if broken:
            return Candidate(cfg, RankMemory(rank=0), problem="; ".join(broken))
    plan = Plan(cfg) if plan is None or check else plan
    if sized is None:
        try:
            sized = peak_memory(plan, mem)
        except ValueError as e:
            return Candidate(cfg, RankMemory(rank=0), problem=str(e))
    if sized.total > hw.memory_bytes:
        over = (sized.total - hw.memory_bytes) / GiB
        return Candidate(cfg, sized, problem=f"needs {sized.total / GiB:.1f} GiB on pipeline rank {sized.rank}, "
                                             f"{over:.1f} GiB over the {hw.memory_bytes / GiB:.0f} GiB of a {hw.name}")
    return Candidate(cfg, sized, estimate=step_time(plan, hw, ta))


def search(model: ModelConfig, hw: Hardware, world: int, gpus_per_node: int, seq: int, global_batch: int,
           precision: str = "bf16", space: SearchSpace = SearchSpace(), mem: MemoryAssumptions = MemoryAssumptions(),
           ta: TimeAssumptions = TimeAssumptions(), grad_reduce_in_bf16: bool = False,
           progress: bool = False) -> SearchResult:
    """Every layout of `space` for `model` on `world` GPUs, fitting ones ranked fastest first
    (`grad_reduce_in_bf16`: the runtime's gradient dtype, `runtime.Runtime`; `progress`: a progress
    bar on stderr where it is a terminal); UserError where the GPU cannot run the space's fp8 recipe."""
    problem = hw.fp8_recipe_problem(precision, space.fp8_recipe)
    if problem:
        raise UserError(problem)
    layouts = structures(model, world, gpus_per_node, seq, space)
    if progress:  # listed first (a few thousand dicts) for the bar's total; tqdm draws only on a terminal
        from tqdm import tqdm
        layouts = tqdm(list(layouts), desc="plan", unit=" layouts", leave=False, disable=None)
    collecting = gc.isenabled()
    gc.disable()  # reference counting frees what the search drops; the collector's passes over the
    try:          # growing heap of candidates were 5-15% of a 1024-GPU search
        return _search(model, hw, world, gpus_per_node, seq, global_batch, precision, space, mem, ta,
                       grad_reduce_in_bf16, layouts)
    finally:
        if collecting:
            gc.enable()


def _search(model, hw, world, gpus_per_node, seq, global_batch, precision, space, mem, ta,
            grad_reduce_in_bf16, layouts) -> SearchResult:
    result = SearchResult(ranked=[])
    trainings: dict[tuple, TrainingConfig] = {}  # the variants' training sections (`_variant`)
    twin, known, valid = None, {}, None
    """The last layout but its CP exchange, and what sizing its variants found: the memory model reads
    the exchange only as whether it gathers K and V (`memory.peak_memory`), so a layout's p2p and a2a
    twins (consecutive in `structures`) hold the same: (DP mode, micro-batch, recompute) -> RankMemory,
    DP mode -> the model-state check; and the adjusted sizes of a valid twin (`validity.twin_errors`)."""
    dp_modes, modes = sorted(space.dp_modes, key=SHARDING.index), recompute_modes(space, model)
    template = make_config(model, world, gpus_per_node, seq, global_batch, precision, {},
                           grad_reduce_in_bf16=grad_reduce_in_bf16, megatron_fsdp=space.megatron_fsdp,
                           fp8_recipe=space.fp8_recipe)
    for parallel in layouts:
        base = with_group(with_overlaps(with_layout(template, parallel, space.dispatcher), space.a2a_overlap,
                                        space.tp_comm_overlap), space.group_rule)
        if (key := cp_twin(base)) != twin:
            twin, known, valid = key, {}, None
        if valid is None:
            broken, sizes = checked(base)
            valid = None if broken else sizes
        else:
            broken = twin_errors(base, valid)
        layout = Plan(base)  # after config_errors: it writes the resolved VPP, schedule and SP back
        dp, grouped = layout.dp, layout.schedule == "interleaved"
        lighter: dict[int, int] = {}
        """micro-batch -> the first recompute mode (its index) that fits under a less sharded DP mode"""
        for dp_mode in dp_modes:
            # Model state does not depend on the micro-batch or recompute: when it alone does not fit,
            # no variant does. Activations never shrink with a larger micro-batch (the schedule holds
            # min(k, m) microbatches of m = B/(mbs dp): mbs min(k, m) never falls; interleaved in groups
            # of N, mbs (v - 1) N never falls either: j times a group valid for m/j is valid for m), so a recompute mode
            # that does not fit at one micro-batch is dropped unsized at every larger one, and once no
            # mode fits, larger micro-batches are dropped whole (one entry each).
            state = None
            if not broken:
                if dp_mode not in known:
                    first = _variant(base, 1, None, dp_mode, space.megatron_fsdp, trainings)
                    known[dp_mode] = ("optim" in space.dp_modes and sharded_under_pp(first, layout)) or \
                        state_problem(first, hw, mem, layout)
                state = known[dp_mode]
            failed: dict[str | None, tuple[int, str]] = {}
            """recompute mode -> (micro-batch, why) where it was sized and did not fit"""
            for mbs in micro_batches(space, layout.pp, dp, global_batch):
                if global_batch % (mbs * dp):
                    continue
                for i, recompute in enumerate(modes):
                    result.tried += 1
                    cfg = _variant(base, mbs, recompute, dp_mode, space.megatron_fsdp, trainings)
                    if broken or state:
                        result.dropped.append((cfg, "; ".join(broken) or state))
                        break
                    if i >= lighter.get(mbs, len(modes)):  # sharding more only pays in memory
                        result.dropped.append((cfg, DOMINATED))
                        break
                    if all(failed.get(r, (mbs,))[0] < mbs for r in modes):  # no mode fits
                        result.dropped.append((cfg, _larger(*failed[modes[-1]])))
                        break
                    if grouped and (layout.group or global_batch // (mbs * dp) % layout.pp):  # a count PP does not divide
                        cfg = with_group(cfg, space.group_rule)
                    check = _may_break(cfg, dp)
                    if recompute in failed and failed[recompute][0] < mbs and not check:
                        result.dropped.append((cfg, _larger(*failed[recompute])))
                        continue
                    cand = evaluate(cfg, hw, mem, ta, check=check, plan=layout.with_training(cfg),
                                    sized=known.get((dp_mode, mbs, recompute)))
                    result.sized += cand.sized
                    if cand.sized:
                        known[(dp_mode, mbs, recompute)] = cand.memory
                    if cand.problem:
                        result.dropped.append((cfg, cand.problem))
                        if cand.sized:
                            failed.setdefault(recompute, (mbs, cand.problem))
                        continue
                    result.ranked.append(cand)
                    if dp_mode != "no_shard":
                        lighter[mbs] = min(i, lighter.get(mbs, i))
                    break  # slower recompute modes than one that fits never win
    result.ranked.sort(key=rank_key)
    return result


def cp_twin(cfg: Config) -> tuple:
    """What tells `cfg`'s layout from its twins of another CP exchange (p2p, a2a): its parallel fields
    but `cp_comm_type`, and whether it gathers K and V (the one way the memory model reads the exchange)."""
    p = cfg.parallel
    return tuple(v for k, v in vars(p).items() if k != "cp_comm_type") + (p.cp_comm_type == "allgather",)


SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Data-parallel modes from the least sharded: the search sizes them in this order."""
DOMINATED = ("a less sharded DP mode fits at this micro-batch with no more recompute (sharding gradients or "
             "parameters moves more bytes for no time: it only pays in memory)")


def micro_batches(space: SearchSpace, pp: int, dp: int, global_batch: int) -> tuple[int, ...]:
    """The micro-batch sizes tried for a layout: the space's, or without gradient accumulation and
    PP the whole local batch at once (`SearchSpace.accumulate`)."""
    if space.accumulate or pp > 1:
        return space.micro_batch_sizes
    return (max(1, global_batch // dp),)  # not dividing: skipped as any other


def rank_key(c: Candidate) -> tuple[float, float]:
    """The ranking's order: step time to 4 significant digits (closer than that is below the model's
    precision), then fewer bytes sent per rank: of two layouts the model times alike, the one that
    moves less (a CP ring that hides fully still loads the links and needs its overlap to hold)."""
    return float(f"{c.estimate.step_time:.4g}"), sum(c.estimate.comm_bytes.values())


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
    and reduce-scatters them once, as ZeRO-1 (`memory.zero2_full_buffers`): the same state and bytes.
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


def clear_caches() -> None:
    """Forget what the planner keeps across layouts and searches (layer splits and groups, parameter
    counts, layer and call costs, links, schedule simulations): a cold search, for tests."""
    from fivefold.config import precision
    from fivefold.planner import layout, pipeline, space
    from fivefold.planner.memory import activations, layers, params, states
    from fivefold.planner.time import calls, flops, layer_cost, links
    for cache in (layout._SPLITS, layout._GROUPS, states._PARAMS, layers._LAYERS, layers._KINDS, params._CACHE,
                  flops._PER_TOKEN, links._CROSS, calls._CALLS, layer_cost._LAYER_COSTS, layer_cost._LAYER_WORK,
                  layer_cost._DENSE_WORK, layer_cost._CP_CALLS, layer_cost._ACTIVATIONS):
        cache.clear()
    for fn in (pipeline._simulate, pipeline._equal_stages, pipeline.pipeline_profile, pipeline.bubble_fraction,
               space.layer_splits, layers._for_precision, activations._interned, precision._policy,
               precision.Precision.state_bytes, links.nodes_hit, links._dense_crossings, links._expert_crossings):
        fn.cache_clear()


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


def _variant(base: Config, mbs: int, recompute: str | None, dp_mode: str, megatron_fsdp: bool = False,
             trainings: dict | None = None) -> Config:
    """`base` (from `make_config`) with another micro-batch, recompute and data-parallel mode: the fields
    `make_config` sets, copied rather than re-initialised (neither dataclass has a __post_init__;
    the search makes one per variant). `trainings`: the training sections made so far, by (micro-batch,
    recompute, mode), shared by every layout of one search (`make_config` writes the same training
    section for each: its arguments are the search's); the sections are read only."""
    key = (mbs, recompute, dp_mode)
    training = trainings.get(key) if trainings is not None else None
    if training is None:
        training = object.__new__(TrainingConfig)
        training.__dict__.update(base.training.__dict__)
        training.micro_batch_size, training.use_distributed_optimizer = mbs, dp_mode != "no_shard"
        training.data_parallel_sharding_strategy = dp_mode
        training.use_megatron_fsdp = runs_megatron_fsdp(megatron_fsdp, dp_mode)
        training.recompute_granularity, training.recompute_modules = recompute_fields(recompute)
        training.recompute_method = "uniform" if recompute == "full" else None
        training.recompute_num_layers = 1 if recompute == "full" else None
        if trainings is not None:
            trainings[key] = training
    cfg = object.__new__(Config)
    cfg.__dict__.update(base.__dict__)
    cfg.training = training
    if recompute == "full" and base.parallel.overlap_moe_expert_parallel_comm:  # Megatron refuses the two
        cfg.parallel = dataclasses.replace(base.parallel, overlap_moe_expert_parallel_comm=False)
    return cfg
