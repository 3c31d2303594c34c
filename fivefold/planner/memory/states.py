"""Model state per pipeline rank: the parameters it holds and the bytes of their weights, gradients and
optimizer state, ZeRO-2/3's whole buffers and gathered units, the optimizer step's moments.

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
"""
from __future__ import annotations

import math

from fivefold.config.schema import TrainingConfig
from fivefold.config.precision import DEFAULT_BUCKET_BYTES, Precision
from fivefold.planner.memory.traits import FP8_SCALE_BYTES, ArchTraits
from fivefold.planner.layout import Plan
from fivefold.planner.memory.mtp import mtp_params
from fivefold.planner.memory.params import embedding_params, kv_params, kv_tp_split, layer_params


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
    """What ZeRO-2/3's gradients hold during a step (fivefold.parallel.data.reducer) beyond the 1/d accumulators
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
    that exist only during backward (fivefold.parallel.data.reducer: allocated at a bucket's first gradient,
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
    (fivefold.parallel.data.data_parallel), else `DEFAULT_BUCKET_BYTES` of `weight_bytes` parameters."""
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
    reduction (fivefold.parallel.data.fsdp), of the `held` parameters of pipeline rank `rank`; 0 otherwise."""
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
    """ZeRO-3's whole parameters at the peak (fivefold.parallel.data.fsdp), elements, of the `held` pipeline
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
    (fivefold.parallel.data.distributed_optimizer). The larger phase counts. `released`: model-state bytes
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
    of a pipeline is left out of the norm: fivefold.parallel.data.data_parallel's `not_counted`)
    (what the eager gradient norm's and AdamW's temporaries are sized by): the largest parameter (an
    embedding / output-layer shard where the rank holds one, else the widest linear shard of its
    layers), or under a sharded DP mode the largest piece of one that a rank's chunk holds
    (fivefold.parallel.data.distributed_optimizer): ZeRO-1/2 cut each gradient bucket (`DEFAULT_BUCKET_BYTES`
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
    """Elements of ZeRO-3's largest units on pipeline rank `rank` (fivefold.parallel.data.fsdp): a decoder
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
