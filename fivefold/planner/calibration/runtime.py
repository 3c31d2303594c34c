"""Runtime profiles: the planner predicts a named runtime, not an abstract GPU.

A profile is the runtime's precision policy, how it stores activations, the allocator's slack, and
its achieved rates per op class and overlap per collective (`TimeAssumptions`):

  fivefold     our runtime as it is (eager PyTorch; fp32 gradients; nothing overlapped but the CP ring
               and the DP reduction); on CPU the measured checks use `memory.kinds.CPU_EAGER`.
  megatron-te  Megatron-Core with TransformerEngine: fused kernels, fp8 linear inputs saved as fp8,
               TP communication overlapped (userbuffers), grouped expert GEMMs, the EP all-to-all
               overlapped with the other micro-batch's compute where enabled, bf16 gradient
               reduction (Megatron-Bridge's performance configs: --grad-reduce-in-bf16), the
               distributed optimizer, PYTORCH_CUDA_ALLOC_CONF=expandable_segments (little slack).
  torchtitan   FSDP2 (fp32 reduce), torch.compile'd blocks, torchao Float8Linear (fp8 GEMMs,
               16-bit saved inputs), async TP's share of the TP traffic hidden where a run turns it on.

Both GPU runtimes hide their TP share only where the config overlaps TP communication
(`ParallelConfig.tp_comm_overlap`: --tp-comm-overlap, async TP); their searches turn it on.

The time constants marked fitted come from `python benchmarks/calibrate.py --fit`: a least-squares fit
of log(estimated / published tokens/s) over the rows of gpu-runs.tsv that ran on that runtime (docs/
planner_calibration.md names the rows); the others are physical defaults. Nothing is fitted per row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from fivefold.config.schema import Config
from fivefold.errors import UserError
from fivefold.planner.memory.traits import EAGER_TRAITS, ArchTraits
from fivefold.planner.memory.kinds import MemoryAssumptions
from fivefold.planner.search.space import SearchSpace, megatron_fsdp
from fivefold.planner.time.time_assumptions import TimeAssumptions

GiB = 2**30


@dataclass(frozen=True)
class Runtime:
    name: str
    memory: MemoryAssumptions
    time: TimeAssumptions
    grad_reduce_in_bf16: bool
    """Gradients accumulated and reduced in bf16 (16-bit runs)."""
    summary: str
    dp_modes: tuple[str, ...] = ("optim",)
    """The data-parallel modes the search tries (`SearchSpace.dp_modes`): the distributed optimizer for
    Megatron and ours, FSDP2 (ZeRO-3) for torchtitan."""
    cp_comm_types: tuple[str, ...] = ("p2p", "a2a")
    """The context-parallel exchanges the runtime has (`SearchSpace.cp_comm_types`): torchtitan's
    context parallelism is ring attention only (no head all-to-all)."""
    a2a_overlap: bool = False
    """The runtime has Megatron's 1F1B all-to-all overlap (`SearchSpace.a2a_overlap`)."""
    tp_comm_overlap: bool = False
    """The runtime overlaps TP communication with the GEMMs and its search turns it on
    (`SearchSpace.tp_comm_overlap`; the share it hides: `TimeAssumptions.tp_overlap`)."""
    dispatcher: str | None = None
    """The runtime sends the EP exchange as the config's `moe_token_dispatcher_type` says, and its
    search uses this one (megatron-te: flex, DeepEP / HybridEP, as Megatron's MoE runs across nodes
    do); None: its own all-to-all whatever the config says (`apply`)."""
    group_rule: str = "megatron"
    """How its interleaved schedule groups microbatches (`SearchSpace.group_rule`): torchtitan's is
    torch.distributed.pipelining's equal rounds."""
    megatron_fsdp: bool = False
    """Its ZeRO-2/3 is Megatron-FSDP, which reduce-scatters the gradients after every microbatch's
    backward also under PP (`training.use_megatron_fsdp`, `Plan.reduce_every_microbatch`); ours and
    torchtitan's FSDP2 under torch.distributed.pipelining reduce once a step under PP."""

    def space(self, **fields) -> SearchSpace:
        """The search space of this runtime's modes, with `fields` set (they win)."""
        return SearchSpace(**{"dp_modes": self.dp_modes, "cp_comm_types": self.cp_comm_types,
                              "a2a_overlap": self.a2a_overlap, "tp_comm_overlap": self.tp_comm_overlap,
                              "dispatcher": self.dispatcher or "alltoall",
                              "group_rule": self.group_rule, "megatron_fsdp": self.megatron_fsdp, **fields})


