"""Every call one pipeline rank makes beyond its decoder layers' (`layer_collectives.py`, which
says what an entry is and how its bytes leave the rank): its stage's per microbatch and its
step's once, and the rank's whole list (`rank_collectives`).

Per microbatch (b sequences, s tokens, M = b s/cp h x activation bytes: 4 fp32, 2 otherwise):
  first stage: the vocab-parallel embedding all-reduces its output (M; SP: reduce-scatter forward,
    all-gather backward, 2 M). Last stage: the column-parallel output layer (M; SP: 3 M) and the
    vocab-parallel cross entropy (tag tp-loss): an fp32 max and a (sum exp, target logit) pair per
    token, 3 x 4 b s/cp bytes, all-reduces.
  pipeline (tag pp): each virtual stage whose next stage is on another rank sends its output and
    receives its output's gradient; each whose previous stage is on another rank receives its input
    and sends the input's gradient: boundary tensor (b, s/cp, h), (b, s/(cp tp), h) under SP, in the
    pipeline's dtype (fp32 for fp32 runs; Megatron's bf16 otherwise).
Per step:
  tp-grad   fp32 all-reduces over TP of the gradients of replicated parameters each TP rank computed
            a part of: under SP the norm gains (2 per layer, + the final norm and MTP's three norms
            per depth on the last stage) and MLA's down-projections and latent norms; MoE routers
            (E h per MoE layer); per-head q / k norms; with TP > KV heads the whole KV heads' k / v
            projections (each rank's gradient in its slot of a buffer of all g heads).
  embedding-grad  tied embeddings with PP: the first and last stage all-reduce the embedding's
            gradient (V/tp h) over the two of them (none when one rank holds both, as DualPipeV).
  dp-grad   every local gradient, all-reduced over DP x CP in buckets (routed-expert gradients
            over expert-DP, tag edp-grad); with the distributed optimizer reduce-scattered instead, and
            the updated parameters all-gathered (tags dp-param / edp-param, weight bytes: fp32 in fp32
            runs, bf16 otherwise). Gradients are in the precision policy's gradient dtype
            (fivefold.config.precision: fp32, or bf16 / fp16 with --grad-reduce-in-bf16 / fp16
            without --accumulate-allreduce-grads-in-fp32); tp-grad reduces the fp32 main gradients.
            ZeRO-2/3 without PP reduce-scatter every microbatch's gradients (dense and expert) and
            ZeRO-3 gathers every unit before its forward and its backward, each microbatch.
            Buckets padded to a multiple of the group are not modelled (< 0.1%).
"""
from __future__ import annotations

from fivefold.planner.layout import Plan
from fivefold.planner.memory.states import rank_params, state_bytes_per_param
from fivefold.planner.memory.params import embedding_params, is_moe_layer, kv_params, norm_params
from fivefold.planner.time.layer_collectives import (GRAD_BYTES, Collective, _tokens, _tp_half, act_bytes, cp_split,
                                                     layer_collectives)


def stage_collectives(plan: Plan, pp_rank: int) -> list[Collective]:
    """Per microbatch, outside the decoder layers: embedding, output layer and loss, pipeline p2p."""
    m = plan.config.model
    M = _tokens(plan) * m.hidden_size * act_bytes(plan)
    first, last = pp_rank == plan.first_rank, pp_rank == plan.last_rank
    out = []
    if plan.tp > 1:
        if first:
            out += _embedding(plan, M)
        if last:
            head = _tp_half(plan, M)[:3 if plan.sp else 1]  # the output layer: a column-parallel group
            loss = [Collective("all_reduce", "tp-loss", "tp", 4 * _tokens(plan), "forward"),
                    Collective("all_reduce", "tp-loss", "tp", 2 * 4 * _tokens(plan), "forward")]
            out += head + loss
            for _ in range(m.mtp_num_layers or 0):
                out += _mtp_depth(plan, M) + head + loss  # each depth's head and loss again
    if last and m.mtp_num_layers and plan.cp > 1:
        # MTP's targets: the microbatch's token ids and labels (int64 pairs) gathered over CP to be
        # rolled (fivefold.model.mtp.rolled_targets), over the all-to-all part of CP first, then the ring
        a, p = cp_split(plan)
        pairs = plan.mbs * plan.seq * 2 * 8
        if a > 1 and p > 1:
            out.append(Collective("all_gather", "mtp-roll", "cp", pairs / p, "forward"))
        out.append(Collective("all_gather", "mtp-roll", "cp", pairs, "forward"))
    return out + _pipeline_p2p(plan, pp_rank, M)


def _pipeline_p2p(plan: Plan, pp_rank: int, M: float) -> list[Collective]:
    """Pipeline rank `pp_rank`'s sends and receives of one microbatch: per virtual stage whose neighbour
    is on another rank, the boundary tensor forward and its gradient backward."""
    boundary = M / (plan.tp if plan.sp else 1)  # (b, s/cp, h), (b, s/(cp tp), h) under SP
    placement, out = plan.placement, []
    for s, r in enumerate(placement):
        if r != pp_rank:
            continue
        if s + 1 < len(placement) and placement[s + 1] != r:
            out += [Collective("send", "pp", "pp", boundary, "forward"), Collective("recv", "pp", "pp", boundary, "backward")]
        if s > 0 and placement[s - 1] != r:
            out += [Collective("recv", "pp", "pp", boundary, "forward"), Collective("send", "pp", "pp", boundary, "backward")]
    return out


