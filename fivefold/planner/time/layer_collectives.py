"""The collective and p2p calls of a decoder layer, as data (a rank's other calls: `rank_collectives.py`):
with those, the one source that both the measured call bytes (`fivefold.planner.measured.callbytes`)
and the step time (`steptime.py`) read.

Each entry is what OUR runtime issues (the measured checks compare it with the traffic counter, tag
by tag): its kind, the traffic tag, the group (the link it crosses), its call bytes (the full tensor
the call produces or consumes, the runtime's convention: all-reduce the tensor, all-gather the
gathered output, reduce-scatter the unscattered input, all-to-all the input, send / recv the tensor,
each counted on its own rank), its phase and what it can hide behind. What leaves a rank over its
link (`wire_bytes`): ring all-reduce 2(n-1)/n x call bytes, all-gather / reduce-scatter /
all-to-all (n-1)/n, send 1, recv 0 (it arrives over the other direction of the link), a broadcast
(a forward-only model's stats, `forward_stage_collectives`) (n-1)/n, as a chain that each rank but the
last passes on.

Per microbatch (b sequences, s tokens, M = b s/cp h x activation bytes: 4 fp32, 2 otherwise):
  decoder layer, TP without SP (tag tp): the two column-parallel groups (q/k/v, gate/up) all-reduce
    dL/dX backward, the two row-parallel linears (o, down) all-reduce Y forward: 4 M.
  decoder layer, TP + SP (tag sp): a column-parallel group all-gathers X forward, all-gathers it
    again backward (only the s/tp shard is saved) and reduce-scatters dL/dX: 3 M; a row-parallel
    linear reduce-scatters Y forward and all-gathers dL/dY backward: 2 M; 10 M per layer.
  A MoE layer has the attention half of that, the MLP half only for shared experts, and the
    expert-parallel terms of `moe_collectives`. CP adds `cp_collectives`.
A pipeline rank's other calls (its stage's, once a step) are in `rank_collectives.py`.
"""
from __future__ import annotations

from typing import NamedTuple

from fivefold.planner.memory.activations import kv_heads_and_dims, routed_share
from fivefold.planner.layout import Plan
from fivefold.planner.memory.params import is_moe_layer


GRAD_BYTES = 4
"""Gradients are fp32 (main grads) under every precision."""

WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
        "broadcast": lambda n: (n - 1) / n, "send": lambda n: 1.0, "recv": lambda n: 0.0}
"""Share of the call bytes a rank sends over its link, by kind, for a group of n ranks (ring algorithms)."""

STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
         "all_to_all": lambda n: n - 1, "broadcast": lambda n: n - 1, "send": lambda n: 1, "recv": lambda n: 0}
"""Latency-bound steps of one call (ring algorithms; a p2p transfer is one)."""


class Collective(NamedTuple):
    """One call (a named tuple: the search builds tens of thousands)."""

    kind: str
    """all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send | recv (runtime.traffic.KINDS)."""
    tag: str
    """The runtime's traffic tag."""
    group: str
    """The group, i.e. the link: tp, etp, cp, ep, pp, embedding, dp (DP x CP), edp."""
    call_bytes: float
    phase: str
    """forward | backward | step."""
    hides_behind: str | None = None
    """None: on the critical path. 'attention': the CP ring, overlapped with the attention core;
    'backward' / 'forward': DP traffic overlapped with the backward / next forward."""
    spread: int = 1
    """Microbatches a once-per-step entry is spread over (ZeRO-2/3 without PP: a reduce-scatter or
    all-gather per microbatch, each behind that microbatch's backward / forward)."""

    def wire_bytes(self, n: int) -> float:
        return self.call_bytes * WIRE[self.kind](n)

    def steps(self, n: int) -> int:
        return STEPS[self.kind](n)


def act_bytes(plan: Plan) -> int:
    """Bytes of one activation value: 4 in fp32, 2 under 16-bit (and fp8: its GEMMs keep bf16 tensors)."""
    return 4 if plan.precision == "fp32" else 2


