"""Memory per GPU, by kind, for every pipeline rank; the worst rank is what must fit.

Model state, per parameter held by the rank, read from the runtime's precision policy
(fivefold.config.precision; Megatron's mixed precision: 16-bit weights, fp32 main gradients unless
--grad-reduce-in-bf16 / fp16 without --accumulate-allreduce-grads-in-fp32, fp32 main weights + two
Adam moments):
    bf16 / fp8 : weights 2 + gradients 4 + optimizer 12 = 18 bytes,
                 or 2 + 4 + 12/d with the distributed optimizer (Megatron's "6 + 12/d");
                 bf16 gradients: 2 + 2 + 12 (or 12/d);
    fp16       : 2 + 2 + 12 (fp16 gradients), 2 + 4 + 12 with fp32 accumulation;
    fp32       : 4 + 4 + 8 = 16 bytes, or 4 + 4 + 8/d.
d is the data-parallel group the optimizer shards over: DP x CP for dense parameters, expert-DP for
routed experts. A rank holds: its layers' attention and dense MLPs / TP, their norms and routers
whole, routed experts / (ETP x EP), the vocab-parallel embedding on the first rank and output layer
on the last (both when tied and PP > 1, as Megatron).
Activations: `activations.py` per microbatch, times the microbatches the schedule keeps in flight
on that rank (`pipeline.py`); with full recompute, plus one layer's full activations during its
backward (not at the forward peak on the last rank: the loss runs before any layer is rebuilt).
Fixed terms: on the last rank, the final norm's saved tensors and one microbatch of logits
(bf16) and the fp32 softmax the vocab-parallel cross entropy keeps (`ArchTraits.loss_bytes_per_logit`: eager fp32 keeps 12 bytes per
logit), and what each further loss-stage microbatch whose backward has not run keeps (the saved
softmax and norm tensors; GPipe all m, an interleaved schedule's short last group of microbatches
several: `PipelineProfile.moments`' final count; measured, GPipe PP2's last rank 0.881 -> 1.002);
communication buffers (PP send/recv, the SP all-gather output of
one layer, EP dispatch/combine buffers, expert TP's gathered rows and their partial outputs), in use
at a layer's moments, not at the last rank's loss (measured: the last stages 1.002-1.034 when they were).
Eager autograd (`ArchTraits.weight_grad_copy`): the heads' backward on the last rank, where each
head's output-layer gradient and each MTP depth's embedding gradient wait whole in autograd's input
buffers to be summed (`_Ranks._heads_backward`; at few tokens per rank the step's peak).
Optimizer scratch: clipping and the optimizer step run after backward has freed the activations,
so their temporaries (`ArchTraits.optimizer_scratch_bytes` per element of the rank's largest tensor
stepped, a ZeRO chunk's piece under a sharded mode: `largest_main`), and the moments at the end of
backward that hold little activation (gloo's reduce-scatter copies, a tied embedding's gradients),
raise the peak only by what they exceed activations + logits + buffers by; that excess is the
"scratch" kind (0 for fused optimizers, and whenever activations dominate).
With --optimizer-cpu-offload, the offloaded share of the optimizer state (main parameters + AdamW
moments) is host memory and not counted; with --fine-grained-activation-offloading, so are the
offloaded module inputs of every microbatch in flight but the one being computed. Then a stated allocator overhead (share of all tensor
memory) and a runtime reserve (CUDA context + NCCL workspaces) that the allocator never sees.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from fivefold.config.schema import TrainingConfig
from fivefold.config.modules import OFFLOAD_MODULES
from fivefold.config.precision import DEFAULT_BUCKET_BYTES, Precision
from fivefold.planner.activations import (EAGER_TRAITS, FP8_SCALE_BYTES, ArchTraits, Sharding,
                                          backward_transient, full_recompute_transient, gathered_kv_bytes,
                                          layer_activation_bytes, weight_grad_join_bytes)
from fivefold.planner.layout import Plan
from fivefold.planner.mtp import mtp_activation_values, mtp_params
from fivefold.planner.params import embedding_params, is_moe_layer, kv_params, kv_tp_split, layer_params
from fivefold.planner.pipeline import Front, pipeline_profile

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


def state_bytes_per_param(training: TrainingConfig, precision: str, d: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter under the runtime's precision policy
    (fivefold.config.precision: the same object the runtime builds its buffers from) with
    `precision` for the parameters, the optimizer sharded over d ranks with the distributed optimizer."""
    return Precision.of(training, precision).state_bytes(_shards(training, d), training.sharding_strategy)


def _shards(training: TrainingConfig, d: int) -> int:
    """Ranks the dense domain of d is sharded over: HSDP shards within an instance of d/n ranks."""
    n = training.num_distributed_optimizer_instances
    return d // n if n > 1 and d % n == 0 else d


_PARAMS: dict[tuple, tuple | float] = {}
"""rank_params by (Plan.layer_key, rank, tp, etp, ep), and under ("linear", ...) the same key the
decoder linears' parameters (`fp8_weight_cache`), under ("units", ...) `zero3_units`: the model is
kept alive by layout._GROUPS."""


def zero2_full_buffers(plan: Plan, dense: float, expert: float, state_bytes: tuple, prec: Precision) -> float:
    """What ZeRO-2/3's gradients hold during a step (fivefold.parallel.data) beyond the 1/d accumulators
    of `state_bytes_per_param`, bytes: under PP our schedule accumulates the gradients itself, so every
    bucket keeps its full-size buffer for the step and is reduce-scattered into its own range once,
    as ZeRO-1 (no separate accumulator); reduced every microbatch (`Plan.reduce_every_microbatch`:
    without PP, or Megatron-FSDP) none at the peak: that is at the end of the forward (the logits and
    every activation live, no gradient buffer yet); during backward the activations are freed faster
    than the one or two buckets being filled / reduced grow (measured: DP2 GA2 fp32 ZeRO-2, planner /
    measured 0.999); the expert buckets likewise (reduced per MoE layer during backward).
    `state_bytes`: (weights, gradients, optimizer) bytes per dense and per expert parameter as sharded
    (`model_state`)."""
    if plan.reduce_every_microbatch:
        return 0.0
    full = prec.state_bytes(1, "no_shard")[1]
    (_, dense_grad, _), (_, expert_grad, _) = state_bytes
    return dense * (full - dense_grad) + expert * (full - expert_grad)


