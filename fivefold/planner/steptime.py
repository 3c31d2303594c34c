"""Step time: compute at a calibratable GEMM efficiency, plus each communication on the link it
crosses, plus the pipeline bubble.

Per pipeline rank r and microbatch (b sequences of s tokens, M = b*s/cp*h*2 bytes of activations):
  compute   hardware FLOPs / (TP*CP) / (peak * gemm_efficiency); hardware = 3 x forward, + 1 forward
            of recomputed layers (full) or of the attention core (selective).
  TP / SP   per layer 2 all-reduces forward + 2 backward (or the same bytes as all-gather +
            reduce-scatter with SP): 8 (t-1)/t M bytes sent per rank; not overlapped. In a MoE layer
            the MLP half is replaced by the shared experts' (if any) and ETP's gather/scatter of the
            routed tokens.
  CP        p2p ring: (cp-1) K/V blocks forward, K/V and dK/dV backward = 3 (cp-1) KV bytes per layer,
            overlapped with the attention core (exposed: what exceeds it); a2a: Q, K, V, O each
            re-sharded forward and backward, (cp-1)/cp of each, not overlapped.
  EP        dispatch + combine, forward and backward: 4 all-to-alls of k*b*s/(tp*cp) token copies
            of h bf16 values, (ep-1)/ep of them leave the rank; not overlapped.
  PP        one activation forward and one gradient backward per model chunk: 2 vpp M/(tp if SP)
            bytes, on the critical path (Megatron's batched send/recv).
Then pipeline time (`pipeline.py`) from the ranks' microbatch times; DP gradient reduction (fp32
gradients: all-reduce 2(d-1)/d 4P, or reduce-scatter (d-1)/d 4P + all-gather of bf16 parameters
(d-1)/d 2P with the distributed optimizer) overlaps the last microbatch's backward and the
parameter all-gather the first forward (Megatron's --overlap-grad-reduce/--overlap-param-gather);
what is left is exposed. The Adam step reads and writes ~30 bytes per local parameter at HBM speed.
A collective of n ranks runs at the slowest link its group crosses: intra-node when all its ranks
share a node (from the rank order), else the per-GPU network bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.planner.flops import attention_core_flops, layer_forward_flops, model_flops_per_token, output_forward_flops
from fivefold.planner.layout import Plan
from fivefold.planner.memory import rank_params
from fivefold.planner.params import is_moe_layer
from fivefold.planner.pipeline import bubble_fraction, pipeline_time
from fivefold.planner.presets.hardware import Hardware
from fivefold.topology import Layout


@dataclass(frozen=True)
class TimeAssumptions:
    gemm_efficiency: float = 0.6
    """Achieved share of peak FLOP/s for the model's GEMMs and attention. Default 0.6 (calibrate)."""
    comm_efficiency: float = 0.8
    """Achieved share of link bandwidth for collectives and p2p. Default 0.8."""
    intra_latency: float = 5e-6
    """Seconds per collective step inside a node. Default 5 us."""
    network_latency: float = 15e-6
    """Seconds per collective step across nodes. Default 15 us."""
    optimizer_bytes_per_param: float = 30.0
    """HBM bytes the Adam step moves per local parameter. Default 30."""


