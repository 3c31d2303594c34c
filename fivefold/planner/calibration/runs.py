"""The published GPU training runs (benchmarks/data/gpu-runs.tsv) as rows (`Run`), and what the
planner is told about them beyond the table: the rows excluded and added after the fit, the
options each source states in its notes, the hardware and runtime each ran on, each source's FLOP
count and memory basis. `cases.py` reads a row as planner inputs.
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import UserError


RUNS = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "gpu-runs.tsv"
EXCLUDED: dict[int, str] = {
    10: "strong-scaling start point: TP/PP/DP not stated (the figure has no numeric labels)",
    11: "strong-scaling end point: TP/PP/DP not stated",
    15: "DeepSeek-V3's whole pre-training cost in GPU-hours: failures, restarts and evaluation are inside "
        "the figure, on DeepSeek's HAI-LLM (a runtime the planner has no profile of); DP, CP and micro-batch "
        "not stated",
    27: "torchtitan 'Interleaved 1F1B': the stages per rank are not stated, and they set both the bubble "
        "and the memory",
    46: "Table 5 (activation offload): GPU type, GPU count, sequence and batch not stated",
    **{row: "float8 rowwise: ran at the bf16 rate (70B vanilla TP 599.6 against bf16's 597.3 and tensorwise's "
            "809.8), a known slowness of that torchao / torchtitan version (the source's note, torchtitan issue "
            "1207); the planner's fp8 rate is one per runtime, fitted on tensorwise rows"
       for row in (58, 59, 64, 65)},
}
"""Row (1-based, data rows of gpu-runs.tsv) -> why the planner is not judged on it."""

OUT_OF_SAMPLE: dict[int, str] = {
    row: "added from torchtitan's June 2025 async-TP tables (70B float8 tensorwise; 8B bf16 and "
         "float8 tensorwise) after the runtime profiles were fitted: predicted, not fitted"
    for row in (56, 57, 60, 61, 62, 63)}
"""Rows judged as predictions of the fitted constants and left out of the fit (`benchmarks/calibrate.py
--fit`): a check on rows the constants never saw. A refit may take them in (docs/planner_calibration.md)."""

RECOMPUTE_MODULES_OF: dict[int, tuple[tuple[str, ...], str]] = {
    **{row: (("mlp",), "recompute mlp") for row in (37, 38)},
    39: (("mlp", "mla_up_proj", "moe_act", "layernorm"), "recompute per Table 17 mlp/mla_up_proj/moe_act/layernorm"),
    **{row: (("moe_act", "layernorm"), "recompute moe_act,layernorm") for row in (41, 42, 43, 44)},
    **{row: (("layernorm", "moe_act"), "recompute cell 'norm, act'") for row in (47, 48, 50)},
    **{row: (("layernorm", "moe"), "recompute layernorm,moe") for row in (52, 53, 54, 55)},
}
"""Rows whose selective recompute names Megatron's --recompute-modules (the source's words); the
others recompute the attention core (Megatron's default)."""

MEMORY_OPTIONS_OF: dict[int, tuple[dict, str]] = {
    37: ({"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True, "fp8_param_gather": True,
          "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"},
         "notes: optimizer-state offload + FP8 primary weights + BF16 optimizer states (Table 18; the offloaded "
         "share not stated: 1.0, Megatron's default)"),
    38: ({"use_precision_aware_optimizer": True, "optimizer_cpu_offload": True, "exp_avg_dtype": "bf16",
          "exp_avg_sq_dtype": "bf16"},
         "assumed: Table 18's optimizer-state offload and BF16 optimizer states, as row 37 (the same model on the "
         "same GB200s; the report does not list the BF16 run's memory options)"),
    41: ({"fine_grained_activation_offloading": True, "offload_modules": ["expert_fc1", "moe_act"]},
         "notes: the ModelZoo readme says this config needs activation offloading (expert_fc1, moe_act)"),
}
"""Rows whose source (or, marked assumed, a sibling row) names memory options beside the layout:
TrainingConfig fields and the words they come from."""

A2A_OVERLAP_OF: dict[int, str] = {
    36: "notes: 1F1B A2A overlap ON", 39: "notes: DeepEP + EP A2A overlap", 41: "notes: 1F1B overlap ON",
    43: "notes: 1F1B A2A overlap ON", 48: "notes: +1F1B A2A overlap (row 47 is the same run without it)",
}
"""Rows that ran Megatron's 1F1B all-to-all overlap (--overlap-moe-expert-parallel-comm), the
source's words; the other MoE rows did not (37, 40, 52-55 say OFF, 47 is row 48 without it, the
rest do not say: Megatron's default, off)."""

TP_OVERLAP_OF: dict[int, tuple[bool, str]] = {
    **{row: (True, "flags stated: --tp-comm-overlap") for row in range(2, 10)},
    24: (False, "notes: '2D' plain TP"), 25: (True, "notes: '2D + AsyncTP'"),
    **{row: (True, "notes: AsyncTP") for row in (26, 28, 29, 30, 31)},
    32: (False, "notes: vanilla TP"), 33: (True, "notes: async TP"),
    **{row: (row % 2 == 1, "notes: async TP" if row % 2 else "notes: vanilla TP") for row in range(56, 66)},
}
"""Rows with TP whose source says whether it overlapped the TP communication with the GEMMs (Megatron's
--tp-comm-overlap, torchtitan's async TP: `ParallelConfig.tp_comm_overlap`), the source's words; the
other rows with TP are taken to overlap it (`case_of` lists the assumption): the Llama 3 stack is read as
Megatron-like, and Megatron's performance recipes turn it on with TP."""

LLAMA3_VPP = 8
LLAMA3_LAYOUT = "E|(t|)*126L"
"""Llama 3 405B's pipeline (s3.3.2, not stated as numbers): 126 layers on 16 ranks, "one Transformer
layer fewer" on the first and the last stage, so that "the first model chunk on the first stage has
only the embedding, and the last model chunk on the last stage has only output projection and loss":
chunks of one layer, 128 / 16 = 8 a rank, in Megatron's layout string."""

CP_COMM_OF: dict[int, tuple[str, str]] = {
    14: ("allgather", "notes: CP is all-gather-KV based (Llama 3 s3.3.2: K and V all-gathered, exposed, then "
                      "attention over the local query chunks)"),
}
"""Rows whose context parallelism is not Megatron's default p2p ring: the exchange and the source's words."""

HARDWARE = {"H100": "h100-sxm", "H100-80GB-HBM3 (700W)": "h100-sxm", "H800": "h800", "H200": "h200",
            "H100-96GB-HBM2e (500W)": "h100-96gb-500w", "GB200": "gb200", "GB300": "gb300"}
"""The set's `system` column -> hardware preset."""

RUNTIME = {"MLM-README": "megatron-te", "LLAMA3": "megatron-te", "MCORE-MOE-2603": "megatron-te",
           "MOE-ZOO": "megatron-te", "TT-2412": "torchtitan", "TT-ASYNCTP-2506": "torchtitan",
           "TT-H200-2506": "torchtitan", "DSV3": "hai-llm"}
"""Source -> the runtime that ran it (Llama 3's in-house stack is read as Megatron-like: TP comm
overlap, FSDP-style sharding of gradients and optimizer)."""

FLOP_COUNTS = {"MLM-README": "full", "LLAMA3": "causal", "MCORE-MOE-2603": "causal", "MOE-ZOO": "causal"}
"""Source -> how its TFLOP/s count attention: 'causal' (QK^T and AV over s/2 keys, ours) or 'full'
(over all s keys: Megatron-LM r0.8's num_floating_point_operations, the README's software). The MoE
sources print tokens/s (or step time) beside TFLOP/s: their FLOPs per token match the causal count
(benchmarks/calibrate.py prints the check). Llama 3's convention is not stated: causal assumed."""

MEMORY_BASIS = {"TT-2412": "reserved GiB", "TT-ASYNCTP-2506": "reserved GiB", "TT-H200-2506": "reserved GiB",
                "MCORE-MOE-2603": "tensor GB"}
"""Source -> what its memory figure counts (module docstring)."""


@dataclass(frozen=True)
class Run:
    """One row of gpu-runs.tsv, as printed ('-' -> None)."""
    row: int
    cells: dict[str, str]

    def get(self, column: str) -> str | None:
        v = self.cells[column].strip()
        return None if v in ("-", "") else v

    def num(self, column: str) -> float | None:
        v = self.get(column)
        return None if v is None else float(v)

    @property
    def source(self) -> str:
        return self.cells["source_id"]


def read_runs(path: Path = RUNS) -> list[Run]:
    lines = path.read_text().splitlines()
    header = lines[0].lstrip("#").split("\t")
    rows = list(csv.reader(lines[1:], delimiter="\t", quoting=csv.QUOTE_NONE))
    for i, cells in enumerate(rows, 1):
        if len(cells) != len(header):
            raise UserError(f"{path}: data row {i} has {len(cells)} cells, the header {len(header)}")
    return [Run(i, dict(zip(header, cells))) for i, cells in enumerate(rows, 1)]