def backward_buckets(plan: Plan, rank: int, dense: float, prec: Precision, mode: str, expert: float = 0.0,
                     filling: bool = False) -> float:
    """ZeRO-2/3 reducing every microbatch (`Plan.reduce_every_microbatch`): full-size gradient buffers
    that exist only during backward (fivefold.parallel.data: allocated at a bucket's first gradient,
    freed once its reduce-scatter is done, which the next bucket's launch waits for): at most the
    bucket being filled and the one in flight, from the start of backward while the activations are
    all held (`filling`: the first alone). ZeRO-2's buckets hold `DEFAULT_BUCKET_BYTES` of parameters
    (the routed experts' a MoE layer's, `expert_bucket`: measured, MoE DP4 ZeRO-2 at mbs1 1.091 when it
    was the cap), ZeRO-3's one unit each (on
    the last rank the output layer's and a layer's, else two layers'), whose weights are then whole
    too (gathered again for the backward, the next one prefetched; at the loss, after the output
    layer's forward freed it, none is: measured, DP2 mbs2 GA2 ZeRO-3 1.036 when it was counted there)."""
    if not plan.reduce_every_microbatch or mode not in ("optim_grads", "optim_grads_params"):
        return 0.0
    weight, grad, _ = prec.state_bytes(1, "no_shard")
    if mode == "optim_grads":  # per domain (the routed experts' reducer is another) sharded over more than
        # one rank: over one, the runtime keeps whole buffers for the step, as ZeRO-1 (`model_state` counts them)
        domains = ((dense, DEFAULT_BUCKET_BYTES / weight, _shards(plan.config.training, plan.dp * plan.cp)),
                   (expert, expert_bucket(plan, rank, weight), plan.edp))
        return sum(min((1 if filling else 2) * bucket, n) * grad for n, bucket, d in domains if d > 1)
    layer = max(sum(_layer_share(plan, i)) for i, _, _ in plan.layer_groups(rank))
    return min(zero3_gathered(plan, rank, dense) + layer, dense) * (weight + grad)


def expert_bucket(plan: Plan, rank: int, weight_bytes: float) -> float:
    """Elements of a gradient bucket of the routed experts' reducer on pipeline rank `rank`: without
    PP a MoE layer's experts, reduced as soon as backward has passed the layer
    (fivefold.parallel.data_parallel), else `DEFAULT_BUCKET_BYTES` of `weight_bytes` parameters."""
    return zero3_units(plan, rank)[2] if plan.pp == 1 else DEFAULT_BUCKET_BYTES / weight_bytes


def model_state(plan: Plan, rank: int, dense: float, expert: float, state_bytes: tuple, prec: Precision,
                mode: str) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of pipeline rank `rank`, holding `dense` and `expert`
    parameters (`state_bytes`: per dense and per expert parameter): the optimizer's offloaded share is
    host memory; ZeRO-2/3 under PP add their whole gradient buffers, ZeRO-3 there its units whole
    (reducing every microbatch, what is whole only while in use is `backward_buckets`)."""
    (wd, gd, od), (we, ge, oe) = state_bytes
    weights, grads, optimizer = dense * wd + expert * we, dense * gd + expert * ge, dense * od + expert * oe
    optimizer *= 1 - prec.offload_fraction  # --optimizer-cpu-offload
    if mode in ("optim_grads", "optim_grads_params"):
        grads += zero2_full_buffers(plan, dense, expert, state_bytes, prec)
    weights += whole_for_step(plan, rank, dense + expert, prec, mode)
    return weights, grads, optimizer


def whole_for_step(plan: Plan, rank: int, held: float, prec: Precision, mode: str) -> float:
    """Bytes of ZeRO-3's units whole from their first forward to the end of a pipelined step's
    reduction (fivefold.parallel.fsdp), of the `held` parameters of pipeline rank `rank`; 0 otherwise."""
    if mode != "optim_grads_params" or plan.reduce_every_microbatch:
        return 0.0
    return zero3_gathered(plan, rank, held) * prec.state_bytes(1, "no_shard")[0]


def root_params(plan: Plan, rank: int) -> float:
    """Parameters FSDP2 keeps whole through a microbatch on pipeline rank `rank`
    (`ArchTraits.fsdp_root_whole`): the root unit (the embedding on the first rank, the final norm and
    untied output layer on the last) and, on the last rank, the last decoder layer."""
    m = plan.config.model
    emb = embedding_params(m, plan.tp) / plan.tp
    first, last = rank == plan.first_rank, rank == plan.last_rank
    *_, (i, _, _) = plan.layer_groups(rank)
    tail = m.hidden_size + (0 if m.tie_word_embeddings and first else emb) + sum(_layer_share(plan, i))
    return emb * first + tail * last


def zero3_gathered(plan: Plan, rank: int, held: float) -> float:
    """ZeRO-3's whole parameters at the peak (fivefold.parallel.fsdp), elements, of the `held` pipeline
    rank `rank` holds: gathered for every microbatch (`Plan.reduce_every_microbatch`), at the end of
    the forward the last unit is in use and nothing is prefetched after it: on the last rank the output
    layer's (the output layer or, tied, the embedding it shares, and the final norm), on another its
    largest layer; under our PP schedules every unit stays whole from its first forward to the step's end."""
    if not plan.reduce_every_microbatch:
        return held
    if rank == plan.last_rank:
        m = plan.config.model
        return embedding_params(m, plan.tp) / plan.tp + m.hidden_size
    return max(sum(_layer_share(plan, i)) for i, _, _ in plan.layer_groups(rank))


