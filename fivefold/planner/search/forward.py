"""A forward-only model (RL's frozen reference, AReaL's ModelName("ref"), or a reward model): its memory
per GPU and the time of its forward over a global batch, as our runtime runs it: `Engine.forward`
(fivefold/engine/engine.py) under no_grad, per-token log-probs and entropy computed from the last
layer's hidden states in sequence chunks of `chunk` tokens (Engine's default 1024), vocab-parallel under
TP, under PP the forward-only version of the config's pipeline schedule.

Memory per pipeline rank (`forward_memory_per_rank`; a `RankMemory` with no gradients, optimizer state
or optimizer scratch):
  weights      the rank's parameters (`memory.states.rank_params`: split by TP / PP / EP / ETP) in the
               runtime's parameter dtype (16-bit in a bf16 run), whole on every DP rank: a frozen copy
               is not sharded over DP, whatever the config's data-parallel mode (`forward_config`);
  activations  one microbatch's forward transient: nothing is kept for a backward, so the peak is one
               layer's forward temporaries (`activations.forward_layer_bytes`) beside the stage's input
               (Decoder.forward holds it through the stage) and, past a chunk's first layer, the layer's
               input; or, on the last rank, the head's moment: the last layer's output, the normed
               hidden states (gathered over TP under SP) and one chunk's log-prob computation, whose
               logits and fp32 temporaries are the `logits` row (`activations.logprob_bytes_per_logit`,
               b x min(chunk, s/cp) x V_padded/tp logits), under PP beside the stage input the executor
               holds;
  buffers      none beyond those moments: the forward-only executor frees a microbatch's output once
               sent and posts a receive after the computation before it (measured: PP2, PP4 and
               TP2 x PP2 1F1B, PP2 ZB-H1, no boundary tensor at either peak);
  overhead, reserve   the allocator overhead and runtime reserve, as the training estimate adds them.
Left out, as in the training estimate: RoPE tables, token ids and the (b, s, 2) fp32 stats (kilobytes).
Measured against `Engine.forward`: `python benchmarks/planner_vs_measured.py --forward`.

Time (`forward_time`): each rank's layers' forward compute (`layer_cost.layer_forward_cost`: a third of a
training step's layer FLOPs, no recompute) and forward calls (TP / SP, CP, EP), the output layer's
forward FLOPs on the last rank, the forward calls outside the layers (`layer_cost.stage_forward_cost`,
from `rank_collectives.forward_stage_collectives`), then the forward-only pipeline (`pipeline.
forward_pipeline_time`: (p - 1) stage times of fill for 1F1B). No DP gradient reduction, no optimizer
step. MFU on forward FLOPs (`flops.forward_flops_per_token`).

Our runtime holds this when the model is built frozen (`Engine(..., frozen=True)`: the weights alone,
whole on every DP rank); an engine built for training also holds its data-parallel mode's gradient
buffers (and fp32 main parameters in a 16-bit run: 4 + 4 bytes a parameter beside the 2 of the
weights), which a forward never touches, and under ZeRO-3 shards the weights over DP and gathers each
unit for every forward: not what this estimate sizes.
"""
from __future__ import annotations

import dataclasses

from fivefold.config.schema import Config
from fivefold.config.precision import Precision
from fivefold.planner.memory.activations import Sharding, forward_layer_bytes, logprob_bytes_per_logit
from fivefold.planner.time.layer_collectives import group_sizes
from fivefold.planner.time.flops import forward_flops_per_token, output_forward_flops
from fivefold.planner.layout import Plan
from fivefold.planner.time.links import Links
from fivefold.planner.memory.kinds import GiB, MemoryAssumptions, RankMemory
from fivefold.planner.memory.states import rank_params
from fivefold.planner.memory.params import is_moe_layer
from fivefold.planner.pipeline import forward_bubble_fraction, forward_pipeline_time
from fivefold.planner.presets.hardware import Hardware
from fivefold.planner.search.ranking import Candidate
from fivefold.planner.time.steptime import StepEstimate
from fivefold.planner.time.layer_cost import layer_forward_cost, stage_forward_cost
from fivefold.planner.time.time_assumptions import TimeAssumptions
from fivefold.planner.search.validity import config_errors

