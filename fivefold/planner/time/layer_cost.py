"""One decoder layer's time for one microbatch: its compute (GEMMs at the runtime's achieved share,
the attention core, memory-bound passes, what recompute runs again) and its TP / CP / EP calls
(`layer_collectives.py`) on their links, cached by layer kind; a forward-only layer's and stage's
share of it (`layer_forward_cost`, `stage_forward_cost`).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from fivefold.planner.memory.traits import ArchTraits
from fivefold.planner.memory.activations import Sharding, layer_activation_bytes, routed_share
from fivefold.planner.time.layer_collectives import (attention_call_keys, cp_collectives, cp_split, dense_collectives,
                                                     forward_layer_collectives, later_collectives)
from fivefold.planner.time.rank_collectives import dp_calls_per_step, forward_stage_collectives
from fivefold.planner.time.flops import attention_core_flops, layer_forward_flops
from fivefold.planner.layout import Plan
from fivefold.planner.time.links import Links
from fivefold.planner.memory.states import state_bytes_per_param
from fivefold.planner.memory.params import is_moe_layer, layer_params
from fivefold.planner.presets.hardware import Hardware
from fivefold.planner.time.time_assumptions import TimeAssumptions
from fivefold.planner.time.calls import _CALLS, _add_calls, _kept


def _tp_share(plan: Plan, ta: TimeAssumptions) -> float:
    """The share of a layer's TP / SP traffic the runtime hides behind its GEMMs: its `tp_overlap` where
    the config turns the overlap on (`ParallelConfig.tp_comm_overlap`: Megatron's --tp-comm-overlap,
    torchtitan's async TP), none where it sends it plainly."""
    return ta.tp_overlap if plan.config.parallel.tp_comm_overlap else 0.0


def _selective_rerun(t_core: float, t_experts: float, flops_rate: float, hw: Hardware, work: "_Work") -> float:
    """Seconds selective recompute adds to a layer's backward per microbatch: the forward of what it
    recomputes (`_rerun_work` says which), from the layer's attention core and routed-expert seconds."""
    if work.rerun is None:
        return 0.0
    if work.rerun == "sac":
        return work.t_linear / 2 + t_experts
    core, experts, tokens, matmul, dropped = work.rerun
    t = t_core if core else 0.0
    if experts:
        t += t_experts
    t += 2 * tokens * matmul / flops_rate
    return t if dropped is None else t + 2 * dropped / hw.memory_bw


def _rerun_work(plan: Plan, i: int, ta: TimeAssumptions):
    """What selective recompute reruns in layer `i`'s backward: None (no selective recompute), "sac"
    (torchtitan's op-level SAC, `op_level_sac`: the matmuls whose outputs it does not keep, every other
    one: half the linear time, and the routed experts), or Megatron's --recompute-modules as (the
    attention core again?, the routed experts again?, tokens per rank, parameters the rerun multiplies
    each token by (TP-split), bytes the memory-bound modules write again and read or None). core_attn
    the attention core; mla_up_proj the q / kv up-projections; mlp a dense MLP; moe the router,
    routed and shared experts (its dispatch / combine run again too: `layer_collectives`);
    shared_experts those; layernorm and moe_act are memory-bound: their dropped outputs written again
    and their inputs read, at HBM bandwidth."""
    if plan.recompute != "selective":
        return None
    if ta.op_level_sac:
        return "sac"
    m, sh = plan.config.model, _sharding(plan)
    tokens = plan.mbs * plan.seq / (plan.tp * plan.cp)  # per rank, TP-split linears
    lp, moe = layer_params(m, i), is_moe_layer(m, i)
    matmul = 0.0  # parameters the rerun multiplies each token by, split by TP
    if m.multi_latent_attention and sh.recomputes("mla_up_proj"):
        a = m.num_attention_heads
        matmul += (m.q_lora_rank or 0) * a * (m.qk_head_dim + m.qk_pos_emb_head_dim)
        matmul += m.kv_lora_rank * a * (m.qk_head_dim + m.v_head_dim)
    if (not moe and sh.recomputes("mlp")) or (moe and (sh.recomputes("moe") or sh.recomputes("shared_experts"))):
        matmul += lp.dense_mlp  # the dense MLP or the shared experts
    experts = moe and sh.recomputes("moe")
    if experts:
        matmul += m.hidden_size * m.num_experts * plan.tp  # the router, replicated: each rank routes its tokens
    dropped = None
    if sh.modules & {"layernorm", "moe_act"}:
        kept = Sharding.of(tp=sh.tp, sp=sh.sp, cp=sh.cp, etp=sh.etp)
        traits = _traits(plan.precision)
        dropped = sum(layer_activation_bytes(m, i, plan.mbs, plan.seq, kept, traits).values()) - \
            sum(layer_activation_bytes(m, i, plan.mbs, plan.seq,
                                       replace(sh, modules=sh.modules & {"layernorm", "moe_act"}), traits).values())
    return sh.recomputes("core_attn"), experts, tokens, matmul, dropped


def _sharding(plan: Plan) -> Sharding:
    return Sharding.of(tp=plan.tp, sp=plan.sp, cp=plan.cp, etp=plan.etp, recompute=plan.recompute,
                    modules=plan.recompute_modules)


def _traits(precision: str) -> ArchTraits:
    """The tensors memory-bound work touches: a fused runtime's saved activations at this precision."""
    return ArchTraits().for_precision(precision)


LAYER_GROUPS = ("tp", "etp", "cp", "ep", "tp-cp")
"""The groups a decoder layer's calls (`layer_collectives`) cross: its cost depends on their links only."""

_LAYER_COSTS: dict[tuple, tuple] = {}
"""What one layer's cost depends on -> (the model, its cost): layouts that differ only in PP, DP or
the layer split share their layers' costs (the model is kept alive beside its id)."""


class _Keys(NamedTuple):
    """What a plan's costs depend on besides the rank or layer, built once per step estimate (the model
    and hardware by identity, kept alive beside what they key): the layers' keys, and the stage and step
    calls already kept under theirs (a rank's then looked up by what they read of the rank alone)."""
    layers: tuple[tuple, tuple, tuple, tuple]
    """A decoder layer's (`_layer_cost`), at 2 x (MoE?) + (recomputed?): a dense layer's says nothing of
    EP / ETP, so layouts that differ only there share it; a MoE layer's adds the expert layout and
    links. A layer full recompute leaves alone (multi-token prediction's) costs what it costs without
    recompute: its key says none."""
    stage: dict
    """The ranks' per-microbatch calls (`_stage_calls`) kept under their key, by the rank's shape but
    its first layer."""
    step: dict
    """The ranks' once-per-step calls (`_step_calls`) kept under their key, by what the rank holds
    (`_held`)."""


def _keys(plan: Plan, links: Links, flops_rate: float) -> _Keys:
    m, p = plan.config.model, plan.config.parallel
    model = (id(m), id(links.hw), links.ta)
    common = (plan.recompute_modules, plan.mbs, plan.seq, plan.precision, plan.tp, plan.sp, plan.cp, p.cp_comm_type,
              tuple(p.hierarchical_context_parallel_sizes or ()), links.cross["tp"], links.cross["cp"],
              links.cross["tp-cp"], flops_rate, p.tp_comm_overlap)
    experts = (plan.ep, plan.etp, links.cross["ep"], links.cross["etp"], links.cross["ep local"],
               p.overlap_moe_expert_parallel_comm, p.moe_token_dispatcher_type) if m.is_moe else ()
    full = plan.recompute == "full"  # (only full recompute marks layers recomputed: `Plan.layer_groups`)
    kept = model + (None if full else plan.recompute,) + common
    rerun = model + ("full",) + common if full else None
    layers = ((False, False) + kept, (True, False) + rerun if full else None,
              (False, True) + kept + experts if m.is_moe else None,
              (True, True) + rerun + experts if full and m.is_moe else None)
    stage = model + ("stage", plan.tp, plan.sp, plan.cp, plan.pp, plan.mbs, plan.seq, plan.precision,
                     links.cross["tp"], links.cross["pp"], links.cross["cp"],  # MTP's targets gathered in two
                     p.cp_comm_type == "a2a+p2p" and min(cp_split(plan)) > 1)  # steps under a2a+p2p CP
    t = plan.config.training  # (the gradient buffers' and the gathered weights' bytes)
    step = model + ("step", plan.tp, plan.sp, plan.cp, plan.dp, plan.ep, plan.etp,
                    plan.edp, plan.precision, t.sharding_strategy, plan.reduce_every_microbatch,
                    state_bytes_per_param(t, plan.precision, 1)[:2], plan.instances,
                    dp_calls_per_step(plan), links.cross["tp"], links.cross["embedding"], links.cross["dp"], links.cross["edp"], p.order)
    return _Keys(layers, _kept(_CALLS, stage, m, links.hw, dict), _kept(_CALLS, step, m, links.hw, dict))


def _layer_cost(plan: Plan, links: Links, sizes: dict[str, int], i: int, recomputed: bool, flops_rate: float,
                keys: _Keys) -> tuple[float, ...]:
    """Seconds of compute, tp, cp and ep, then wire bytes sent over tp, cp and ep, of decoder layer `i`
    for one microbatch on one rank."""
    m = plan.config.model
    key = keys.layers[2 * is_moe_layer(m, i) + recomputed]
    assert key is not None, "a layer kind `_keys` did not expect"
    got = _LAYER_COSTS.get(key)  # (`_kept` inline: the search's most frequent lookup)
    if got is None or got[0] is not m or got[1] is not links.hw:
        got = _LAYER_COSTS[key] = (m, links.hw, _layer_cost_of(plan, links, sizes, i, recomputed, flops_rate))
    return got[2]


def _core_time(plan: Plan, links: Links) -> float:
    """Seconds of one layer's attention core (QK^T and AV) forward for one microbatch on one rank: bf16
    flash kernels at `attention_efficiency`, slower on short calls (`attention_half_keys`)."""
    m, b, s, tp, cp, ta, hw = plan.config.model, plan.mbs, plan.seq, plan.tp, plan.cp, links.ta, links.hw
    core = attention_core_flops(m, s) * b * s
    attn_rate = hw.achievable_flops("bf16") * (ta.attention_efficiency or ta.gemm_efficiency)
    if ta.attention_half_keys:
        keys = attention_call_keys(plan)
        attn_rate *= keys / (keys + ta.attention_half_keys)
    return core / (tp * cp) / attn_rate


def _layer_cost_of(plan: Plan, links: Links, sizes: dict[str, int], i: int, recomputed: bool, flops_rate: float):
    ta, hw = links.ta, links.hw
    # each op class at its own rate: linear GEMMs, the attention core (bf16 flash), grouped experts
    t_core = _core_time(plan, links)
    work = _layer_work(plan, links, sizes, i, recomputed, flops_rate)
    t_fwd = t_core + work.t_linear + work.t_experts
    extra = t_fwd if recomputed else _selective_rerun(t_core, work.t_experts, flops_rate, hw, work)
    compute = 3 * t_fwd + extra
    if ta.membound_passes:
        compute += ta.membound_passes * work.touched / hw.memory_bw
    parts, sent = work.parts, work.sent
    # only CP's calls report under cp (`_layer_work_of`): their sums, from 0, are the layer's
    t_cp, sent_cp = _cp_calls(plan, links, sizes, recomputed, t_core) if plan.cp > 1 else (parts["cp"], sent["cp"])
    return compute, parts["tp"], t_cp, parts["ep"], sent["tp"], sent_cp, sent["ep"]


def layer_forward_cost(plan: Plan, links: Links, sizes: dict[str, int], i: int, flops_rate: float
                       ) -> tuple[float, dict, dict]:
    """Decoder layer `i`'s forward alone, for one microbatch on one rank (a forward-only model:
    planner/search/forward.py): (compute seconds, seconds by part, wire bytes by part). Compute is the
    forward third of `_layer_cost_of`'s (no backward, no recompute), its memory-bound work a third of
    the forward + backward passes; the calls are the layer's forward ones (`layer_collectives`, phase
    forward: TP / SP, EP dispatch and combine, CP's, the ring hidden behind the forward attention core),
    hidden as the training step hides them but for the 1F1B all-to-all overlap (no backward to overlap)."""
    ta, hw = links.ta, links.hw
    t_core = _core_time(plan, links)
    work = _layer_work(plan, links, sizes, i, False, flops_rate)
    compute = t_core + work.t_linear + work.t_experts
    if ta.membound_passes:
        compute += ta.membound_passes * work.touched / hw.memory_bw / 3
    parts, sent = dict.fromkeys(("tp", "cp", "ep", "pp"), 0.0), dict.fromkeys(("tp", "cp", "ep", "pp"), 0.0)
    _add_calls(forward_layer_collectives(plan, i), links, sizes, parts, sent, t_core, ta.ep_overlap,
               _tp_share(plan, ta))
    return compute, parts, sent


def stage_forward_cost(plan: Plan, links: Links, sizes: dict[str, int], r: int) -> tuple[dict, dict]:
    """A forward-only model's calls outside the layers (`forward_stage_collectives`) of pipeline rank r
    for one microbatch, on the critical path: (seconds by part, wire bytes by part)."""
    parts, sent = dict.fromkeys(("tp", "cp", "ep", "pp"), 0.0), dict.fromkeys(("tp", "cp", "ep", "pp"), 0.0)
    _add_calls(forward_stage_collectives(plan, r), links, sizes, parts, sent)
    return parts, sent


_CP_CALLS: dict[tuple, tuple] = {}
"""A layer's CP calls timed, by what they depend on (the model and hardware kept alive beside their
ids): the same under every expert layout and layer kind."""


def _cp_calls(plan: Plan, links: Links, sizes: dict[str, int], recomputed: bool, t_core: float) -> tuple[float, float]:
    """(seconds, wire bytes) of a layer's CP calls (`cp_collectives`) for one microbatch, the ring's
    hidden behind the attention core (`t_core` seconds forward: forward + backward 3x)."""
    m, p = plan.config.model, plan.config.parallel
    again = recomputed or (plan.recompute == "selective" and "core_attn" in plan.recompute_modules)
    key = (again, recomputed, id(m), id(links.hw), links.ta, plan.mbs, plan.seq, plan.precision, plan.tp, plan.cp,
           p.cp_comm_type, tuple(p.hierarchical_context_parallel_sizes or ()), links.cross["cp"])

    def timed():
        calls = cp_collectives(plan, again, core_only=not recomputed)
        assert all(c.group == "cp" for c in calls), "a CP call on a group the cache key leaves out"
        parts, sent = {"cp": 0.0}, {"cp": 0.0}
        _add_calls(calls, links, sizes, parts, sent, 3 * t_core)  # hidden: the attention core, forward + backward
        return parts["cp"], sent["cp"]
    return _kept(_CP_CALLS, key, m, links.hw, timed)


class _Work(NamedTuple):
    """What a layer's cost shares with its twin of another CP exchange (the exchange sets the attention
    core's rate and the CP calls, `cp_collectives`, alone): its linear and routed-expert seconds, what
    selective recompute reruns (`_rerun_work`), the activation bytes memory-bound work touches, and
    its calls but CP's, timed (seconds and wire bytes by part, on tp and ep only)."""
    t_linear: float
    t_experts: float
    rerun: object
    touched: float
    parts: dict
    sent: dict


_LAYER_WORK: dict[tuple, tuple] = {}
"""A layer's `_Work`, by what it depends on (the model and hardware kept alive beside their ids)."""


def _layer_work(plan: Plan, links: Links, sizes: dict[str, int], i: int, recomputed: bool, flops_rate: float) -> _Work:
    m, p = plan.config.model, plan.config.parallel
    moe = is_moe_layer(m, i)
    recompute = plan.recompute if recomputed or plan.recompute != "full" else None  # (as `_Keys.layers`)
    key = (recomputed, moe, id(m), id(links.hw), links.ta, recompute, plan.recompute_modules, plan.mbs, plan.seq,
           plan.precision, plan.tp, plan.sp, plan.cp, links.cross["tp"], links.cross["tp-cp"], flops_rate,
           p.tp_comm_overlap)
    if moe:
        key += (plan.ep, plan.etp, links.cross["ep"], links.cross["etp"], links.cross["ep local"],
                p.overlap_moe_expert_parallel_comm, p.moe_token_dispatcher_type)
    return _kept(_LAYER_WORK, key, m, links.hw,
                 lambda: _layer_work_of(plan, links, sizes, i, recomputed, flops_rate))


def _layer_work_of(plan: Plan, links: Links, sizes: dict[str, int], i: int, recomputed: bool,
                   flops_rate: float) -> _Work:
    m, b, s, tp, cp, ta = plan.config.model, plan.mbs, plan.seq, plan.tp, plan.cp, links.ta
    experts = 2 * layer_params(m, i).active_experts * b * s
    t_experts = 0.0
    if experts:
        share = routed_share(m, b * s / (tp * cp))  # rows computed per assignment (capacity)
        rows = m.moe_router_topk * b * s * plan.etp / (tp * cp) / (m.num_experts / plan.ep) * share  # per local expert
        # the linear rate scaled by how grouped GEMMs fare against dense ones
        expert_rate = flops_rate * (ta.expert_efficiency or ta.gemm_efficiency) / ta.gemm_efficiency
        if ta.expert_half_rows:
            expert_rate *= rows / (rows + ta.expert_half_rows)
        t_experts = experts * share / (tp * cp) / expert_rate
    touched = 0.0
    if ta.membound_passes:
        key = ("touched", id(m), is_moe_layer(m, i), b, s, tp, plan.sp, cp, plan.etp, plan.precision)
        touched = _kept(_ACTIVATIONS, key, m, None, lambda: sum(layer_activation_bytes(
            m, i, b, s, Sharding.of(tp=tp, sp=plan.sp, cp=cp, etp=plan.etp), _traits(plan.precision)).values()))
    dense = _dense_work(plan, links, sizes, i, flops_rate)
    parts, sent = dict(dense.parts), dict(dense.sent)  # the attention and MLP calls come first
    calls = later_collectives(plan, i, recomputed, dense.attention, dense.mlp, cp_calls=False)
    assert all(c.group in LAYER_GROUPS and c.group != "cp" for c in calls), \
        "a layer call on a group the cache key leaves out"
    ep_share = ta.ep_overlap_1f1b if plan.config.parallel.overlap_moe_expert_parallel_comm \
        and ta.ep_overlap_1f1b is not None else ta.ep_overlap
    _add_calls(calls, links, sizes, parts, sent, 0.0, ep_share, _tp_share(plan, ta))
    rerun = None
    if not recomputed:
        key = ("rerun", id(m), is_moe_layer(m, i), b, s, tp, plan.sp, cp, plan.etp, plan.recompute,
               plan.recompute_modules, plan.precision, ta.op_level_sac)
        rerun = _kept(_ACTIVATIONS, key, m, None, lambda: _rerun_work(plan, i, ta))
    return _Work(dense.t_linear, t_experts, rerun, touched, parts, sent)


_ACTIVATIONS: dict[tuple, tuple] = {}
"""A layer's activation bytes that memory-bound work touches, and what selective recompute reruns, by
what they depend on (neither the expert layout nor the links; the model kept alive beside its id)."""


class _DenseWork(NamedTuple):
    """What a layer's work shares with its twins of another recompute mode or expert layout: its
    attention and MLP calls (`dense_collectives`), timed (seconds and wire bytes by part), and its
    linear layers' seconds (all but the attention core and the routed experts)."""
    attention: list
    mlp: list
    parts: dict
    sent: dict
    t_linear: float


_DENSE_WORK: dict[tuple, tuple] = {}
"""A layer's `_DenseWork`, by what it depends on (the model and hardware kept alive beside their ids)."""


def _dense_work(plan: Plan, links: Links, sizes: dict[str, int], i: int, flops_rate: float) -> _DenseWork:
    m = plan.config.model
    key = (is_moe_layer(m, i), id(m), id(links.hw), links.ta, plan.mbs, plan.seq, plan.precision, plan.tp, plan.sp,
           plan.cp, links.cross["tp"], flops_rate, plan.config.parallel.tp_comm_overlap)

    def work():
        b, s = plan.mbs, plan.seq
        core = attention_core_flops(m, s) * b * s
        experts = 2 * layer_params(m, i).active_experts * b * s
        t_linear = (layer_forward_flops(m, i, s) * b * s - core - experts) / (plan.tp * plan.cp) / flops_rate
        attention, mlp = dense_collectives(plan, i)
        assert all(c.group == "tp" for c in attention + mlp), "a layer call on a group the cache key leaves out"
        parts = dict.fromkeys(("tp", "cp", "ep"), 0.0)
        sent = dict.fromkeys(("tp", "cp", "ep"), 0.0)
        _add_calls(attention + mlp, links, sizes, parts, sent, tp_share=_tp_share(plan, links.ta))
        return _DenseWork(attention, mlp, parts, sent, t_linear)
    return _kept(_DENSE_WORK, key, m, links.hw, work)