def rank_params(plan: Plan, rank: int) -> tuple[float, float]:
    """(dense, expert) parameters held by one rank of pipeline rank `rank` (padded vocabulary)."""
    key = (plan.layer_key, rank, plan.tp, plan.etp, plan.ep)
    got = _PARAMS.get(key)
    if got is None:
        got = _PARAMS[key] = _rank_params(plan, rank)
    return got


def _rank_params(plan: Plan, rank: int) -> tuple[float, float]:
    m = plan.config.model
    dense = expert = 0.0
    for i, _, n in plan.layer_groups(rank):
        d, e = _layer_share(plan, i)
        dense, expert = dense + d * n, expert + e * n
    emb = embedding_params(m, plan.tp) / plan.tp
    if rank == plan.first_rank:
        dense += emb
    if rank == plan.last_rank:
        apart = plan.first_rank != plan.last_rank  # the embedding on another rank (not so under DualPipeV)
        dense += m.hidden_size + (0 if (m.tie_word_embeddings and not apart) else emb)
        dense += mtp_params(m, plan.tp, apart, emb)
    return dense, expert


def _layer_share(plan: Plan, i: int) -> tuple[float, float]:
    """(dense, expert) parameters of layer `i` on one rank."""
    m = plan.config.model
    lp, kv = layer_params(m, i), kv_params(m)  # whole KV heads per rank when TP > KV heads
    dense = (lp.attention - kv + lp.dense_mlp) / plan.tp + kv / kv_tp_split(m, plan.tp) + lp.latent + lp.norms
    return dense, lp.experts / (plan.etp * plan.ep)


def fp8_weight_cache(plan: Plan, rank: int) -> float:
    """Bytes of the fp8 weight copies the decoder linears of pipeline rank `rank` keep over a step
    (`ArchTraits.fp8_weight_cache`): 2 per element of their weights (norms, embeddings and the output
    layer stay 16-bit), 1 with fp8 primary weights; with MXFP8 each copy carries its scales."""
    key = ("linear", plan.layer_key, rank, plan.tp, plan.etp, plan.ep)
    linear = _PARAMS.get(key)
    if linear is None:  # a search meets each rank's layers under many variants
        m = plan.config.model
        linear = _PARAMS[key] = sum((dense - layer_params(m, i).norms + expert) * n
                                    for i, _, n in plan.layer_groups(rank)
                                    for dense, expert in [_layer_share(plan, i)])
    t = plan.config.training
    per_copy = 1 + (FP8_SCALE_BYTES["mxfp8"] if t.fp8_recipe == "mxfp8" else 0.0)  # MXFP8 scales both copies
    return linear * per_copy * (1 if t.fp8_param_gather else 2)


def optimizer_phase(plan: Plan, dense: float, expert: float, largest: tuple[float, float], traits: ArchTraits,
                    prec: Precision | None = None, released: float = 0.0,
                    units: tuple[float, float] = (0.0, 0.0)) -> float:
    """Bytes allocated after backward, on top of the model state: while AdamW steps, its eager
    temporaries (`largest_main`: `optimizer_scratch_bytes` per element of the largest tensor counted in
    the gradient norm, `step_scratch_bytes` of the largest of all) and, with 16-bit
    gradients, the fp32 copies of the main gradients (`Precision.main_grad_copy_bytes`); then ZeRO-1/2's
    all-gathers of the updated parameters, at most two buckets' full outputs at once
    (fivefold.parallel.distributed_optimizer). The larger phase counts. `released`: model-state bytes
    freed once the gradients are reduced, before the step (ZeRO-3's units whole for a pipelined step:
    measured, bf16 PP2 ZeRO-3, the norm's scratch on the shards alone, 64.16 MiB for 64.16). `units`:
    ZeRO-3's largest unit of each domain (dense, expert), elements (`reduce_scatter_copies`)."""
    training = plan.config.training
    prec, mode = prec or Precision.of(training, plan.precision), training.sharding_strategy
    copies = (dense * prec.main_grad_copy_bytes(plan.dp * plan.cp, mode)
              + expert * prec.main_grad_copy_bytes(plan.edp, mode))
    counted, stepped = largest
    stepping = max(traits.optimizer_scratch_bytes * counted, traits.step_scratch_bytes * stepped) + copies - released
    gathering = after_step_gathers(plan, dense, expert, prec) if mode in ("optim", "optim_grads") else 0.0
    reducing = 0.0
    if traits.reduce_scatter_copy and mode != "no_shard":
        reducing = reduce_scatter_copies(plan, dense, expert, prec, units)
    return max(stepping, gathering, reducing)