FORWARD_CHUNK = 1024
"""Tokens per chunk of the log-prob computation: `Engine`'s default `chunk` (tests/test_planner_forward.py
checks they agree)."""


def forward_config(cfg: Config) -> Config:
    """`cfg` as a forward-only model runs: no recompute (nothing is kept for a backward), its weights
    whole on every DP rank (the data-parallel mode replicated, the distributed optimizer off)."""
    t = dataclasses.replace(cfg.training, recompute_granularity=None, data_parallel_sharding_strategy="no_shard",
                            use_distributed_optimizer=False, optimizer_cpu_offload=False,
                            fine_grained_activation_offloading=False)
    return dataclasses.replace(cfg, training=t)


def forward_layer_groups(plan: Plan, r: int) -> list[tuple[int, int]]:
    """(a representative layer index, how many) of pipeline rank r's decoder layers by kind, as
    Engine.forward runs them: multi-token prediction's layers, which `Plan.layer_groups` counts on the
    last rank, are not run."""
    m = plan.config.model
    mtp = (m.mtp_num_layers or 0) if r == plan.last_rank else 0
    out = []
    for i, _, n in plan.layer_groups(r):
        if mtp and is_moe_layer(m, i) == is_moe_layer(m, m.num_layers):  # MTP's count sits with its kind
            n, mtp = n - mtp, 0
        if n:
            out.append((i, n))
    return out


def forward_memory_per_rank(plan: Plan, assume: MemoryAssumptions = MemoryAssumptions(),
                            chunk: int = FORWARD_CHUNK) -> list[RankMemory]:
    """Each pipeline rank's memory as a forward-only model (module docstring), `plan` from `forward_config`."""
    m, t = plan.config.model, plan.config.training
    traits = assume.traits.for_precision(plan.precision, t.fp8_recipe)
    B = traits.value_bytes()
    sh = Sharding.of(tp=plan.tp, sp=plan.sp, cp=plan.cp, etp=plan.etp)
    weight = Precision.of(t, plan.precision).state_bytes(1, "no_shard")[0]
    positions = plan.seq // plan.cp  # the head's positions on a rank (gathered over TP under SP)
    hidden = plan.mbs * positions * m.hidden_size * B
    held = hidden / (plan.tp if plan.sp else 1)  # a hidden state between layers
    vocab = m.padded_vocab_size(plan.tp)
    logits = plan.mbs * min(chunk, positions) * vocab / plan.tp * \
        logprob_bytes_per_logit(B, plan.tp, vocab != m.vocab_size)
    out = []
    for r in range(plan.pp):
        rm = RankMemory(rank=r, inflight=1.0)
        dense, expert = rank_params(plan, r)
        rm.params, rm.weights = dense + expert, (dense + expert) * weight
        inputs = held * (2 if max(len(c) for c in plan.rank_chunks[r]) > 1 else 1)  # the stage's and a layer's
        peak = inputs + max((forward_layer_bytes(m, i, plan.mbs, plan.seq, sh, traits, plan.ep)
                             for i, _ in forward_layer_groups(plan, r)), default=0.0)
        if r == plan.last_rank:
            rm.logits = logits
            head = held * (plan.pp > 1) + held + hidden + logits  # the stage input, the last layer's output, normed
            peak = max(peak, head)
        rm.activations = peak - rm.logits
        rm.overhead = assume.allocator_overhead * (rm.weights + rm.activations + rm.logits)
        rm.reserve = assume.runtime_reserve
        out.append(rm)
    return out


def forward_peak(plan: Plan, assume: MemoryAssumptions = MemoryAssumptions(), chunk: int = FORWARD_CHUNK) -> RankMemory:
    """The pipeline rank with the largest total (the first such)."""
    return max(forward_memory_per_rank(plan, assume, chunk), key=lambda r: r.total)


