"""The configs the search makes (`make_config`, its variants by micro-batch, recompute and DP mode,
the overlaps and microbatch group a runtime turns on) and the label a layout is printed under
(`describe`).
"""
from __future__ import annotations

import dataclasses

from fivefold.config.rules import a2a_overlap_problems, sizes_of
from fivefold.config.schema import ClusterConfig, Config, ModelConfig, ParallelConfig, TrainingConfig
from fivefold.pipeline.schedules import smallest_group
from fivefold.planner.layout import Plan
from fivefold.planner.search.space import megatron_fsdp as runs_megatron_fsdp, recompute_fields


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
    Megatron-FSDP (`space.megatron_fsdp`); `fp8_recipe`: the scaling under fp8; `tp_comm_overlap`: TP
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