_TE_TRAITS = ArchTraits(fp8_linear_inputs=True, expert_outputs_saved=False, fp8_weight_cache=True)
"""Fused RMSNorm / SwiGLU / cross entropy (Megatron's counts), flash attention, fp8 linear inputs and
cached fp8 weights, memory-efficient permutation (the router weights applied before the experts'
down-projection)."""
_TT_SAC = True
"""torchtitan's selective recompute: `selective_ac_option = "op"` (its default), in memory and in time."""
_TT_TRAITS = ArchTraits(op_level_sac=_TT_SAC, fsdp_root_whole=True)
"""Megatron's counts for compiled blocks, flash attention, 16-bit saved inputs (torchao float8),
selective recompute as torchtitan's default `selective_ac_option = "op"`, and FSDP2's root unit kept
gathered through the microbatch."""

_FLASH_HALF_KEYS = 1280.8
"""Keys per call at which a flash kernel runs at half its rate (`TimeAssumptions.attention_half_keys`):
fitted on torchtitan's rows (with plain and async TP told apart), whose CP sweep (rows
28-31: 405B at 8192 tokens, CP 1-8, calls of 8192 down to 1024 keys) pins it; Megatron's rows hardly
move it (their fit is as good with it as at 0: median 7.3% vs 7.2%), so its profile takes the same
kernel-level constant."""

PER_TENSOR_OPTIMIZER_BYTES = 145.5
"""Our step's optimizer work per parameter with the per-tensor optimizer (fp64 gradient norm and clipping a
tensor at a time, per-tensor AdamW on fp32 main parameters, the bf16 copy back, zeroing the gradient
buffer), in bytes at 0.8 of HBM bandwidth: the profiler's kernel times on an H200. The GPU rows measured
with it (benchmarks/data/gpu, optimizer per-tensor) are checked with it."""

_GROUPED_HALF_ROWS = 2390.8
"""Rows per expert at which grouped expert GEMMs run at half their rate (`TimeAssumptions.expert_half_rows`):
fitted on Megatron's MoE rows (benchmarks/calibrate.py --fit: megatron-te's expert_efficiency 1.0 at many
rows); our runtime's grouped GEMM (torch._grouped_mm, CUTLASS) takes the same kernel-level curve."""
_MEASURED_KEYS = 4096
"""The attention calls' keys where our runtime's attention rate was measured (`_OURS_ON_HOPPER`)."""
_OURS_ON_HOPPER = TimeAssumptions(gemm_efficiency=0.987,
                                  attention_efficiency=0.376 * (_MEASURED_KEYS + _FLASH_HALF_KEYS) / _MEASURED_KEYS,
                                  attention_half_keys=_FLASH_HALF_KEYS, expert_efficiency=1.0,
                                  expert_half_rows=_GROUPED_HALF_ROWS, membound_passes=25.3,
                                  optimizer_bytes_per_param=52.1)
"""Our eager runtime's rates, measured per op class on an H200 (torch 2.11, bf16, one GPU; the profiler's
kernel times of a 4-layer ~1B-wide Llama at seq 4096, benchmarks/RESULTS.md "fivefold on one GPU"):
cuBLAS GEMMs at 0.987 of the matmul ceiling, cuDNN's SDPA at 0.376 at 4096 keys (the kernels' length
curve, `_FLASH_HALF_KEYS`, through that point: shorter calls, a CP ring's chunks, run slower; grouped
expert GEMMs on the kernels' rows curve, `_GROUPED_HALF_ROWS`: no expert was timed), the unfused norms,
SwiGLU, RoPE, casts and residual adds 25.3 passes over the layer's activations (Megatron's counts) at
HBM bandwidth. The optimizer (torch's fused AdamW, one multi-tensor gradient norm): 52.1 bytes per
parameter at 0.8 of HBM bandwidth, from the same 4-layer run's step on an H100 before and after the
change (35.8 -> 27.3 ms: PER_TENSOR_OPTIMIZER_BYTES less the 8.5 ms saved); AdamW's own traffic is 28
(read parameter, gradient, two moments; write three), the norm, clip, bf16 copy and zeroing ~22 more.
Measured on one shape: other GEMM and sequence sizes are extrapolated."""

