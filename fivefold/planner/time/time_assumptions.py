"""What the step-time model assumes of a runtime (`TimeAssumptions`): achieved shares of the GPU's measured
ceilings and of link bandwidth, latencies, memory-bound passes and overlaps. A runtime profile
(fivefold.planner.calibration.runtime) is one set of these, fitted to measured runs (benchmarks/calibrate.py)."""
from __future__ import annotations

from dataclasses import dataclass

from fivefold.frozen import hashed_once


@hashed_once
@dataclass(frozen=True)
class TimeAssumptions:
    gemm_efficiency: float = 0.75
    """Achieved share of the measured matmul ceiling (`Hardware.achievable_flops`) for the model's GEMMs
    and attention. Default 0.75: 0.6 of an H100's bf16 peak (its ceiling is 80.3% of it)."""
    comm_efficiency: float = 0.8
    """Achieved share of link bandwidth for collectives and p2p. Default 0.8."""
    intra_latency: float = 5e-6
    """Seconds per collective step inside a node. Default 5 us."""
    network_latency: float = 15e-6
    """Seconds per collective step across nodes. Default 15 us."""
    optimizer_bytes_per_param: float = 30.0
    """HBM bytes the Adam step moves per local parameter. Default 30."""
    fp8_gemm_efficiency: float | None = None
    """Achieved share of the fp8 matmul ceiling for linear-layer GEMMs under fp8 (quantisation, scaling
    and casts included); None = gemm_efficiency."""
    attention_efficiency: float | None = None
    """Achieved share of the bf16 matmul ceiling for the attention core (a flash kernel: bf16 under
    every recipe); None = gemm_efficiency."""
    attention_half_keys: float = 0.0
    """Keys per attention-kernel call at which the flash kernel reaches half of its rate:
    attention_efficiency x L / (L + this), L = the sequence, or one ring step's chunk (s / P) under a
    p2p CP ring (an all-to-all CP keeps the whole sequence, fewer heads). Short calls spend more of
    their time loading queries, writing outputs and on masked diagonal tiles. 0 = no length effect."""
    expert_efficiency: float | None = None
    """Achieved share of the matmul ceiling for routed-expert (grouped) GEMMs with many rows per expert;
    None = gemm_efficiency."""
    expert_half_rows: float = 0.0
    """Rows per expert (token copies on one expert per microbatch) at which grouped GEMMs reach half
    of `expert_efficiency`: efficiency x n / (n + this). 0 = no size effect."""
    membound_passes: float = 0.0
    """Memory-bound work (norms, activation functions, RoPE, router, permutation, casts, residual
    adds): HBM passes over each layer's activations per microbatch, forward + backward, at HBM
    bandwidth. 0 = not charged."""
    tp_overlap: float = 0.0
    """Share of TP / SP (and expert-TP) traffic hidden behind GEMMs (TE userbuffers, async TP) where the
    config turns the overlap on (`ParallelConfig.tp_comm_overlap`); without it none is."""
    ep_overlap: float = 0.0
    """Share of the EP all-to-all hidden behind compute without the 1F1B all-to-all overlap (what the
    dispatcher hides by itself: shared experts, its own send / receive halves)."""
    ep_overlap_1f1b: float | None = None
    """Share hidden with Megatron's 1F1B all-to-all overlap (`overlap_moe_expert_parallel_comm`: one
    microbatch's dispatch / combine beside another's compute); None = ep_overlap (no such overlap)."""
    op_level_sac: bool = False
    """Selective recompute is torchtitan's op-level SAC (`ArchTraits.op_level_sac`), not Megatron's modules."""
    cp_overlap: float = 1.0
    """Share of the attention core's time the CP ring can hide behind (1: all of it, a ring whose
    transfers run beside every block's kernel; less where the runtime serialises them)."""