def reduce_scatter_copies(plan: Plan, dense: float, expert: float, prec: Precision,
                          units: tuple[float, float] = (0.0, 0.0)) -> float:
    """Bytes the reduce-scatters of whole gradient buffers hold where the backend reduces a copy
    (`ArchTraits.reduce_scatter_copy`), per domain sharded over more than one rank. ZeRO-1 (and
    ZeRO-2 / 3 under PP) reduce once, after backward: every bucket's 1/d output chunk waits for the
    step while one copy (at most a bucket's) is reduced at a time (measured, gloo: one bucket 20.3 MiB
    + its chunk 10.1; two of 24.5 and 16 MiB: 24.5 + 20.3 of chunks), the domains one after the
    other (measured, PP2 x DP2 bf16 ZeRO-2 with MoE: 1.066 when both copies counted). ZeRO-2 / 3 reducing every
    microbatch: at the end of backward a bucket (ZeRO-3: a unit, at most `units`) is whole beside its
    copy and its output chunk while the next one, complete, waits for it to launch (measured, fp32
    DP2 ZeRO-2 with full recompute at mbs1: buckets of 24.5 and 16 MiB, 24.5 + 24.5 + 12.25 + 16 over
    the model state at the peak; TP2 x DP2: one bucket of 19.3 MiB, 48.2)."""
    weight, grad, _ = prec.state_bytes(1, "no_shard")
    held = copy = 0.0
    for n, d, unit in ((dense, plan.dp * plan.cp, units[0]), (expert, plan.edp, units[1])):
        if not n or d <= 1:
            continue
        bucket = min(unit or DEFAULT_BUCKET_BYTES / weight, n)
        if plan.reduce_every_microbatch:
            held += (2 * bucket + bucket / d + min(bucket, n - bucket)) * grad
        else:  # the domains one after the other: the larger copy
            held, copy = held + n / d * grad, max(copy, bucket * grad)
    return held + copy


def after_step_gathers(plan: Plan, dense: float, expert: float, prec: Precision) -> float:
    """Bytes ZeRO-1/2's all-gathers of the updated parameters hold after the step: at most two
    buckets' full outputs at once, per domain (dense, expert) sharded over more than one rank."""
    weight = prec.state_bytes(1, "no_shard")[0]
    return sum(min(2 * DEFAULT_BUCKET_BYTES, n * weight) for n, d in ((dense, plan.dp * plan.cp), (expert, plan.edp))
               if n and d > 1)


def largest_main(plan: Plan, rank: int, weight_bytes: float) -> tuple[float, float]:
    """Elements of the largest tensor the optimizer steps on the busiest rank of pipeline rank `rank`,
    of those counted in the gradient norm and of all (a tied output layer's copy on the last stage
    of a pipeline is left out of the norm: fivefold.parallel.data_parallel's `not_counted`)
    (what the eager gradient norm's and AdamW's temporaries are sized by): the largest parameter (an
    embedding / output-layer shard where the rank holds one, else the widest linear shard of its
    layers), or under a sharded DP mode the largest piece of one that a rank's chunk holds
    (fivefold.parallel.distributed_optimizer): ZeRO-1/2 cut each gradient bucket (`DEFAULT_BUCKET_BYTES`
    of `weight_bytes` parameters) in d chunks, ZeRO-3 each unit (a layer, the embedding, the final
    norm with the output layer). Measured, bf16 ZeRO-3 DP x CP 2: the embedding's half, not all of it.
    Which rank's chunk holds a piece that large depends on where the boundaries fall; the others'
    are smaller (their peak can be another moment)."""
    m = plan.config.model
    mode, d = plan.config.training.sharding_strategy, plan.dp * plan.cp
    dense, expert = rank_params(plan, rank)
    layer, end, expert_layer = zero3_units(plan, rank)
    # (elements, the ZeRO-3 unit holding them, the parameters of their domain, its shards, in the norm)
    candidates = [(max(m.ffn_size, m.num_attention_heads * m.head_dim) * m.hidden_size / plan.tp, layer, dense, d,
                   True)]
    if m.is_moe:
        candidates.append(((m.moe_ffn_hidden_size or m.ffn_size) * m.hidden_size / plan.etp, expert_layer, expert,
                           plan.edp, True))
    if end:  # a tied output layer's copy on the last stage of a pipeline is left out of the norm
        copy = m.tie_word_embeddings and plan.pp > 1 and rank == plan.last_rank
        candidates.append((embedding_params(m, plan.tp) / plan.tp, end, dense, d, not copy))
    counted = stepped = 0.0
    for n, unit, domain, shards, in_norm in candidates:
        if mode != "no_shard" and shards > 1:
            chunked = unit if mode == "optim_grads_params" else min(DEFAULT_BUCKET_BYTES / weight_bytes, domain)
            n = min(n, math.ceil(chunked / shards))
        stepped = max(stepped, n)
        counted = max(counted, n) if in_norm else counted
    return counted, stepped


def zero3_units(plan: Plan, rank: int) -> tuple[float, float, float]:
    """Elements of ZeRO-3's largest units on pipeline rank `rank` (fivefold.parallel.fsdp): a decoder
    layer's dense parameters; the embedding on the first rank, the final norm with the output layer on
    the last (the larger where both; 0 elsewhere); a MoE layer's routed experts. Cached as
    `rank_params` (a rank's memory reads them up to four times)."""
    key = ("units", plan.layer_key, rank, plan.tp, plan.etp, plan.ep)
    got = _PARAMS.get(key)
    if got is None:
        got = _PARAMS[key] = _zero3_units(plan, rank)
    return got


def _zero3_units(plan: Plan, rank: int) -> tuple[float, float, float]:
    m = plan.config.model
    shares = [_layer_share(plan, i) for i, _, _ in plan.layer_groups(rank)] or [(0.0, 0.0)]
    layer, expert_layer = (max(share) for share in zip(*shares))
    emb = embedding_params(m, plan.tp) / plan.tp
    end = emb + m.hidden_size if rank == plan.last_rank else emb if rank == plan.first_rank else 0.0
    return layer, end, expert_layer


def memory_per_rank(plan: Plan, assume: MemoryAssumptions = MemoryAssumptions()) -> list[RankMemory]:
    ranks = _Ranks(plan, assume)
    return [ranks.memory(r) for r in range(plan.pp)]