def forward_stage_collectives(plan: Plan, pp_rank: int) -> list[Collective]:
    """A forward-only model's calls per microbatch outside the decoder layers, as `Engine.forward` makes
    them (fivefold.engine.engine; no loss, no MTP): the embedding's forward reduction on the first rank;
    on the last, under SP the final normed hidden states gathered over TP (tag engine-sp), then each
    chunk's vocab-parallel log-prob and entropy (tag tp-loss: a max and a (sum exp, target logit) pair,
    then a max and a (sum exp, sum exp z) pair, 4 + 8 + 4 + 8 bytes a token), and under CP the per-position
    stats (log-prob, entropy: 2 fp32 a token) gathered over CP (engine-cp); the forward-only pipeline's
    sends and receives (`_pipeline_p2p`, forward), and under PP the stats broadcast from the last stage's
    rank over the pipeline group (engine-pp, counted on every rank)."""
    m = plan.config.model
    n = _tokens(plan)
    M = n * m.hidden_size * act_bytes(plan)
    first, last = pp_rank == plan.first_rank, pp_rank == plan.last_rank
    stats = plan.mbs * plan.seq * 2 * 4  # (b, s, 2) fp32, the whole sequence
    out = []
    if plan.tp > 1 and first:
        out += [c for c in _embedding(plan, M) if c.phase == "forward"]
    if plan.tp > 1 and last:
        if plan.sp:
            out.append(Collective("all_gather", "engine-sp", "tp", M, "forward"))
        out += [Collective("all_reduce", "tp-loss", "tp", 4 * n, "forward"),
                Collective("all_reduce", "tp-loss", "tp", 2 * 4 * n, "forward")] * 2
    if last and plan.cp > 1:
        out.append(Collective("all_gather", "engine-cp", "cp", stats, "forward"))
    out += [c for c in _pipeline_p2p(plan, pp_rank, M) if c.phase == "forward"]
    if plan.pp > 1:
        out.append(Collective("broadcast", "engine-pp", "pp", stats, "forward"))
    return out


def _mtp_depth(plan: Plan, M: float) -> list[Collective]:
    """One MTP depth's calls beside its decoder layer, head and loss (fivefold.model.mtp, TP > 1): the
    vocab-parallel embedding of the rolled ids (as the first stage's), eh_proj column-parallel over
    [enorm(emb), hnorm(h)] (2 M), its h/tp output gathered over the features (tag tp) and, under SP,
    split back to the sequence shard (whose backward gathers: tag tp)."""
    if not plan.sp:
        return [*_embedding(plan, M), *_tp_half(plan, 2 * M)[:1], Collective("all_gather", "tp", "tp", M, "forward")]
    return [*_embedding(plan, M), *_tp_half(plan, 2 * M)[:3],
            Collective("all_gather", "tp", "tp", M, "forward"), Collective("all_gather", "tp", "tp", M, "backward")]


def _embedding(plan: Plan, M: float) -> list[Collective]:
    """The vocab-parallel embedding's reduction over TP: reduce-scattered to the sequence shard under
    SP (its backward gathers), else all-reduced."""
    if plan.sp:
        return [Collective("reduce_scatter", "sp", "tp", M, "forward"), Collective("all_gather", "sp", "tp", M, "backward")]
    return [Collective("all_reduce", "tp", "tp", M, "forward")]


