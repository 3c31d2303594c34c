"""Search: every layout in `space.py`, checked by the foundation's rules, sized by the memory
model, timed by the step-time model, ranked by step time. Layouts that break a rule or do not fit
are kept with the reason."""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

from fivefold.config.schema import Config, ModelConfig, TrainingConfig
from fivefold.errors import UserError
from fivefold.planner.layout import Plan
from fivefold.planner.memory.kinds import MemoryAssumptions, RankMemory
from fivefold.planner.memory.peak import peak_memory
from fivefold.planner.presets.hardware import Hardware
from fivefold.planner.search.space import SearchSpace, recompute_modes, structures
from fivefold.planner.time.steptime import StepEstimate, step_time
from fivefold.planner.time.time_assumptions import TimeAssumptions
from fivefold.planner.search.validity import checked, config_errors, twin_errors
from fivefold.planner.search.pruning import (DOMINATED, SHARDING, GiB, _larger, _may_break, cp_twin, sharded_under_pp,
                                             state_problem)
from fivefold.planner.search.configs import _variant, describe, make_config, with_group, with_layout, with_overlaps


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
    (`grad_reduce_in_bf16`: the runtime's gradient dtype, `calibration.runtime.Runtime`; `progress`: a progress
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
    the exchange only as whether it gathers K and V (`memory.peak.peak_memory`), so a layout's p2p and a2a
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


def clear_caches() -> None:
    """Forget what the planner keeps across layouts and searches (layer splits and groups, parameter
    counts, layer and call costs, links, schedule simulations): a cold search, for tests."""
    from fivefold.config import precision
    from fivefold.planner import layout, pipeline
    from fivefold.planner.memory import activations, layers, params, states
    from fivefold.planner.search import space
    from fivefold.planner.time import calls, flops, layer_cost, links
    for cache in (layout._SPLITS, layout._GROUPS, states._PARAMS, layers._LAYERS, layers._KINDS, params._CACHE,
                  flops._PER_TOKEN, links._CROSS, calls._CALLS, layer_cost._LAYER_COSTS, layer_cost._LAYER_WORK,
                  layer_cost._DENSE_WORK, layer_cost._CP_CALLS, layer_cost._ACTIVATIONS):
        cache.clear()
    for fn in (pipeline._simulate, pipeline._equal_stages, pipeline.pipeline_profile, pipeline.bubble_fraction,
               space.layer_splits, layers._for_precision, activations._interned, precision._policy,
               precision.Precision.state_bytes, links.nodes_hit, links._dense_crossings, links._expert_crossings):
        fn.cache_clear()
