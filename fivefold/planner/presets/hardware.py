"""Accelerator presets and custom hardware (flags or YAML).

Figures are vendor datasheet peaks for dense math (no 2:4 sparsity), beside the best matmul measured on
the GPU class as a share of them (`matmul_ceiling`, `MAMF_SOURCE`): the time model's achieved shares
are shares of that ceiling, so a share fitted on H100 runs carries to a GB200 whose tensor cores reach a
smaller part of their datasheet peak (72.9% against 80.3%). Link bandwidths are per GPU
and per direction, in bytes/s: `intra_node_bw` is the GPU's share of the node's fabric (NVLink /
Infinity Fabric / PCIe), `network_bw` its NIC (e.g. one 400 Gb/s InfiniBand NDR port = 50 GB/s).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from fivefold.errors import UserError

GiB = 2**30
T = 1e12
GBs = 1e9


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    bf16_flops: float
    """Peak dense bf16 FLOP/s."""
    fp8_flops: float | None
    """Peak dense fp8 FLOP/s; None where the GPU has no fp8 tensor cores."""
    memory_bytes: float
    """HBM capacity (bytes)."""
    memory_bw: float
    """HBM bandwidth (bytes/s)."""
    intra_node_bw: float
    """Per-GPU, per-direction bandwidth inside a node (bytes/s)."""
    network_bw: float
    """Per-GPU, per-direction network bandwidth between nodes (bytes/s)."""
    gpus_per_node: int = 8
    """GPUs in one intra-node domain. Default 8."""
    mxfp8: bool = False
    """Tensor cores that take MXFP8's block scales (Blackwell): what --fp8-recipe mxfp8 needs."""
    matmul_ceiling: float = 1.0
    """The best bf16 matmul measured on this GPU class as a share of its bf16 peak (MAMF, `MAMF_SOURCE`):
    the planner's achieved shares are shares of it. 1.0 = no measurement (the peak is the ceiling)."""
    fp8_matmul_ceiling: float = 1.0
    """The same for fp8 (float8_e4m3fn) matmuls, as a share of the fp8 peak."""
    source: str = ""

    def fp8_recipe_problem(self, precision: str, recipe: str) -> str | None:
        """Why this GPU cannot run fp8 with `recipe` (TransformerEngine: MXFP8 needs compute capability
        10.0, Blackwell), or None."""
        if precision == "fp8" and recipe == "mxfp8" and not self.mxfp8:
            return (f"--fp8-recipe mxfp8 runs on Blackwell tensor cores (b200, gb200, gb300), not on a {self.name}: "
                    "use --fp8-recipe delayed, tensorwise or blockwise")
        return None

    def achievable_flops(self, precision: str) -> float:
        """The matmul ceiling measured on this GPU class at `precision` (FLOP/s): what the planner's
        achieved shares of a runtime multiply."""
        ceiling = self.fp8_matmul_ceiling if precision == "fp8" else self.matmul_ceiling
        return self.peak_flops(precision) * ceiling

    def peak_flops(self, precision: str) -> float:
        if precision == "fp8":
            if self.fp8_flops is None:
                raise UserError(f"{self.name} has no fp8 tensor cores; use --precision bf16")
            return self.fp8_flops
        if precision == "fp32":
            raise UserError("the planner models bf16 or fp8 GEMMs on GPUs; use --precision bf16|fp8")
        return self.bf16_flops


MAMF_SOURCE = ("stas00/ml-engineering compute/accelerator/README.md (744d01e, 2026-08), 'Maximum Achievable Matmul "
               "FLOPS comparison table': the mean of 100 timed iterations at the best shape found, BF16 and FP8")
"""Where every preset's `matmul_ceiling` / `fp8_matmul_ceiling` comes from (the table's Efficiency column)."""
H100_CEILINGS = {"matmul_ceiling": 794.5 / 989, "fp8_matmul_ceiling": 1402.6 / 1979}
"""H100 SXM: 794.5 of 989 TFLOP/s bf16, 1402.6 of 1979 fp8 (`MAMF_SOURCE`); also taken, as an assumption,
for the H100 variants the table has no row for (PCIe, H800, 96 GB at 500 W)."""
GB200_CEILINGS = {"matmul_ceiling": 1822.0 / 2500, "fp8_matmul_ceiling": 3615.6 / 5000}
"""GB200: 1822.0 of 2500 bf16, 3615.6 of 5000 fp8 (`MAMF_SOURCE`); also taken for the GB300, which the
table lacks (same dense bf16 / fp8 peaks in the same NVL72 package; its B300 SXM row, 1769 / 3353 TFLOP/s,
is within 3% of the GB200's in absolute terms)."""