def step_collectives(plan: Plan, pp_rank: int) -> list[Collective]:
    """Once per step: TP-replicated parameters' gradients, the tied / MTP embedding's gradient, DP
    gradients (and parameters)."""
    m = plan.config.model
    out = []
    first, last = pp_rank == plan.first_rank, pp_rank == plan.last_rank
    if plan.tp > 1:  # replicated parameters each TP rank computes a part of the gradient of
        groups = plan.layer_groups(pp_rank)
        layers = sum(n for _, _, n in groups)
        # under SP: the layers' norms, the last rank's final norm and MTP's enorm / hnorm / final norm
        summed = norm_params(m) * (2 * layers + last * (1 + 3 * (m.mtp_num_layers or 0))) if plan.sp else 0
        if plan.sp and m.multi_latent_attention:  # MLA's replicated down-projections and latent norms
            h, r, norm = m.hidden_size, m.kv_lora_rank, int(m.qk_layernorm)  # latent norms: --qk-layernorm
            per_layer = h * (r + m.qk_pos_emb_head_dim) + r * norm + (h * m.q_lora_rank + m.q_lora_rank * norm
                                                                        if m.q_lora_rank else 0)
            summed += per_layer * layers
        if m.qk_layernorm and not m.multi_latent_attention:
            if m.qk_layernorm_scope == "head":  # per-head q / k norms: each rank's gradient from its heads
                summed += 2 * m.head_dim * norm_params(m) // m.hidden_size * layers
            elif m.kv_heads < plan.tp:  # the replicated KV head's k-norm rows, in the KV-replica buffer
                summed += m.kv_heads * m.head_dim * norm_params(m) // m.hidden_size * layers
        if m.kv_heads < plan.tp and not m.multi_latent_attention:
            # KV replicas: each rank puts its head's k / v gradient in its slot of a buffer of every KV
            # head's (fivefold.parallel.tensor.reduce_tp_grads): g whole heads, k and v
            summed += kv_params(m) * layers
        routers = (m.num_experts or 0) * m.hidden_size * sum(n for i, _, n in groups if is_moe_layer(m, i))
        if summed + routers:
            out.append(Collective("all_reduce", "tp-grad", "tp", GRAD_BYTES * (summed + routers), "step"))
    weight, grad, _ = state_bytes_per_param(plan.config.training, plan.precision, 1)  # the gradient buffers' dtype
    # the embedding's copy on the last rank (tied: the head; with MTP: its input embedding) is kept
    # equal to the first rank's by summing their gradients
    if (m.tie_word_embeddings or m.mtp_num_layers) and (first or last) and plan.first_rank != plan.last_rank:
        emb = m.padded_vocab_size(plan.tp) * m.hidden_size / plan.tp
        out.append(Collective("all_reduce", "embedding-grad", "embedding", grad * emb, "step"))
    dense, expert = rank_params(plan, pp_rank)
    mode = plan.config.training.sharding_strategy
    for count, group, d in ((dense, "dp", plan.dp * plan.cp), (expert, "edp", plan.edp)):
        if not count or d == 1:
            continue
        if mode != "no_shard":
            # ZeRO-2/3 reduce-scatter the gradients (dense and expert) after every microbatch where
            # `Plan.reduce_every_microbatch`; ZeRO-3 then frees every unit after its forward and
            # all-gathers it before its forward and again before its backward, per microbatch, also
            # when the step is one microbatch (else once a step: the units stay whole until the
            # step's end)
            times = dp_calls_per_step(plan)
            zero3 = mode == "optim_grads_params"
            gathers = times if zero3 else 1
            gathered = count + (zero3_regathered(plan, pp_rank) if zero3 and group == "dp" else 0.0)
            out += [Collective("reduce_scatter", f"{group}-grad", group, grad * count * times, "step", "backward", times),
                    Collective("all_gather", f"{group}-param", group, weight * gathered * gathers, "step", "forward", gathers)]
            if zero3 and plan.reduce_every_microbatch:  # each unit gathered again before its backward
                out.append(Collective("all_gather", f"{group}-param", group, weight * count * gathers, "step",
                                      "backward", gathers))
            if group == "dp" and plan.instances > 1:  # HSDP: each reduced chunk summed over the instances
                out.append(Collective("all_reduce", "dp-grad", "dp-replicate",
                                      grad * count / (d // plan.instances), "step"))
        else:
            out.append(Collective("all_reduce", f"{group}-grad", group, grad * count, "step", "backward"))
    return out


def zero3_regathered(plan: Plan, pp_rank: int) -> float:
    """Parameters ZeRO-3 gathers again within one forward (`Plan.reduce_every_microbatch`: every unit
    freed after each use, fivefold.parallel.data.fsdp): the embedding's unit where the rank calls it again
    (a tied output layer; each multi-token-prediction depth's input embedding) and the output layer's
    for each MTP depth. Backward gathers each unit once (it stays whole until its bucket is reduced).
    Under PP without it the units stay whole for the step: none."""
    if not plan.reduce_every_microbatch:
        return 0.0
    m = plan.config.model
    first, last = pp_rank == plan.first_rank, pp_rank == plan.last_rank
    depths = (m.mtp_num_layers or 0) if last else 0
    heads = 1 + depths if last else 0
    embedding_uses = first + depths + (heads if m.tie_word_embeddings else 0)
    head_uses = 0 if m.tie_word_embeddings else heads
    return (max(0, embedding_uses - 1) + max(0, head_uses - 1)) * embedding_params(m, plan.tp) / plan.tp


def dp_calls_per_step(plan: Plan) -> int:
    """How many times a step reduce-scatters the gradients (and ZeRO-3 gathers the parameters): every
    microbatch where `Plan.reduce_every_microbatch`, else once."""
    return plan.microbatches if plan.reduce_every_microbatch else 1


def rank_collectives(plan: Plan, pp_rank: int) -> list[tuple[Collective, float]]:
    """Every call of one rank of pipeline rank `pp_rank` in one step, with how many times it is made."""
    n_mb = plan.microbatches
    out: list[tuple[Collective, float]] = []
    for i, recomputed, n in plan.layer_groups(pp_rank):
        out += [(c, n * n_mb) for c in layer_collectives(plan, i, recomputed)]
    out += [(c, n_mb) for c in stage_collectives(plan, pp_rank)]
    out += [(c, 1) for c in step_collectives(plan, pp_rank)]
    return out