class _Ranks:
    """What every pipeline rank of one plan shares; `memory(r)` sizes rank r."""

    def __init__(self, plan: Plan, assume: MemoryAssumptions):
        self.plan = plan
        self.sh = Sharding.of(tp=plan.tp, sp=plan.sp, cp=plan.cp, etp=plan.etp, recompute=plan.recompute,
                           modules=plan.recompute_modules)
        # under full recompute a zero-bubble B is the whole backward (fivefold.pipeline.executor): its
        # microbatch's activations are freed there, not at its W
        self.prof = pipeline_profile(plan.schedule, plan.pp, plan.vpp, plan.microbatches, plan.group,
                                     plan.recompute == "full")
        traits = _for_precision(assume.traits, plan.precision, plan.config.training.fp8_recipe)
        self.assume = MemoryAssumptions(allocator_overhead=assume.allocator_overhead,
                                        runtime_reserve=assume.runtime_reserve, traits=traits)
        # ranks of the same shape (layers by kind, ends) hold the same per-microbatch state
        self.shapes = plan.rank_shapes
        training = plan.config.training  # bytes per dense / expert parameter: the same on every rank
        self.state_bytes = (state_bytes_per_param(training, plan.precision, plan.dp * plan.cp),
                            state_bytes_per_param(training, plan.precision, plan.edp))
        self.prec = Precision.of(training, plan.precision)
        self.mode = training.sharding_strategy
        self.states: dict[int, _RankState] = plan.cached(
            ("rank states", plan.tp, plan.etp, plan.ep, plan.dp, plan.cp, plan.edp, plan.instances,
             plan.reduce_every_microbatch, plan.precision, self.prec, self.mode, traits, training.fp8_recipe,
             training.fp8_param_gather), dict)
        """Rank -> `state(rank)`, shared by the plans of this split with the same state key."""
        self._fixed()

    def _fixed(self) -> None:
        """The terms that do not depend on the rank: communication buffers; on the last rank the logits
        and the loss (and their W-pending gradient under zero-bubble schedules)."""
        plan, traits = self.plan, self.assume.traits
        m, B = plan.config.model, traits.value_bytes()
        tokens = plan.mbs * plan.seq / plan.cp
        sp_div = plan.tp if plan.sp else 1
        heads = 1 + (m.mtp_num_layers or 0)  # MTP: another output layer per depth (planner/mtp.py)
        vocab = m.padded_vocab_size(plan.tp) / plan.tp
        self.head_params = vocab * m.hidden_size
        """The output layer's elements on one rank of the last pipeline rank (or, tied, the embedding's)."""
        # the logits and the loss's fp32 softmax (see ArchTraits.loss_bytes_per_logit), the final norm's
        # saved tensors (its input, the output layer's input; + x/rms(x) unfused), MTP's
        held = traits.loss_bytes() - traits.loss_transient_bytes  # what each head keeps until its backward
        logit_held, norm_held = tokens * vocab * held, traits.norm_tensors * tokens * m.hidden_size * B / sp_div
        side = mtp_activation_values(m) * tokens * B / sp_div
        self.loss_state = heads * (logit_held + norm_held) + side
        """What a microbatch keeps on the last rank from its loss-stage forward to its backward."""
        transient = traits.loss_transient_bytes
        if plan.tp > 1 and traits.tp_loss_transient_bytes is not None:
            transient = traits.tp_loss_transient_bytes
        elif plan.tp > 1 and traits.vocab_parallel_keeps_logits and B < 4:
            transient += B  # the 16-bit logits beside their fp32 copy (ArchTraits.vocab_parallel_keeps_logits)
        self.logits = self.loss_state + tokens * vocab * transient
        # the logits' gradient, the output layer's join and the loss's saved fp32 log-softmax, kept with
        # the graph until W (zero-bubble schedules); the vocab-parallel loss (TP) turns its saved fp32
        # softmax into the gradient in place, so in fp32 they are one tensor (measured, ZB-H1 x TP2 at
        # mbs2: 1.09 of the last stage when counted twice); each MTP depth's head again, and where its
        # branches meet the input path: eh_proj's input (the concatenation) and output, the hnorm and
        # final-norm gain products (measured, PP2 ZB-H1 MTP1 at mbs2: 0.796 without them)
        self.logit_joins = heads * tokens * vocab * (4 if plan.tp > 1 and B >= 4 else B + 4)
        self.logit_joins += (heads - 1) * tokens * m.hidden_size * B * (4 / sp_div + 1 / plan.tp)
        buffers = tokens * m.hidden_size * B * (4 / sp_div if plan.pp > 1 else 0)  # PP send/recv, fwd + bwd
        if plan.tp > 1:
            buffers += tokens * m.hidden_size * B  # one gathered (SP) or reduced (TP) layer input
        if m.is_moe and (plan.ep > 1 or plan.etp > 1):  # dispatch + combine (expert TP: gathered, reduced)
            buffers += 2 * m.moe_router_topk * tokens / plan.tp * plan.etp * m.hidden_size * B
        self.buffers = buffers
        # a head's loss differentiated: F.cross_entropy's two fp32 gradients; the vocab-parallel loss (TP)
        # turns its saved softmax into the gradient in place, cast to a 16-bit run's dtype
        differentiated = (B if B < 4 else 0) if plan.tp > 1 else traits.loss_transient_bytes
        self.heads_backward, self.waiting = self._heads_backward(logit_held, norm_held, side,
                                                                 tokens * vocab * differentiated)

    def _heads_backward(self, logit_held: float, norm_held: float, side: float, differentiated: float
                        ) -> tuple[float, float]:
        """(beyond the held layers but one MTP layer and one gradient bucket: the most the heads'
        backward holds, the elements of the gradient held through the decoder's backward) on the
        last rank, where a backward makes the weight gradients (eager, not zero-bubble: its W makes them,
        `w_start`). Each head makes the output layer's gradient whole, each MTP depth's lookup the
        embedding's, and autograd holds a parameter's gradient in its input buffer until its last use
        there is differentiated, summing out of place (buffer, new, sum: 3 at once). The heads run from
        the last depth down to the main one, each depth's lookup after its head. Two moments: a sum
        (tied, one parameter, also the last stage's embedding copy under PP: the last depth's lookup,
        every other head's loss not yet differentiated; untied: the next head's, beside the
        embedding's buffer while a lookup is still to come: the main one without PP, a shallower
        depth's) and the next head's loss differentiated (`differentiated` a head's transient bytes)
        beside the buffers. Without PP the embedding's lookup comes last, so with a tied output layer or
        MTP one gradient waits through the decoder's backward. Measured (PP1 seq64 mbs1, 8192 x 256 fp32:
        8 MiB each): MTP1 4 at a sum, tied 3 (the main loss's log-softmax beside it), MTP2 4 (one beside
        it), tied 3 (two); the next loss's moment: all-gather CP2 x DP2 ZeRO-2 bf16 MTP1 tied (0.907 when
        neither was counted)."""
        plan, traits, m = self.plan, self.assume.traits, self.plan.config.model
        if not traits.weight_grad_copy or self.prof.pending_weight_chunks[plan.last_rank]:
            return 0.0, 0.0
        depths, tied = m.mtp_num_layers or 0, m.tie_word_embeddings
        params = self.head_params
        grad = params * traits.value_bytes()
        # (ZeRO-3 reducing every microbatch counts the output layer's unit's gradient in its buckets)
        zero3 = self.mode == "optim_grads_params" and plan.reduce_every_microbatch
        waiting = params if plan.pp == 1 and (tied or depths) and not zero3 else 0.0
        if not depths:
            return 0.0, waiting
        lookup = not tied and (plan.pp == 1 or depths > 1)  # the embedding's buffer beside the heads'
        states = (depths - 1) * (logit_held + side / depths) + depths * norm_held
        summed = (logit_held + norm_held) * tied + (3 + lookup) * grad
        next_loss = logit_held + differentiated + (1 + lookup) * grad
        return states + max(summed, next_loss), waiting

    def sized(self) -> list[RankMemory]:
        """Every rank that can hold the most, sized, in rank order. A rank is left out when an earlier
        rank of its shape holds at least as many microbatches in flight and pending W at every moment
        (`coverers`): every term of the total is then no larger, also after float rounding. The
        optimizer's scratch is the exception: it shrinks as activations grow, so a rank under such
        traits is left out only where its coverer's activations exceed its optimizer step's peak by
        more than any rounding (`STEP_MARGIN`): the left-out rank's total, its activations' or its
        step's peak beside the same model state, is then below the coverer's."""
        scratch = self.assume.traits.optimizer_scratch_bytes
        out: list[RankMemory] = []
        sized: dict[int, RankMemory] = {}
        above: dict[int, bool] = {}  # coverer -> `_above_step` (a coverer covers many ranks)
        for r, by in enumerate(self.coverers()):
            if by is not None:
                if not scratch:
                    continue
                if by not in above:
                    above[by] = self._above_step(sized[by])
                if above[by]:
                    continue
            sized[r] = self.memory(r)
            out.append(sized[r])
        return out

    def _above_step(self, rm: RankMemory) -> bool:
        """Whether rank `rm.rank`'s activations exceed its optimizer step's peak by `STEP_MARGIN`."""
        held = rm.activations + rm.logits + rm.buffers
        return held - self.state(rm.rank).step_peak > STEP_MARGIN * rm.total

    def coverers(self) -> tuple[int | None, ...]:
        """Per rank, None where it can hold the most, else the earlier rank of its shape whose moments
        cover its own: every moment of this rank is matched or exceeded, in every count, by one of that
        rank's."""
        return self.plan.cached(("peak coverers", self.plan.microbatches), self._coverers)

    def _coverers(self) -> tuple[int | None, ...]:
        prof, out, best = self.prof, [], {}
        for r, shape in enumerate(self.shapes):
            moments = prof.moments[r]
            earlier = best.setdefault(shape, [])
            out.append(next((e for e, other in earlier if all(_covers(o, m) for o, m in zip(other, moments))), None))
            if out[-1] is None:
                earlier.append((r, moments))
        return tuple(out)

    def memory(self, r: int) -> RankMemory:
        plan, prof, assume = self.plan, self.prof, self.assume
        traits = assume.traits
        rm = RankMemory(rank=r)
        detail, per_mb, transient, joins, bwd, offloaded, last = _layers(plan, self.shapes[r][0], r, self.sh, traits,
                                                                          plan.cp_gathers_kv, prof.defers_weights)
        state = self.state(r)
        dense, expert = state.dense, state.expert
        rm.params, rm.weights, rm.grads, rm.optimizer = dense + expert, state.weights, state.grads, state.optimizer
        rm.detail = detail  # shared with the cache: read only
        rm.inflight = prof.inflight_microbatches(r)
        if r == plan.last_rank:
            rm.logits = self.logits
            joins += self.logit_joins
        w_start = 0.0  # what a W holds beyond the pending joins as it starts (none pend under full
        # recompute: the profile's B is then the whole backward)
        if traits.weight_grad_copy and r == plan.last_rank and prof.pending_weight_chunks[r]:
            # a zero-bubble W on the last rank starts with the output layer's weight gradient, beside
            # every pending join (measured, ZB-H1 x all-gather CP2 at mbs1: 0.939 without); with MTP
            # one per head, and one per depth of the embedding copy it embeds with, summed in one call
            # (measured, PP2 ZB-H1 MTP1: 3 of them)
            uses = 1 + 2 * (plan.config.model.mtp_num_layers or 0)
            w_start = uses * self.head_params * traits.value_bytes()
        # the peak is at a forward (the last rank's logits) or in a layer's backward (with the layer a
        # recompute rebuilt), each moment with the activations held and the zero-bubble schedules'
        # B-done-W-pending gradients (`PipelineProfile.moments`, in chunks); offloaded inputs stay
        # on the device only for the microbatch being computed
        forward, backward = prof.moments[r]
        at_forward = _held(forward, prof.vpp, per_mb, offloaded, joins, self.loss_state, 1)
        in_backward = held = _held(backward, prof.vpp, per_mb, offloaded, joins, self.loss_state, 0)
        heads = held - last + self.heads_backward if r == plan.last_rank and self.heads_backward else 0.0
        waiting = self.waiting if r == plan.last_rank else 0.0
        if self.mode in ("optim_grads", "optim_grads_params"):  # (a call the search's ZeRO-1 layouts skip)
            # the waiting gradient's parameter, the first, is in the last bucket: not filled before
            # it unless that is the only one (measured, DP2 ZeRO-2 tied: 1.056 when counted in both)
            apart = waiting if dense * self.prec.state_bytes(1, "no_shard")[0] > DEFAULT_BUCKET_BYTES else 0.0
            in_backward += backward_buckets(plan, r, dense - apart, self.prec, self.mode, expert)
            if heads:  # MTP's layer made the first bucket's gradients, none is in flight yet
                heads += backward_buckets(plan, r, dense - apart, self.prec, self.mode, expert, filling=True)
        head = 0.0
        if r == plan.last_rank and self.mode == "optim_grads_params" and plan.reduce_every_microbatch:
            # the output layer's backward, the loss's tensors freed: its unit gathered again, its weight
            # gradient computed beside the bucket it is added into, the next unit prefetched (measured,
            # all-gather CP2 x DP2 fp32 ZeRO-3 at mbs1: the peak, 0.935 when it was not counted)
            layer, end, _ = zero3_units(plan, r)
            weight, grad, _ = self.prec.state_bytes(1, "no_shard")
            gathered = 0.0 if traits.fsdp_root_whole else end + layer  # FSDP2's root and last layer: whole already
            head = at_forward + end * 2 * grad + gathered * weight
        # each moment with the communication buffers in use then: none at the loss on the last rank
        # (measured: the last stages of the PP rows were 1.002-1.034 with a layer's buffers counted there)
        at_loss = max(at_forward + rm.logits, heads)  # the heads' backward: a moment without buffers too
        in_layer = max(head, in_backward + bwd + transient + waiting * traits.value_bytes(), in_backward + w_start)
        rm.buffers = self.buffers
        if r == plan.last_rank and at_loss > in_layer + rm.buffers:
            rm.buffers, in_layer = 0.0, at_loss
        rm.activations = max(at_loss, in_layer) - rm.logits
        rm.scratch = max(0.0, state.step_peak - (rm.activations + rm.logits + rm.buffers))
        tensors = rm.weights + rm.grads + rm.optimizer + rm.activations + rm.logits + rm.buffers + rm.scratch
        rm.overhead = assume.allocator_overhead * tensors
        rm.reserve = assume.runtime_reserve
        return rm

    def state(self, r: int) -> "_RankState":
        """Rank r's model state and optimizer step, kept with the layer split (`Plan.cached`) under
        everything else they read, by rank: the search sizes each rank under several micro-batches,
        recompute modes and CP exchanges of one layout, and one split under many layouts."""
        got = self.states.get(r)
        if got is None:
            got = self.states[r] = self._state(r)
        return got

    def _state(self, r: int) -> "_RankState":
        plan, traits = self.plan, self.assume.traits
        dense, expert = rank_params(plan, r)
        weights, grads, optimizer = model_state(plan, r, dense, expert, self.state_bytes, self.prec, self.mode)
        if traits.fp8_weight_cache and plan.precision == "fp8":
            weights += fp8_weight_cache(plan, r)
        if traits.fsdp_root_whole and self.mode == "optim_grads_params" and plan.reduce_every_microbatch:
            weights += root_params(plan, r) * self.prec.state_bytes(1, "no_shard")[0]
        largest = (largest_main(plan, r, self.prec.state_bytes(1, "no_shard")[0])
                   if traits.optimizer_scratch_bytes else (0.0, 0.0))  # read only with scratch
        released = whole_for_step(plan, r, dense + expert, self.prec, self.mode)
        units = (0.0, 0.0)
        if traits.reduce_scatter_copy and self.mode != "no_shard":  # the buckets: ZeRO-3's units, the experts'
            layer, end, _ = zero3_units(plan, r)
            units = (max(layer, end) if self.mode == "optim_grads_params" else 0.0,
                     expert_bucket(plan, r, self.prec.state_bytes(1, "no_shard")[0]))
        phase = optimizer_phase(plan, dense, expert, largest, traits, self.prec, released, units)
        return _RankState(dense, expert, weights, grads, optimizer, max(phase, self.tied_embedding_backward(r)))

    def tied_embedding_backward(self, r: int) -> float:
        """Bytes beyond the model state at the embedding's backward, the end of backward on a rank
        whose tied embedding is also its output layer (without PP: one parameter): autograd adds the output
        layer's weight gradient, held since the start of backward, to the embedding's before either
        reaches the parameter, all three whole; ZeRO-3 reducing every microbatch has the unit gathered
        again and the last layer's bucket in flight (measured, CP2 x DP2 fp32 ZeRO-3 with full
        recompute at mbs1: the peak, 0.886 when it was not counted)."""
        plan, m = self.plan, self.plan.config.model
        if not (m.tie_word_embeddings and plan.pp == 1):
            return 0.0
        weight, grad, _ = self.prec.state_bytes(1, "no_shard")
        held = 3 * self.head_params * weight
        if self.mode == "optim_grads_params" and plan.reduce_every_microbatch:
            layer, end, _ = zero3_units(plan, r)
            held += end * weight + layer * grad * (1 + 1 / (plan.dp * plan.cp))
        return held