PROFILES: dict[str, Runtime] = {r.name: r for r in [
    # the eager implementation's saved tensors (EAGER_TRAITS) on a GPU too: a ~1B Llama in bf16 on an H200,
    # 4 / 8 / 16 layers, measured 1.012 / 1.007 / 1.004 of this estimate's allocated bytes (Megatron's
    # fused counts: 1.137 / 1.117 / 1.107); benchmarks/RESULTS.md, "fivefold on one GPU"
    Runtime("fivefold", MemoryAssumptions(traits=EAGER_TRAITS), _OURS_ON_HOPPER, grad_reduce_in_bf16=False,
            summary="our runtime: eager kernels, fp32 gradients, TP/EP traffic exposed"),
    Runtime("megatron-te",
            MemoryAssumptions(allocator_overhead=0.02, runtime_reserve=1.0 * GiB, traits=_TE_TRAITS),
            # fitted on rows 1-9, 12-14, 36-44, 47-55 (benchmarks/calibrate.py --fit)
            TimeAssumptions(gemm_efficiency=0.865, fp8_gemm_efficiency=0.625, attention_efficiency=0.67,
                            attention_half_keys=_FLASH_HALF_KEYS, expert_efficiency=1.0,
                            expert_half_rows=_GROUPED_HALF_ROWS, membound_passes=11.44, tp_overlap=0.898,
                            ep_overlap=0.438, ep_overlap_1f1b=0.676),
            grad_reduce_in_bf16=True,
            summary="Megatron-Core + TransformerEngine: fused kernels, fp8 linear inputs, TP comm overlap, "
                    "grouped GEMM, bf16 gradient reduction, distributed optimizer, 1F1B all-to-all overlap "
                    "where allowed, the token dispatcher the config names (flex in its search)",
            a2a_overlap=True, dispatcher="flex", megatron_fsdp=True, tp_comm_overlap=True),
    Runtime("torchtitan",
            MemoryAssumptions(allocator_overhead=0.05, runtime_reserve=1.0 * GiB, traits=_TT_TRAITS),
            # fitted on rows 16-26, 28-35 (benchmarks/calibrate.py --fit --runtime torchtitan)
            TimeAssumptions(gemm_efficiency=0.787, fp8_gemm_efficiency=0.842, attention_efficiency=0.22,
                            attention_half_keys=_FLASH_HALF_KEYS, membound_passes=13.23, tp_overlap=0.081,
                            cp_overlap=1.0, op_level_sac=_TT_SAC),
            grad_reduce_in_bf16=False,
            summary="torchtitan: FSDP2 (fp32 reduce), torch.compile, torchao float8, async TP",
            dp_modes=("optim_grads_params",), cp_comm_types=("p2p",), group_rule="rounds", tp_comm_overlap=True),
]}


def profile(name: str) -> Runtime:
    if name not in PROFILES:
        raise UserError(f"--runtime {name!r}: unknown; choose from {', '.join(PROFILES)}")
    return PROFILES[name]


EAGER_LOSS_PARALLEL_TRANSIENT = 12.0
"""torch.distributed.tensor.parallel.loss_parallel's cross entropy on fp32-cast, vocab-sharded logits,
eager: 16 bytes per local logit at its peak (4 held: the log-softmax) against F.cross_entropy's 12
(measured on CPU, torch 2.13, 2 gloo ranks, from the profiler's allocation events: 512 vs 384 MiB for
4096 x 8192 local logits)."""


def with_eager_loss(rt: Runtime) -> Runtime:
    """`rt` whose loss is eager `F.cross_entropy` on the logits cast to fp32 (torchtitan before it compiled
    its loss): at the loss's backward the saved fp32 log-softmax, its incoming gradient and the logits'
    gradient, 12 bytes a logit (`traits.EAGER_TRAITS`' count, measured on our eager runtime), not
    a fused kernel's 16-bit logits and fp32 softmax; under TP, torch's DTensor loss_parallel run eagerly,
    16 at its peak (`ArchTraits.tp_loss_transient_bytes`)."""
    traits = replace(rt.memory.traits, loss_bytes_per_logit=EAGER_TRAITS.loss_bytes_per_logit,
                     loss_transient_bytes=EAGER_TRAITS.loss_transient_bytes,
                     tp_loss_transient_bytes=EAGER_LOSS_PARALLEL_TRANSIENT)
    return replace(rt, memory=replace(rt.memory, traits=traits))


def with_time(rt: Runtime, **constants: float) -> Runtime:
    """`rt` with some time constants replaced (the fit's trial points)."""
    return replace(rt, time=replace(rt.time, **constants))


def apply(cfg: Config, rt: Runtime, stated_fp32_grads: bool = False) -> Config:
    """`cfg` as `rt` runs it: bf16 gradients where the runtime reduces in bf16, unless the run states
    its own (`stated_fp32_grads`: Llama 3's fp32 accumulation and reduce-scatter); ZeRO-2/3 as the
    runtime's FSDP (`Runtime.megatron_fsdp`); the EP exchange as an all-to-all where the runtime has
    no other dispatcher (the same `cfg` when nothing changes)."""
    t, p = cfg.training, cfg.parallel
    if rt.dispatcher is None and p.moe_token_dispatcher_type != "alltoall":
        cfg = replace(cfg, parallel=replace(p, moe_token_dispatcher_type="alltoall"))
    changes = {}
    if megatron_fsdp(rt.megatron_fsdp, t.sharding_strategy) != t.use_megatron_fsdp:
        changes["use_megatron_fsdp"] = not t.use_megatron_fsdp
    if t.precision in ("bf16", "fp8") and not (stated_fp32_grads or t.grad_reduce_in_bf16) and rt.grad_reduce_in_bf16:
        changes["grad_reduce_in_bf16"] = True
    return replace(cfg, training=replace(t, **changes)) if changes else cfg