HARDWARE_PRESETS: dict[str, Hardware] = {h.name: h for h in [
    Hardware(name="h100-sxm", **H100_CEILINGS,
             bf16_flops=989.4 * T, fp8_flops=1978.9 * T, memory_bytes=80 * GiB,
             memory_bw=3.35e12, intra_node_bw=450 * GBs, network_bw=50 * GBs,
             source="NVIDIA H100 datasheet (SXM5); NVLink4 900 GB/s bidirectional; 400 Gb/s NDR per GPU"),
    Hardware(name="h100-pcie", **H100_CEILINGS,
             bf16_flops=756.5 * T, fp8_flops=1513 * T, memory_bytes=80 * GiB,
             memory_bw=2.0e12, intra_node_bw=64 * GBs, network_bw=25 * GBs,
             source="NVIDIA H100 datasheet (PCIe); PCIe Gen5 x16 64 GB/s per direction (NVLink bridges "
                    "between GPU pairs not modelled); 200 Gb/s NIC per GPU"),
    Hardware(name="h200", matmul_ceiling=794.5 / 989, fp8_matmul_ceiling=1453.4 / 1979,  # bf16: "H200 is the same"
             bf16_flops=989.4 * T, fp8_flops=1978.9 * T, memory_bytes=141e9,
             memory_bw=4.8e12, intra_node_bw=450 * GBs, network_bw=50 * GBs,
             source="NVIDIA H200 datasheet (SXM); NVLink4 900 GB/s bidirectional; 400 Gb/s NDR per GPU"),
    Hardware(name="a100-40gb", matmul_ceiling=271.2 / 312,  # the table's A100 SXM (80 GB) row
             bf16_flops=312 * T, fp8_flops=None, memory_bytes=40 * GiB,
             memory_bw=1.555e12, intra_node_bw=300 * GBs, network_bw=25 * GBs,
             source="NVIDIA A100 datasheet (SXM4 40GB); NVLink3 600 GB/s bidirectional; 200 Gb/s HDR per GPU"),
    Hardware(name="a100-80gb", matmul_ceiling=271.2 / 312,
             bf16_flops=312 * T, fp8_flops=None, memory_bytes=80 * GiB,
             memory_bw=2.039e12, intra_node_bw=300 * GBs, network_bw=25 * GBs,
             source="NVIDIA A100 datasheet (SXM4 80GB); NVLink3 600 GB/s bidirectional; 200 Gb/s HDR per GPU"),
    Hardware(name="b200", matmul_ceiling=1745.0 / 2250, fp8_matmul_ceiling=3432.5 / 4500,
             mxfp8=True, bf16_flops=2250 * T, fp8_flops=4500 * T, memory_bytes=180e9,
             memory_bw=8.0e12, intra_node_bw=900 * GBs, network_bw=50 * GBs,
             source="NVIDIA DGX/HGX B200 datasheet (per GPU: 1/8 of 72 PF fp8 sparse, 1440 GB, 64 TB/s); "
                    "NVLink5 1.8 TB/s bidirectional; 400 Gb/s per GPU"),
    Hardware(name="h800", **H100_CEILINGS,
             bf16_flops=989.4 * T, fp8_flops=1978.9 * T, memory_bytes=80 * GiB,
             memory_bw=3.35e12, intra_node_bw=200 * GBs, network_bw=50 * GBs,
             source="H100 SXM's compute and HBM with NVLink cut to 400 GB/s bidirectional (the export "
                    "variant); DeepSeek-V3 report s3.1: 8 H800 per node on NVLink/NVSwitch, InfiniBand "
                    "between nodes (400 Gb/s per GPU)"),
    Hardware(name="h100-96gb-500w", **H100_CEILINGS,
             bf16_flops=989.4 * T, fp8_flops=1978.9 * T, memory_bytes=95 * GiB,
             memory_bw=2.4e12, intra_node_bw=450 * GBs, network_bw=50 * GBs,
             source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Grand Teton H100 96GB HBM2e "
                    "at a 500 W power limit, 400 Gb/s RDMA per GPU. Datasheet peaks of the H100 SXM (the "
                    "power cap is not a datasheet figure: it lowers achieved clocks, so it shows in the "
                    "fitted efficiencies); HBM2e bandwidth 2.4 TB/s assumed (6 stacks x 3.2 Gb/s pins); "
                    "capacity 95 GiB as torch reports it (an assumption: the doc prints only usage)"),
    Hardware(name="gb200", **GB200_CEILINGS,
             mxfp8=True, bf16_flops=2500 * T, fp8_flops=5000 * T, memory_bytes=186e9,
             memory_bw=8.0e12, intra_node_bw=900 * GBs, network_bw=50 * GBs, gpus_per_node=72,
             source="NVIDIA GB200 NVL72 datasheet, per GPU (1/72 of the rack): 180 PF dense bf16 / 360 PF "
                    "dense fp8 (MXFP8), 13.4 TB HBM3e, 8 TB/s; NVLink5 1.8 TB/s bidirectional in a 72-GPU "
                    "domain; ConnectX-7 400 Gb/s per GPU"),
    Hardware(name="gb300", **GB200_CEILINGS,
             mxfp8=True, bf16_flops=2500 * T, fp8_flops=5000 * T, memory_bytes=288e9,
             memory_bw=8.0e12, intra_node_bw=900 * GBs, network_bw=100 * GBs, gpus_per_node=72,
             source="NVIDIA GB300 NVL72 datasheet, per GPU: the GB200's dense bf16 / fp8 (the Blackwell "
                    "Ultra gains are in fp4), 288 GB HBM3e, 8 TB/s; NVLink5 1.8 TB/s bidirectional in a "
                    "72-GPU domain; ConnectX-8 800 Gb/s per GPU"),
    Hardware(name="mi300x", matmul_ceiling=668.4 / 1300, fp8_matmul_ceiling=668.4 / 1300,  # fp8 cell empty: bf16's
             bf16_flops=1307.4 * T, fp8_flops=2614.9 * T, memory_bytes=192e9,
             memory_bw=5.3e12, intra_node_bw=448 * GBs, network_bw=50 * GBs,
             source="AMD Instinct MI300X datasheet; Infinity Fabric 7 x 64 GB/s per direction (full mesh, "
                    "modelled as its aggregate); 400 Gb/s per GPU"),
]}
ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200", "a100": "a100-80gb",
           "a100-80g": "a100-80gb", "a100-40g": "a100-40gb",
           "h100-96gb": "h100-96gb-500w", "b200-sxm": "b200"}