@dataclass
class StepEstimate:
    step_time: float
    model_flops: float
    """Model FLOPs per step, all GPUs."""
    mfu: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    """Model TFLOP/s per GPU."""
    bubble_fraction: float
    """Idle share of the pipeline with equal stages (schedule's own)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step by kind (compute, tp, cp, ep, pp, bubble, dp, optimizer)."""
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes each rank sends per step (worst pipeline rank), by kind."""
    links: dict[str, str] = field(default_factory=dict)
    """Group -> 'intra-node' or 'network'."""

    @property
    def comm_fraction(self) -> float:
        return sum(self.parts.get(k, 0.0) for k in ("tp", "cp", "ep", "pp", "dp")) / self.step_time


def _spans_nodes(groups_of, dims: str, world: int, gpn: int) -> bool:
    for rank in {0, world - 1}:
        if len({r // gpn for r in groups_of(rank, dims)}) > 1:
            return True
    return False


class _Links:
    def __init__(self, plan: Plan, hw: Hardware, gpn: int, ta: TimeAssumptions):
        lay = Layout(tp=plan.tp, cp=plan.cp, pp=plan.pp, dp=plan.dp, ep=plan.ep, etp=plan.etp,
                     order=plan.config.parallel.order)
        d, e, w = lay.dense, lay.expert, plan.world
        self.cross = {"tp": _spans_nodes(d.group, "tp", w, gpn), "cp": _spans_nodes(d.group, "cp", w, gpn),
                      "pp": _spans_nodes(d.group, "pp", w, gpn), "dp": _spans_nodes(d.group, "cp-dp", w, gpn),
                      "ep": _spans_nodes(e.group, "ep", w, gpn), "etp": _spans_nodes(e.group, "etp", w, gpn),
                      "edp": _spans_nodes(e.group, "edp", w, gpn)}
        self.hw, self.ta = hw, ta

    def name(self, g: str) -> str:
        return "network" if self.cross[g] else "intra-node"

    def time(self, g: str, bytes_sent: float, steps: int) -> float:
        bw = self.hw.network_bw if self.cross[g] else self.hw.intra_node_bw
        lat = self.ta.network_latency if self.cross[g] else self.ta.intra_latency
        return bytes_sent / (bw * self.ta.comm_efficiency) + steps * lat


def step_time(plan: Plan, hw: Hardware, ta: TimeAssumptions = TimeAssumptions()) -> StepEstimate:
    cfg, m = plan.config, plan.config.model
    gpn = cfg.cluster.gpus_per_node
    links = _Links(plan, hw, gpn, ta)
    b, s, tp, cp = plan.mbs, plan.seq, plan.tp, plan.cp
    flops_rate = hw.peak_flops(plan.precision) * ta.gemm_efficiency
    M = b * s / cp * m.hidden_size * 2
    n_mb = plan.microbatches
    rank_times, rank_parts, rank_bytes = [], [], []
    kinds: dict[tuple[bool, bool], tuple[dict, dict]] = {}  # (MoE?, recomputed?) -> one layer's cost
    for r in range(plan.pp):
        parts = dict.fromkeys(("compute", "tp", "cp", "ep", "pp"), 0.0)
        sent = dict.fromkeys(("tp", "cp", "ep", "pp"), 0.0)
        for i, recomputed, n in plan.layer_groups(r):
            key = (is_moe_layer(m, i), recomputed)
            if key not in kinds:
                kinds[key] = _layer_cost(plan, links, i, recomputed, flops_rate)
            lp, ls = kinds[key]
            for k in lp:
                parts[k] += lp[k] * n
            for k in ls:
                sent[k] += ls[k] * n
        if r == plan.pp - 1:
            parts["compute"] += 3 * output_forward_flops(m) * b * s / (tp * cp) / flops_rate
        if plan.pp > 1:
            byt = 2 * plan.vpp * M / (tp if plan.sp else 1)
            sent["pp"] = byt
            parts["pp"] = links.time("pp", byt, 2 * plan.vpp)
        rank_times.append(sum(parts.values()))
        rank_parts.append(parts)
        rank_bytes.append(sent)
    pipe = pipeline_time(plan.schedule, rank_times, plan.vpp, n_mb)
    worst = max(range(plan.pp), key=lambda r: rank_times[r])
    dp_exposed, opt_time, dp_bytes = 0.0, 0.0, 0.0
    distopt = cfg.training.use_distributed_optimizer
    for r in range(plan.pp):
        dense, expert = rank_params(plan, r)
        t_exposed, sent = 0.0, 0.0
        comp = rank_parts[r]["compute"]
        for count, g, d in ((dense, "dp", plan.dp * cp), (expert, "edp", plan.edp)):
            if not count or d == 1:
                continue
            rs = (d - 1) / d * 4 * count * (1 if distopt else 2)
            ag = (d - 1) / d * 2 * count if distopt else 0.0
            sent += rs + ag
            t_exposed += max(0.0, links.time(g, rs, 2 * (d - 1)) - comp * 2 / 3)
            t_exposed += max(0.0, links.time(g, ag, d - 1) - comp / 3)
        local = (dense / (plan.dp * cp) + expert / plan.edp) if distopt else dense + expert
        opt = local * ta.optimizer_bytes_per_param / (hw.memory_bw * 0.8)
        if t_exposed + opt > dp_exposed + opt_time:
            dp_exposed, opt_time, dp_bytes = t_exposed, opt, sent
    total = pipe + dp_exposed + opt_time
    mf = model_flops_per_token(m, s) * cfg.training.global_batch_size * s
    parts = {k: v * n_mb for k, v in rank_parts[worst].items()}
    parts["bubble"] = pipe - n_mb * rank_times[worst]
    parts.update(dp=dp_exposed, optimizer=opt_time)
    comm_bytes = {k: v * n_mb for k, v in rank_bytes[worst].items()}
    comm_bytes["dp"] = dp_bytes
    return StepEstimate(step_time=total, model_flops=mf, mfu=mf / (plan.world * hw.peak_flops(plan.precision) * total),
                        tokens_per_s_per_gpu=cfg.training.global_batch_size * s / total / plan.world,
                        tflops_per_gpu=mf / total / plan.world / 1e12,
                        bubble_fraction=bubble_fraction(plan.schedule, plan.pp, plan.vpp, n_mb),
                        parts=parts, comm_bytes=comm_bytes,
                        links={g: links.name(g) for g in links.cross})


def _layer_cost(plan: Plan, links: _Links, i: int, recomputed: bool, flops_rate: float):
    """(seconds by kind, bytes sent by kind) of decoder layer `i` for one microbatch on one rank."""
    m, b, s, tp, cp, ep, etp = plan.config.model, plan.mbs, plan.seq, plan.tp, plan.cp, plan.ep, plan.etp
    tokens = b * s / cp
    M = tokens * m.hidden_size * 2
    parts = dict.fromkeys(("compute", "tp", "cp", "ep"), 0.0)
    sent = dict.fromkeys(("tp", "cp", "ep"), 0.0)
    fwd = layer_forward_flops(m, i, s) * b * s
    core = attention_core_flops(m, s) * b * s
    extra = fwd if recomputed else (core if plan.recompute == "selective" else 0.0)
    parts["compute"] = (3 * fwd + extra) / (tp * cp) / flops_rate
    moe = is_moe_layer(m, i)
    if tp > 1:  # attention half always; MLP half unless a MoE layer without shared experts
        halves = 1 + (0 if moe and not m.moe_shared_expert_intermediate_size else 1)
        sent["tp"] = halves * 4 * (tp - 1) / tp * M
        parts["tp"] = links.time("tp", sent["tp"], halves * 4 * (tp - 1))
    if moe:
        copies = m.moe_router_topk * tokens / tp  # token copies this rank dispatches
        if ep > 1:
            byt = 4 * copies * (ep - 1) / ep * m.hidden_size * 2
            sent["ep"] += byt
            parts["ep"] += links.time("ep", byt, 4)
        if etp > 1:
            byt = 4 * (etp - 1) * copies * m.hidden_size * 2
            sent["tp"] += byt
            parts["tp"] += links.time("etp", byt, 4 * (etp - 1))
    if cp > 1:
        if plan.config.parallel.cp_comm_type == "a2a":
            q, o = _qo_elems(m)
            sent["cp"] = 2 * (cp - 1) / cp * tokens * (q + _kv_elems(m) + o) * 2 / tp
            parts["cp"] = links.time("cp", sent["cp"], 8)
        else:
            sent["cp"] = 3 * (cp - 1) * tokens * _kv_elems(m) * 2 / tp
            hidden = 3 * core / (tp * cp) / flops_rate  # the attention core, forward + backward
            parts["cp"] = max(0.0, links.time("cp", sent["cp"], 3 * (cp - 1)) - hidden)
    return parts, sent


def _kv_elems(m) -> int:
    """K and V elements per token that CP exchanges (all heads; MLA: the up-projected K and V)."""
    if m.multi_latent_attention:
        return m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim)
    return 2 * m.kv_heads * m.head_dim


def _qo_elems(m) -> tuple[int, int]:
    a = m.num_attention_heads
    if m.multi_latent_attention:
        return a * (m.qk_head_dim + m.qk_pos_emb_head_dim), a * m.v_head_dim
    return a * m.head_dim, a * m.head_dim