class _RankState(NamedTuple):
    """What a pipeline rank holds whatever its activations (`_Ranks.state`): its dense and expert
    parameters, their weights', gradients' and optimizer's bytes, and the most its optimizer step holds
    beyond them (the step's temporaries or gathers, or a tied embedding's backward)."""
    dense: float
    expert: float
    weights: float
    grads: float
    optimizer: float
    step_peak: float


def _held(front: Front, v: int, per_mb: float, offloaded: float, joins: float, loss_state: float,
          counted: int) -> float:
    """The most a moment of `front` holds, its (held, pending, final) counts (chunks, `v` a
    microbatch): the held activations, less the offloaded inputs of all but one microbatch, plus the
    pending ones' gradients and the loss state of the loss-stage microbatches held beyond the
    `counted` ones the rank's logits term has (the running forward's)."""
    best = None
    for h, p, f in front:
        x = h / v
        held = per_mb * x + joins * p / v + loss_state * max(0, f - counted)
        if offloaded and x > 1:
            held -= offloaded * (x - 1)
        if best is None or held > best:
            best = held
    return best


def _covers(a: Front, b: Front) -> bool:
    """Every moment of `b` is matched or exceeded, in every count, by one of `a`."""
    return all(any(h >= x and p >= y and f >= z for h, p, f in a) for x, y, z in b)