def group_sizes(plan: Plan) -> dict[str, int]:
    return {"tp": plan.tp, "etp": plan.etp, "cp": plan.cp, "ep": plan.ep, "pp": plan.pp, "embedding": 2,
            "tp-cp": plan.tp * plan.cp,
            "dp": plan.dp * plan.cp // plan.instances, "dp-replicate": plan.instances, "edp": plan.edp}


def _tokens(plan: Plan) -> float:
    return plan.mbs * plan.seq / plan.cp


def _tp_half(plan: Plan, M: float, tag: str | None = None) -> list[Collective]:
    """One column-parallel group followed by one row-parallel linear (attention or MLP half)."""
    if plan.tp == 1:
        return []
    if not plan.sp:
        t = tag or "tp"
        return [Collective("all_reduce", t, "tp", M, "backward"), Collective("all_reduce", t, "tp", M, "forward")]
    t = tag or "sp"
    return [Collective("all_gather", t, "tp", M, "forward"), Collective("all_gather", t, "tp", M, "backward"),
            Collective("reduce_scatter", t, "tp", M, "backward"),
            Collective("reduce_scatter", t, "tp", M, "forward"), Collective("all_gather", t, "tp", M, "backward")]


def _mla_attention(plan: Plan) -> list[Collective]:
    """MLA's attention under TP (fivefold/model/mla.py): the down-projections are replicated, so the
    column-parallel up-projections take the latents through their collective: the query input
    (r_q wide, or x itself, h, without query compression) and the KV latent (r), plus the one shared
    rope key (dr) through a plain gather / copy; o is row-parallel (h). Per token, SP: 3 (w_q + r)
    (all-gather, again backward, reduce-scatter of the gradient) + 2 dr + 2 h; without SP: one
    all-reduce of each gradient (w_q + r + dr) and of o's output (h)."""
    if plan.tp == 1:
        return []
    m = plan.config.model
    per = _tokens(plan) * act_bytes(plan)
    w_q = m.q_lora_rank or m.hidden_size
    if not plan.sp:
        return ([Collective("all_reduce", "tp", "tp", per * w, "backward") for w in (w_q, m.kv_lora_rank,
                                                                                        m.qk_pos_emb_head_dim)]
                + [Collective("all_reduce", "tp", "tp", per * m.hidden_size, "forward")])
    out = []
    for w in (w_q, m.kv_lora_rank):  # column-parallel q_b / q and kv_b
        out += _tp_half(plan, per * w)[:3]
    dr = per * m.qk_pos_emb_head_dim
    out += [Collective("all_gather", "sp", "tp", dr, "forward"), Collective("reduce_scatter", "sp", "tp", dr, "backward")]
    return out + _tp_half(plan, per * m.hidden_size)[3:]  # o: reduce-scatter forward, all-gather backward


def layer_collectives(plan: Plan, index: int, recomputed: bool = False, cp_calls: bool = True) -> list[Collective]:
    """Decoder layer `index`'s calls for one microbatch on one rank (`recomputed`: fully recomputed;
    `cp_calls`: with context parallelism's, which come last): its attention and MLP calls
    (`dense_collectives`), then the routed experts', what recompute calls again and CP's
    (`later_collectives`)."""
    attention, mlp = dense_collectives(plan, index)
    return attention + mlp + later_collectives(plan, index, recomputed, attention, mlp, cp_calls)


def forward_layer_collectives(plan: Plan, index: int) -> list[Collective]:
    """Decoder layer `index`'s calls in a forward-only model's forward (planner/search/forward.py): its
    `layer_collectives` of the forward phase."""
    return [c for c in layer_collectives(plan, index) if c.phase == "forward"]


def dense_collectives(plan: Plan, index: int) -> tuple[list[Collective], list[Collective]]:
    """Decoder layer `index`'s attention calls and its MLP's (a dense MLP, or a MoE layer's shared
    experts; none without them): what neither recompute, EP nor CP changes."""
    m = plan.config.model
    M = _tokens(plan) * m.hidden_size * act_bytes(plan)
    attention = _mla_attention(plan) if m.multi_latent_attention else _tp_half(plan, M)
    mlp = _tp_half(plan, M) if not is_moe_layer(m, index) or m.moe_shared_expert_intermediate_size else []
    return attention, mlp


def later_collectives(plan: Plan, index: int, recomputed: bool, attention: list[Collective], mlp: list[Collective],
                      cp_calls: bool = True) -> list[Collective]:
    """The calls of decoder layer `index` after its attention and MLP ones (`dense_collectives`, the
    same objects): the routed experts', what recompute calls again, CP's (with `cp_calls`).
    What recompute reruns in backward calls again: a fully recomputed layer its forward's calls (a dense
    layer's but the last: torch.utils.checkpoint stops once every saved tensor is recomputed, and the
    MLP's output reduction feeds none), selective recompute of `moe` the MoE layer's forward calls, of
    `core_attn` the CP calls of the attention core (`cp_collectives`). Measured exactly: the TP2+SP, TP2
    and EP2 full-recompute rows of benchmarks/planner_vs_measured.py, and MoE layers with shared
    experts under TP2+SP (expert TP, and EP2 x ETP1) and EP2 full recompute (EP within 1%)."""
    m = plan.config.model
    moe = is_moe_layer(m, index)
    expert_calls = moe_collectives(plan) if moe else []
    selective = plan.recompute == "selective"
    rerun = attention + mlp + expert_calls if recomputed else \
        (expert_calls if selective and moe and "moe" in plan.recompute_modules else [])
    again = [c for c in rerun if c.phase == "forward"]
    if recomputed and again:
        # torch.utils.checkpoint stops recomputing once the last saved tensor is back, so the layer's
        # last call, its output's reduction, is not rerun: the dense MLP's or the shared experts' (they
        # run after the routed ones: measured, TP2+SP MoE with shared experts 1.064 of the sp bytes
        # when rerun), else a MoE layer's output all-gather over TP without SP (the first of
        # `moe_collectives`; TP2 x CP2 x EP2: 1.167 of the tp bytes); a MoE layer's combine is rerun
        # (the probability-weighted sum keeps its output)
        mlp_forward = [c for c in mlp if c.phase == "forward"]
        last = mlp_forward[-1] if mlp_forward else expert_calls[0] if plan.tp > 1 and not plan.sp else None
        again = [c for c in again if c is not last]
    out = expert_calls + again  # `again`: the same calls, made again during backward
    if plan.cp > 1 and cp_calls:
        out += cp_collectives(plan, recomputed or (selective and "core_attn" in plan.recompute_modules),
                              core_only=not recomputed)
    return out


def moe_collectives(plan: Plan) -> list[Collective]:
    """Routed experts (fivefold/parallel/expert/dispatch.py: Megatron's all-to-all dispatcher, dropless),
    per MoE layer and microbatch, with balanced routing. A rank routes n = b s/(tp cp) tokens (with TP
    the layer always works on its sequence shard; without SP it splits its replicated input and
    all-gathers its output, and the dual of the split all-gathers backward: tag tp, M each way):
      EP (tag ep): the per-expert counts (int64, E) exchanged by all-to-all; dispatch of the n k
        routed rows and combine of the R rows received (balanced: R = n k), both again backward.
      ETP (tag etp): the row counts all-gathered (int64, E/ep per rank), the R rows all-gathered and
        the partial expert outputs reduce-scattered over ETP (etp R h each), duals backward.
      aux loss (tag moe-aux) with TP x CP > 1: the per-expert token counts (float64, E) all-reduced
        over TP x CP (seq_aux_loss: b x E).
    Megatron's allgather dispatcher (`moe_token_dispatcher_type`, a runtime that has it: megatron-te)
    instead gathers the EP group's n tokens, routing maps (bool) and probabilities (fp32) on every
    rank and reduce-scatters the outputs (duals backward: the tokens' gradient reduce-scattered, the
    outputs' all-gathered); expert TP then gathers those ep n tokens. The flex dispatcher sends what
    the all-to-all does (`links.Links` charges the network per node, not per copy)."""
    m = plan.config.model
    B, E = act_bytes(plan), m.num_experts
    n = _tokens(plan) / plan.tp
    rows = n * m.moe_router_topk * routed_share(m, n) * m.hidden_size * B  # n k routed rows; balanced R = n k
    out = []
    if plan.tp > 1 and not plan.sp:
        M = _tokens(plan) * m.hidden_size * B
        out += [Collective("all_gather", "tp", "tp", M, "forward"), Collective("all_gather", "tp", "tp", M, "backward")]
    if plan.ep > 1 and plan.config.parallel.moe_token_dispatcher_type == "allgather":
        rows = plan.ep * n * m.hidden_size * B  # every EP rank's tokens, on each
        out += [Collective("all_gather", "ep", "ep", plan.ep * n * E * 5, "forward")]  # routing maps + probabilities
        out += [Collective(kind, "ep", "ep", rows, phase) for kind, phase in (
            ("all_gather", "forward"), ("reduce_scatter", "forward"), ("reduce_scatter", "backward"),
            ("all_gather", "backward"))]
    elif plan.ep > 1:
        out += [Collective("all_to_all", "ep", "ep", 8 * E, "forward")]
        out += [Collective("all_to_all", "ep", "ep", rows, phase) for phase in ("forward",) * 2 + ("backward",) * 2]
    if plan.etp > 1:
        g = plan.etp * rows
        out += [Collective("all_gather", "etp", "etp", 8 * E / plan.ep * plan.etp, "forward"),
                Collective("all_gather", "etp", "etp", g, "forward"), Collective("reduce_scatter", "etp", "etp", g, "forward"),
                Collective("reduce_scatter", "etp", "etp", g, "backward"), Collective("all_gather", "etp", "etp", g, "backward")]
    if plan.tp * plan.cp > 1 and m.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") \
            and (m.moe_aux_loss_coeff or m.moe_z_loss_coeff):
        per = plan.mbs * E if m.moe_router_load_balancing_type == "seq_aux_loss" else E
        out.append(Collective("all_reduce", "moe-aux", "tp-cp", 8 * per, "forward"))
    return out


def cp_split(plan: Plan) -> tuple[int, int]:
    """(A, P): the all-to-all and ring sizes of context parallelism (A x P = CP; 1 x 1 under all-gather
    CP, which neither re-lays heads nor passes a ring)."""
    p, cp = plan.config.parallel, plan.cp
    if p.cp_comm_type == "a2a":
        return cp, 1
    if p.cp_comm_type == "a2a+p2p":
        a, r = p.hierarchical_context_parallel_sizes
        return a, r
    if p.cp_comm_type == "allgather":
        return 1, 1
    return 1, cp


def attention_call_keys(plan: Plan) -> float:
    """Keys per attention-kernel call, for the kernel's length effect (`TimeAssumptions.attention_half_keys`):
    the sequence s (one call, also after an all-to-all), s / P on a p2p ring of P (a call per step).
    Under all-gather CP each rank runs its two chunks' calls over prefixes of r + 1 and 2 CP - r chunks
    of s / 2CP keys (TransformerEngine's AttnFuncWithCPAndKVAllGather): at L / (L + h) of the rate each,
    the pair takes the time of two calls over their mean, (2 CP + 1) s / 4 CP, on every rank."""
    if plan.cp_gathers_kv:
        return (2 * plan.cp + 1) * plan.seq / (4 * plan.cp)
    return plan.seq / cp_split(plan)[1]


def cp_collectives(plan: Plan, forward_again: bool = False, core_only: bool = False) -> list[Collective]:
    """Context parallelism per layer and microbatch (fivefold/parallel/{context,ring_attention,
    allgather_attention}.py).
    Per TP rank: a_l = heads/tp query heads, g_l = KV groups/tp (1 when replicated), G = the KV heads
    exchanged (g_l, or a_l where the all-to-all must first copy KV heads to their query heads), head
    dims d (q/k) and dv, e activation bytes, n = b s/cp tokens; CP = A (all-to-all) x P (ring).
      all-to-all (A > 1): q, k, v in and o back, forward and again backward: n e (a_l d + G d + G dv + a_l dv).
      ring (P > 1): (P-1) K/V blocks sent and received forward, n G (d + dv) e each; backward the K/V
        again plus the fp32 dK/dV partials: n G (d + dv) (e + 4) per hop; overlapped with the attention core.
      all-gather (TransformerEngine's, Llama 3's, ours): K and V gathered from the CP group forward, again
        backward, and dK / dV reduce-scattered back, CP n g_l (d + dv) e each; exposed (Megatron's
        TransformerConfig: "The all-gather is not async, and cannot be overlapped").
    With recompute of the attention core (selective) or of the layer (full), the forward's calls run
    again in backward; of the core alone (`core_only`) not the all-to-all of o back, which feeds no
    saved tensor (torch.utils.checkpoint stops once the last one is recomputed)."""
    m = plan.config.model
    e, tp, n = act_bytes(plan), plan.tp, _tokens(plan)
    A, P = cp_split(plan)
    a_l = m.num_attention_heads // tp
    g_l, d, dv = kv_heads_and_dims(m, tp)
    G = g_l if g_l % A == 0 else a_l
    out = []
    if plan.cp_gathers_kv:
        kv = plan.cp * n * g_l * (d + dv) * e
        out += [Collective("all_gather", "cp", "cp", kv, "forward"), Collective("all_gather", "cp", "cp", kv, "backward"),
                Collective("reduce_scatter", "cp", "cp", kv, "backward")]
        if forward_again:
            out.append(Collective("all_gather", "cp", "cp", kv, "backward"))
    if A > 1:
        qkvo = n * e * (a_l * d + G * d + G * dv + a_l * dv)
        out += [Collective("all_to_all", "cp", "cp", qkvo, "forward"), Collective("all_to_all", "cp", "cp", qkvo, "backward")]
        if forward_again:
            qkv = qkvo - n * e * a_l * dv if core_only else qkvo
            out.append(Collective("all_to_all", "cp", "cp", qkv, "backward"))
    if P > 1:
        kv = (P - 1) * n * G * (d + dv)
        for kind in ("send", "recv"):
            out.append(Collective(kind, "cp", "cp", kv * e, "forward", "attention"))
            out.append(Collective(kind, "cp", "cp", kv * (e + 4), "backward", "attention"))
            if forward_again:
                out.append(Collective(kind, "cp", "cp", kv * e, "backward", "attention"))
    return out
