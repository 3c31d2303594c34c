"""Every Megatron-LM flag, classified: how a Megatron command line is taken here.

The surface (`megatron_surface.txt`, ~880 flags at the pinned commit, written by
scripts/megatron_surface.py from Megatron's own parser: the explicit `add_argument` flags and those
generated from its config dataclasses) says how each flag takes values. Each flag is then one of:

  1. mapped       a canonical field (fivefold.config.megatron.FLAGS);
  2. no effect    accepted, and `validate` lists it with the reason: switches that change speed or
                  memory but not the math (overlap, fusion, kernel choice, CUDA graphs), logging,
                  profiling, checkpoint I/O tuning, and flags that say what fivefold already does
                  (checkpoints with optimizer and RNG state);
  3. not built    changes the math or the run here, not built yet: refused, all such flags in one
                  message ("not implemented yet");
  4. unknown      not Megatron-LM's at that commit: refused with the closest flags.
Some flags are "no effect" for the values fivefold computes anyway (`--rotary-percent 1.0`) and
"not built" for the others (`VALUE_OK`). Model-variant flags (`--swiglu`, `--disable-bias-linear`,
`--position-embedding-type`, dropout, `--apply-layernorm-1p`) are mapped, and what a command line
leaves out is Megatron's default (fivefold.config.megatron_defaults).
"""
from __future__ import annotations

import re
from pathlib import Path

SURFACE_FILE = Path(__file__).with_name("megatron_surface.txt")


def _read_surface() -> dict[str, str]:
    kinds = {}
    for line in SURFACE_FILE.read_text().splitlines():
        if line.startswith("--"):
            flag, kind = line.split()
            kinds[flag] = kind
    return kinds


SURFACE: dict[str, str] = _read_surface()
"""Megatron-LM flag -> switch, value or list."""

NO_EFFECT: list[tuple[str, str]] = [  # (regular expression over the flag, why it changes no math here)
    (r"--(no-|disable-)?(overlap|tp-comm|align-grad|align-param|delay-wgrad|defer-embedding)[-a-z0-9]*",
     "communication overlap: a schedule choice, the same sums"),
    (r"--(no-)?[-a-z0-9]*-fusion(-impl|-into-hybridep)?|--(no-)?(bias-[a-z]+|masked-softmax|rope|gradient-accumulation)-fusion",
     "kernel fusion: the same math"),
    (r"--(use-flash-attn|flash-attention-version|attention-backend|transformer-impl|use-mcore-models|"
     r"use-grouped-gemm-for-[-a-z]+|moe-flex-dispatcher-[-a-z]+|"
     r"moe-shared-expert-overlap|mla-down-proj-fusion|use-cpu-initialization|ddp-bucket-size|ddp-num-buckets|"
     r"ddp-pad-buckets-for-high-nccl-busbw|ddp-average-in-collective|distributed-backend|local-rank|"
     r"num-workers|dataloader-[-a-z]+|data-cache-path|no-mmap-bin-files|mmap-bin-files|"
     r"(no-)?create-attention-mask-in-dataloader|empty-unused-memory-level|deterministic-mode|group-query-attention)",
     "kernel, dispatcher or runtime choice: fivefold runs its own, with the same math"),
    (r"--[-a-z0-9]*cuda-graph[-a-z0-9]*|--enable-cuda-graph|--external-cuda-graph",
     "CUDA graphs: a launch optimisation"),
    (r"--(no-)?(log|tensorboard|wandb|timing|nvtx|profile|pytorch-profiler|use-pytorch-profiler|record-memory|"
     r"straggler|disable-straggler|check-weight-hash|barrier-with|exit-signal|"
     r"log-straggler|indexer-log)[-a-z0-9]*",
     "logging, profiling or housekeeping (fivefold writes metrics.jsonl and TensorBoard; --profile is mapped)"),
    (r"--(async-ckpt|ckpt|dist-ckpt|non-persistent|use-persistent-ckpt|use-dist-ckpt|auto-detect-ckpt|"
     r"no-ckpt|disable-ckpt|no-save-tokenizer)[-a-z0-9]*",
     "checkpoint format and I/O: fivefold writes its own safetensors checkpoints (any layout loads any other)"),
    (r"--(no-save-optim|no-save-rng)", "checkpoints here hold the optimizer and RNG state anyway (larger files, "
     "the same training)"),
    (r"--rampup-batch-size", "deprecated: Megatron-LM ignores it (megatron/core/num_microbatches_calculator.py); "
     "--step-batch-size-schedule is its replacement"),
    (r"--tiktoken-(pattern|num-special-tokens|special-tokens)",
     "read only by Megatron's TikTokenizer (--tokenizer-type TikTokenizer), which is refused on its own"),
    (r"--fp8-(amax-history-len|amax-compute-algo|margin|interval)",
     "fp8 scaling numerics: the planner sizes and times fp8 by --fp8-format and --fp8-recipe, and `train` refuses "
     "fp8 (not implemented yet)"),
]
_NO_EFFECT = [(re.compile(pattern), why) for pattern, why in NO_EFFECT]

VALUE_OK: dict[str, tuple[set[str], str]] = {
    "--rotary-percent": ({"1", "1.0"}, "the whole head is rotated"),
    "--ckpt-format": ({"torch_dist", "torch", "zarr", "fsdp_dtensor", "torch_dcp"}, "fivefold's own format"),
}
"""Flags accepted for the values fivefold computes anyway; other values are not built."""


def no_effect(flag: str) -> str | None:
    """Why `flag` changes no math here, or None."""
    return next((why for pattern, why in _NO_EFFECT if pattern.fullmatch(flag)), None)