@lru_cache(maxsize=64)
def _for_precision(traits: ArchTraits, precision: str, recipe: str) -> ArchTraits:
    return traits.for_precision(precision, recipe)


_LAYERS: dict[tuple, tuple] = {}
"""Per-microbatch layer state of a rank shape, by what it depends on (the model by identity, kept
alive beside its id): the search sizes the same shapes under many layouts."""


def _layers(plan: Plan, kinds: tuple, r: int, sh: Sharding, traits: ArchTraits, gathers: bool, deferred: bool):
    """(activation bytes by tensor, per-microbatch total, recompute transient, W-pending join bytes,
    backward transient, offloaded bytes, one layer of the last group's bytes) of rank r's layers, whose
    kinds are `kinds` ((MoE?, recomputed?, count), ...); `gathers`: all-gather CP (its gathered K/V a
    backward temporary); `deferred`: the schedule defers W (else no join waits: 0)."""
    m, b, s = plan.config.model, plan.mbs, plan.seq
    key = (id(m), kinds, b, s, sh, traits, plan.offload_modules, gathers, deferred)
    got = _LAYERS.get(key)
    if got is not None and got[0] is m:
        return got[1]
    detail: dict[str, float] = {}
    per_mb, transient, joins, bwd, offloaded, last = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    offload = [OFFLOAD_MODULES[name] for name in plan.offload_modules]
    for i, recomputed, n in plan.layer_groups(r):
        saved, total, peak, join, held = _layer_kind(plan, i, recomputed, sh, traits, gathers, deferred)
        for k, v in saved.items():
            detail[k] = detail.get(k, 0.0) + v * n
            per_mb += v * n
        last = total
        offloaded += sum(saved.get(key, 0.0) for key in offload) * n
        transient = max(transient, peak)
        joins += join * n
        bwd = max(bwd, held)
    out = (detail, per_mb, transient, joins, bwd, offloaded, last)
    _LAYERS[key] = (m, out)
    return out