# Human units accepted in YAML and flags -> (field, factor).
UNITS = {"bf16_tflops": ("bf16_flops", T), "fp8_tflops": ("fp8_flops", T), "memory_gib": ("memory_bytes", GiB),
         "memory_gb": ("memory_bytes", 1e9), "memory_bw_tbs": ("memory_bw", 1e12),
         "intra_node_gbs": ("intra_node_bw", GBs), "network_gbs": ("network_bw", GBs)}


def with_overrides(base: Hardware, overrides: dict) -> Hardware:
    """`base` with fields replaced; keys are field names or the human units in UNITS, each value of its
    field's kind and range (`_problem`: a zero bandwidth or a memory of -80 GiB was taken)."""
    names = {f.name for f in fields(Hardware)}
    kw = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in UNITS and key not in names:
            raise UserError(f"unknown hardware field {key!r}; use one of {sorted(names | set(UNITS))}")
        field_name, factor = UNITS.get(key, (key, 1))
        problem = _problem(field_name, value)
        if problem:
            raise UserError(f"hardware {key}={value!r}: {problem}")
        kw[field_name] = value * factor if factor != 1 else value
    return replace(base, **kw)


def _problem(field_name: str, value) -> str | None:
    """Why `value` cannot be the Hardware field `field_name`, or None."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if field_name in ("name", "source"):
        return None if isinstance(value, str) else "must be text"
    if field_name == "mxfp8":
        return None if isinstance(value, bool) else "must be true or false"
    if field_name == "gpus_per_node":
        return None if number and value == int(value) and value >= 1 else "must be a whole number >= 1"
    if field_name in ("matmul_ceiling", "fp8_matmul_ceiling"):
        return None if number and 0 < value <= 1 else "must be a share of the peak, in (0, 1]"
    return None if number and value > 0 else "must be a finite number > 0"


def hardware(spec: str, overrides: dict | None = None) -> Hardware:
    """A preset name, or a YAML file with `base: PRESET` (optional) and fields / human units."""
    key = spec.strip().lower()
    key = ALIASES.get(key, key)
    if key in HARDWARE_PRESETS:
        return with_overrides(HARDWARE_PRESETS[key], overrides or {})
    path = Path(spec)
    if path.suffix in (".yaml", ".yml"):
        from fivefold.config.load import parse_yaml  # (not UTF-8, not YAML, not a mapping: refused)
        if not path.is_file():
            raise UserError(f"{spec}: no such hardware YAML")
        data = parse_yaml(path) or {}
        base_name = str(data.pop("base", "h100-sxm"))
        base = hardware(base_name)
        data.setdefault("name", path.stem)
        return with_overrides(with_overrides(base, data), overrides or {})
    raise UserError(f"unknown GPU {spec!r}; known: {', '.join(HARDWARE_PRESETS)} (or a hardware YAML file)")
