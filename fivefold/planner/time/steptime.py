"""Step time: compute at a calibratable GEMM efficiency, plus each communication on the link it
crosses, plus the pipeline bubble.

Per pipeline rank r and microbatch:
  compute   hardware FLOPs / (TP*CP) / (ceiling * gemm_efficiency); hardware = 3 x forward, + 1 forward
            of recomputed layers (full) or of the attention core (selective); ceiling = the best matmul
            measured on the GPU class at the run's precision (`Hardware.achievable_flops`, MAMF), so an
            achieved share means the same on an H100 and on a GB200.
  comm      every call of `layer_collectives.py` and `rank_collectives.py` (the list the measured byte
            checks use: what the runtime issues), converted to the bytes that leave the rank (ring
            all-reduce 2(n-1)/n x call bytes, all-gather / reduce-scatter / all-to-all (n-1)/n, send 1, recv 0) and
            timed on the link its group crosses, plus a latency per algorithm step. Not overlapped: TP/SP (10
            (t-1)/t M per layer under SP: the backward re-gathers the saved shard; 8 (t-1)/t M without),
            EP all-to-alls, CP all-to-all, PP sends (on the critical path, Megatron's batched
            send/recv). Overlapped: the CP ring with the attention core (exposed: what exceeds it).
Then pipeline time (`../pipeline.py`) from the ranks' microbatch times. Once per step: DP gradient
reduction overlaps the last microbatch's backward (2/3 of its compute) and the distributed
optimizer's parameter all-gather the first forward (1/3); what is left is exposed, as are the SP
norm-gradient and tied-embedding all-reduces. The Adam step reads and writes ~30 bytes per local
parameter at HBM speed. A collective of n ranks runs at the slowest link its group crosses:
intra-node when all its ranks share a node (from the rank order), else the per-GPU network bandwidth
(`links.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.planner.time.layer_collectives import group_sizes
from fivefold.planner.time.flops import model_flops_per_token, output_forward_flops
from fivefold.planner.memory.mtp import mtp_forward_flops
from fivefold.planner.layout import Plan
from fivefold.planner.time.links import Links
from fivefold.planner.memory.states import rank_params
from fivefold.planner.pipeline import bubble_fraction, pipeline_time
from fivefold.planner.presets.hardware import Hardware
from fivefold.planner.time.time_assumptions import TimeAssumptions
from fivefold.planner.time.layer_cost import _Keys, _keys, _layer_cost
from fivefold.planner.time.calls import _add_timed, _stage_calls, _step_calls


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


def step_time(plan: Plan, hw: Hardware, ta: TimeAssumptions = TimeAssumptions()) -> StepEstimate:
    cfg, m = plan.config, plan.config.model
    links = Links(plan, hw, cfg.cluster.gpus_per_node, ta)
    sizes = group_sizes(plan)
    s, cp = plan.seq, plan.cp
    gemm = ta.fp8_gemm_efficiency if plan.precision == "fp8" and ta.fp8_gemm_efficiency else ta.gemm_efficiency
    flops_rate = hw.achievable_flops(plan.precision) * gemm  # linear layers
    n_mb = plan.microbatches
    classes = plan.rank_classes  # ranks of equal `Plan.rank_shapes` cost the same
    keys = _keys(plan, links, flops_rate)
    costs = {r: _rank_cost(plan, r, links, sizes, flops_rate, keys) for r in dict.fromkeys(classes)}
    rank_times = [costs[first][2] for first in classes]
    fused = plan.recompute == "full"  # the runtime's zero-bubble B is then the whole backward (executor)
    pipe = pipeline_time(plan.schedule, rank_times, plan.vpp, n_mb, plan.group, fused)
    worst = classes[rank_times.index(max(rank_times))]  # the first slowest rank's class
    distopt = cfg.training.use_distributed_optimizer
    step_parts, step_bytes, opt_time = {}, {}, -1.0  # of the rank whose once-per-step work is longest
    for r, (rank_parts, _, _) in costs.items():
        comp = rank_parts["compute"]
        behind_of = {"backward": comp * 2 / 3, "forward": comp / 3}  # what a step call can hide behind
        exposed: dict[str, float] = {}
        calls, sent = _step_calls(plan, r, links, sizes, keys.step)
        for part, t, behind, spread in calls:
            hide = spread * behind_of.get(behind, 0.0)
            exposed[part] = exposed.get(part, 0.0) + max(0.0, t - hide)
        dense, expert = rank_params(plan, r)
        local = (dense / (plan.dp * cp) + expert / plan.edp) if distopt else dense + expert
        opt = local * ta.optimizer_bytes_per_param / (hw.memory_bw * 0.8)
        if sum(exposed.values()) + opt > sum(step_parts.values()) + opt_time:
            step_parts, step_bytes, opt_time = exposed, sent, opt
    total = pipe + sum(step_parts.values()) + opt_time
    mf = model_flops_per_token(m, s) * cfg.training.global_batch_size * s
    worst_parts, worst_bytes, worst_time = costs[worst]
    parts = {k: v * n_mb for k, v in worst_parts.items()}
    parts["bubble"] = pipe - n_mb * worst_time
    parts["dp"] = 0.0
    for k, v in step_parts.items():
        parts[k] = parts.get(k, 0.0) + v
    parts["optimizer"] = opt_time
    comm_bytes = {k: v * n_mb for k, v in worst_bytes.items()}
    comm_bytes["dp"] = 0.0
    for k, v in step_bytes.items():
        comm_bytes[k] = comm_bytes.get(k, 0.0) + v
    return StepEstimate(step_time=total, model_flops=mf, mfu=mf / (plan.world * hw.peak_flops(plan.precision) * total),
                        tokens_per_s_per_gpu=cfg.training.global_batch_size * s / total / plan.world,
                        tflops_per_gpu=mf / total / plan.world / 1e12,
                        bubble_fraction=bubble_fraction(plan.schedule, plan.pp, plan.vpp, n_mb, plan.group, fused),
                        parts=parts, comm_bytes=comm_bytes,
                        links=links.names)  # shared by the layouts of one layout's links: read only


def _rank_cost(plan: Plan, r: int, links: Links, sizes: dict[str, int], flops_rate: float,
               keys: "_Keys") -> tuple[dict, dict, float]:
    """(seconds by kind, wire bytes by kind, total seconds) of pipeline rank r for one microbatch:
    its layers, the output layer's compute on the last rank, its stage calls."""
    m = plan.config.model
    compute = tp = cp = ep = sent_tp = sent_cp = sent_ep = 0.0
    for i, recomputed, n in plan.layer_groups(r):
        c, t, x, e, sent_t, sent_x, sent_e = _layer_cost(plan, links, sizes, i, recomputed, flops_rate, keys)
        compute, tp, cp, ep = compute + c * n, tp + t * n, cp + x * n, ep + e * n
        sent_tp, sent_cp, sent_ep = sent_tp + sent_t * n, sent_cp + sent_x * n, sent_ep + sent_e * n
    if r == plan.last_rank:
        head = output_forward_flops(m) + mtp_forward_flops(m)  # + MTP's eh_proj and output layers
        compute += 3 * head * plan.mbs * plan.seq / (plan.tp * plan.cp) / flops_rate
    parts = {"compute": compute, "tp": tp, "cp": cp, "ep": ep, "pp": 0.0}
    sent = {"tp": sent_tp, "cp": sent_cp, "ep": sent_ep, "pp": 0.0}
    _add_timed(_stage_calls(plan, r, links, sizes, keys.stage), parts, sent)
    return parts, sent, sum(parts.values())