_KINDS: dict[tuple, tuple] = {}
"""One layer's terms of `_layers` by what they depend on (its kind, not its index: layers of a kind
hold the same, as `_LAYERS`' keys assume; the model kept alive beside its id): the same kinds recur
on many ranks and splits."""


def _layer_kind(plan: Plan, i: int, recomputed: bool, sh: Sharding, traits: ArchTraits, gathers: bool,
                deferred: bool) -> tuple:
    """(activation bytes by tensor, their total, recompute transient, W-pending join bytes, backward
    transient) of layer `i` (`_layers`' arguments)."""
    m, b, s = plan.config.model, plan.mbs, plan.seq
    left = not recomputed and plan.recompute == "full"  # a layer full recompute leaves alone (MTP's)
    key = (id(m), is_moe_layer(m, i), recomputed, left, b, s, sh, traits, gathers, deferred)
    got = _KINDS.get(key)
    if got is not None and got[0] is m:
        return got[1]
    layer_sh = Sharding.of(tp=sh.tp, sp=sh.sp, cp=sh.cp, etp=sh.etp, recompute=None) if left else sh
    saved = layer_activation_bytes(m, i, b, s, layer_sh, traits)
    reruns = recomputed or (sh.recompute == "selective" and traits.op_level_sac)  # the layer's backward rebuilds it
    peak = full_recompute_transient(m, i, b, s, sh, traits) if reruns else 0.0
    join = weight_grad_join_bytes(m, i, b, s, sh, traits) if deferred else 0.0
    held = max(backward_transient(m, i, b, s, sh, traits), gathered_kv_bytes(m, b, s, sh, traits) if gathers else 0.0)
    out = (saved, sum(saved.values()), peak, join, held)
    _KINDS[key] = (m, out)
    return out


def peak_memory(plan: Plan, assume: MemoryAssumptions = MemoryAssumptions()) -> RankMemory:
    """The pipeline rank with the largest total (the first such rank, as max over `memory_per_rank`).
    The CP exchange is read only as whether it gathers K and V (`Plan.cp_gathers_kv`): a layout's p2p
    and a2a twins hold the same, and the search sizes one for both (`search.cp_twin`;
    tests/test_planner_search.py: the search equals the exhaustive one, which sizes each)."""
    return max(_Ranks(plan, assume).sized(), key=lambda r: r.total)
