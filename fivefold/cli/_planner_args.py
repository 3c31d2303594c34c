"""Arguments `fivefold plan` and `fivefold estimate` share: the cluster, the GPU, calibration."""
from __future__ import annotations

import argparse
import math
from dataclasses import replace

from fivefold.errors import UserError
from fivefold.planner.memory.kinds import MemoryAssumptions
from fivefold.planner.presets.hardware import Hardware, hardware
from fivefold.planner.calibration.runtime import PROFILES, profile
from fivefold.planner.time.time_assumptions import TimeAssumptions

GiB = 2**30
SEQ = 4096
"""Tokens per sequence where the user gives none: `plan`'s default, and `estimate`'s in place of the
canonical config's 64 (a size for CPU test runs, not a GPU run's)."""


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a size, a count)."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a whole number >= 1")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a capacity, a rate)."""
    v = float(text)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number > 0")
    return v


def add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware and calibration")
    g.add_argument("--gpu", default="h100-sxm", help="preset (h100-sxm, h100-pcie, h200, a100-40gb, a100-80gb, "
                   "b200, h800, h100-96gb-500w, gb200, gb300, mi300x) or a hardware YAML. Default h100-sxm")
    g.add_argument("--gpus-per-node", type=positive_int, default=None, help="GPUs per node. Default 8")
    g.add_argument("--gpu-memory-gib", type=positive_float, help="override HBM capacity (GiB)")
    g.add_argument("--bf16-tflops", type=positive_float, help="override peak dense bf16 TFLOP/s")
    g.add_argument("--fp8-tflops", type=positive_float, help="override peak dense fp8 TFLOP/s")
    g.add_argument("--matmul-ceiling", type=float, default=None,
                   help="the best bf16 matmul measured on your GPU (e.g. ml-engineering's mamf-finder.py) as a "
                        "share of its peak; the achieved shares of --runtime are shares of it. Default: the "
                        "preset's (0.803 for an H100)")
    g.add_argument("--intra-node-gbs", type=positive_float, help="override intra-node GB/s per GPU per direction")
    g.add_argument("--network-gbs", type=positive_float, help="override network GB/s per GPU per direction")
    g.add_argument("--runtime", default="fivefold", choices=tuple(PROFILES),
                   help="the runtime whose memory and speed to predict: fivefold (ours), megatron-te "
                        "(Megatron-Core + TransformerEngine), torchtitan; docs/planner_calibration.md. "
                        "Default fivefold")
    g.add_argument("--gemm-efficiency", type=float, default=None,
                   help="achieved share of the GPU's measured matmul ceiling (MAMF) for linear GEMMs "
                        "(calibrate from a measured step). "
                        f"Default: the runtime's ({TimeAssumptions.gemm_efficiency} for fivefold)")
    g.add_argument("--comm-efficiency", type=float, default=None,
                   help=f"achieved share of link bandwidth. Default: the runtime's ({TimeAssumptions.comm_efficiency})")
    g.add_argument("--allocator-overhead", type=float, default=None,
                   help="share of tensor memory lost to fragmentation. Default: the runtime's "
                        f"({MemoryAssumptions.allocator_overhead} for fivefold)")


def hardware_of(args) -> Hardware:
    if args.matmul_ceiling is not None and not 0 < args.matmul_ceiling <= 1:
        raise UserError(f"--matmul-ceiling={args.matmul_ceiling} must be in (0, 1] (a share of the bf16 peak)")
    hw = hardware(args.gpu, {"memory_gib": args.gpu_memory_gib, "bf16_tflops": args.bf16_tflops,
                             "fp8_tflops": args.fp8_tflops, "intra_node_gbs": args.intra_node_gbs,
                             "network_gbs": args.network_gbs, "matmul_ceiling": args.matmul_ceiling})
    return hw


def assumptions_of(args) -> tuple[MemoryAssumptions, TimeAssumptions]:
    """The runtime profile's memory and time assumptions, with the flags the user gave over them."""
    rt = profile(args.runtime)
    for name in ("gemm_efficiency", "comm_efficiency"):
        v = getattr(args, name)
        if v is not None and not 0 < v <= 1:
            raise UserError(f"--{name.replace('_', '-')}={v} must be in (0, 1]")
    if args.allocator_overhead is not None and not 0 <= args.allocator_overhead < 1:
        raise UserError(f"--allocator-overhead={args.allocator_overhead} must be in [0, 1) (a share of tensor memory)")
    mem = rt.memory if args.allocator_overhead is None else replace(rt.memory, allocator_overhead=args.allocator_overhead)
    given = {k: getattr(args, k) for k in ("gemm_efficiency", "comm_efficiency") if getattr(args, k) is not None}
    return mem, replace(rt.time, **given)