def forward_time(plan: Plan, hw: Hardware, ta: TimeAssumptions = TimeAssumptions()) -> StepEstimate:
    """The forward over the config's global batch (module docstring); `step_time` is its seconds."""
    cfg, m = plan.config, plan.config.model
    links = Links(plan, hw, cfg.cluster.gpus_per_node, ta)
    sizes = group_sizes(plan)
    gemm = ta.fp8_gemm_efficiency if plan.precision == "fp8" and ta.fp8_gemm_efficiency else ta.gemm_efficiency
    flops_rate = hw.achievable_flops(plan.precision) * gemm
    ranks = [_rank_forward(plan, r, links, sizes, flops_rate) for r in range(plan.pp)]
    times = [sum(parts.values()) for parts, _ in ranks]
    n_mb = plan.microbatches
    total = forward_pipeline_time(plan.schedule, times, plan.vpp, n_mb, plan.group)
    worst = times.index(max(times))
    parts = {k: v * n_mb for k, v in ranks[worst][0].items()}
    parts["bubble"] = total - n_mb * times[worst]
    sent = {k: v * n_mb for k, v in ranks[worst][1].items()}
    tokens = cfg.training.global_batch_size * plan.seq
    flops = forward_flops_per_token(m, plan.seq) * tokens
    per_gpu = total * plan.world
    return StepEstimate(step_time=total, model_flops=flops, mfu=flops / (per_gpu * hw.peak_flops(plan.precision)),
                        tokens_per_s_per_gpu=tokens / per_gpu, tflops_per_gpu=flops / per_gpu / 1e12,
                        bubble_fraction=forward_bubble_fraction(plan.schedule, plan.pp, plan.vpp, n_mb, plan.group),
                        parts=parts, comm_bytes=sent, links=links.names)


def _rank_forward(plan: Plan, r: int, links: Links, sizes: dict[str, int], flops_rate: float) -> tuple[dict, dict]:
    """(seconds by part, wire bytes by part) of pipeline rank r's forward of one microbatch."""
    parts = {"compute": 0.0, **dict.fromkeys(("tp", "cp", "ep", "pp"), 0.0)}
    sent = dict.fromkeys(("tp", "cp", "ep", "pp"), 0.0)
    for i, n in forward_layer_groups(plan, r):
        compute, layer_parts, layer_sent = layer_forward_cost(plan, links, sizes, i, flops_rate)
        parts["compute"] += compute * n
        for k in sent:
            parts[k] += layer_parts[k] * n
            sent[k] += layer_sent[k] * n
    if r == plan.last_rank:
        head = output_forward_flops(plan.config.model) * plan.mbs * plan.seq / (plan.tp * plan.cp)
        parts["compute"] += head / flops_rate
    stage_parts, stage_sent = stage_forward_cost(plan, links, sizes, r)
    for k in sent:
        parts[k] += stage_parts[k]
        sent[k] += stage_sent[k]
    return parts, sent


def evaluate_forward(cfg: Config, hw: Hardware, mem: MemoryAssumptions = MemoryAssumptions(),
                     ta: TimeAssumptions = TimeAssumptions(), chunk: int = FORWARD_CHUNK) -> Candidate:
    """Check, size and time `cfg` as a forward-only model (`forward_config`); `problem` says why it is
    dropped (a broken rule, or how many GiB over)."""
    broken = config_errors(cfg)
    if broken:
        return Candidate(cfg, RankMemory(rank=0), problem="; ".join(broken))
    cfg = forward_config(cfg)
    plan = Plan(cfg)
    sized = forward_peak(plan, mem, chunk)
    if sized.total > hw.memory_bytes:
        over = (sized.total - hw.memory_bytes) / GiB
        return Candidate(cfg, sized, problem=f"needs {sized.total / GiB:.1f} GiB on pipeline rank {sized.rank}, "
                                             f"{over:.1f} GiB over the {hw.memory_bytes / GiB:.0f} GiB of a {hw.name}")
    return Candidate(cfg, sized, estimate=forward_time(plan, hw, ta))
