"""Published GPU training runs (benchmarks/data/gpu-runs.tsv) read as planner inputs.

Each row of the set becomes a `Case`: a model preset, a hardware preset, a canonical `Config` of the
stated layout, the runtime that ran it, and the published throughput and memory in the planner's
units, with every value the source leaves unstated filled by a named assumption (`Case.assumed`).
Rows the planner cannot be judged on are in `EXCLUDED` with the reason. benchmarks/calibrate.py
compares the planner with the cases; the set's README (benchmarks/data/gpu-runs.md) cites each source.

Throughput is compared as tokens/s per GPU. A source that prints only TFLOP/s (or MFU) is converted
with that source's FLOP count (`FLOP_COUNTS`): the sources with both figures pin theirs down.
Memory is compared like with like (`MEMORY_BASIS`): torchtitan prints the caching allocator's peak
*reserved* bytes in GiB (no CUDA context), the Megatron-Core MoE report a per-GPU breakdown of tensor
bytes in "GB" (read as 10^9; tensors only, no allocator slack).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fivefold.config.schema import ClusterConfig, Config, ModelConfig, ParallelConfig, TrainingConfig
from fivefold.errors import UserError
from fivefold.planner.search.compare import LAYOUT_FIELDS
from fivefold.planner.time.flops import attention_core_flops, model_flops_per_token
from fivefold.planner.layout import Plan
from fivefold.planner.memory.mtp import mtp_stage_layers
from fivefold.config.pipeline_layout import parse_layout
from fivefold.planner.presets import hardware, model_preset
from fivefold.planner.calibration.runtime import Runtime, with_eager_loss
from fivefold.planner.search.space import layer_splits
from fivefold.planner.calibration.runs import (A2A_OVERLAP_OF, CP_COMM_OF, EXCLUDED, FLOP_COUNTS, HARDWARE,
                                               LLAMA3_LAYOUT, LLAMA3_VPP, MEMORY_BASIS, MEMORY_OPTIONS_OF,
                                               RECOMPUTE_MODULES_OF, RUNS, RUNTIME, TP_OVERLAP_OF, Run, read_runs)


GiB = 2**30

@dataclass
class Case:
    run: Run
    model_name: str
    hardware_name: str
    gpus_per_node: int
    config: Config
    runtime: str
    tokens_per_s: float | None
    """Published tokens/s per GPU (converted from TFLOP/s where the source gives only those)."""
    memory_bytes: float | None
    """Published peak memory per GPU, bytes."""
    memory_basis: str | None
    assumed: list[str] = field(default_factory=list)
    """Each unstated field and the value taken for it."""
    unstated: frozenset[str] = frozenset()
    """The `LAYOUT_FIELDS` the source leaves unstated: a layout of `plan`'s search with the stated
    ones is the published layout as far as the source says (`stated_layout`)."""
    fp32_grads: bool = False
    """The source states its gradients' precision: accumulated and reduce-scattered in fp32 (Llama 3
    s3.3.4), not as its runtime profile's bf16. When they are reduced is the DP mode's: Llama 3's FSDP
    "shards the optimizer states and gradients" (s3.3.2), which over many microbatches only a
    reduce-scatter after each backward does (ZeRO-2 as Megatron-FSDP runs it)."""
    accumulates: bool = True
    """The run's tool could accumulate gradients over micro-batches (`SearchSpace.accumulate`): not
    torchtitan's of December 2024 (it gained it in June 2025, PR #1238)."""
    eager_loss: bool = False
    """The run's loss was eager `F.cross_entropy(logits.float(), labels)` (`runtime.with_eager_loss`):
    torchtitan's of December 2024 (train.py at 9dec370: "TODO: compiling loss function causes CUDA
    errors, turning off for now"); its June 2025 commits compile it with the model (components/loss.py)."""


def model_of(run: Run) -> str:
    """The model preset a row's `model` cell names."""
    name = run.cells["model"]
    if m := re.match(r"GPT-(\d+(?:\.\d+)?B) \(layers=", name):
        return f"mlm-gpt-{m.group(1).lower()}"
    for prefix, preset in (("Llama-3.1-8B", "llama3-8b"), ("Llama-3.1-70B", "llama3-70b"),
                           ("Llama-3.1-405B", "llama3-405b"), ("DeepSeek-V3", "deepseek-v3"),
                           ("Qwen3-235B-A22B", "qwen3-235b-a22b")):
        if name.startswith(prefix):
            return preset
    raise UserError(f"gpu-runs.tsv row {run.row}: no model preset for {name!r}; add one to "
                    "fivefold/planner/presets/models.py or exclude the row")


def flops_per_token(m: ModelConfig, seq: int, count: str) -> float:
    """Training FLOPs per token as a source counts them (`FLOP_COUNTS`)."""
    causal = model_flops_per_token(m, seq)
    if count == "causal":
        return causal
    return causal + 3 * m.num_layers * attention_core_flops(m, seq)  # every key, not half on average


def case_of(run: Run) -> Case:
    """The planner's inputs for a row that is not in `EXCLUDED` (UserError naming what is missing)."""
    assumed: list[str] = []
    unstated: set[str] = set()
    src = run.source

    def take(column: str, default, why: str):
        v = run.get(column)
        if v is None:
            assumed.append(f"{column}={default} ({why})")
            unstated.add(column)
            return default
        return v

    model_name = model_of(run)
    m = model_preset(model_name).model
    system = run.get("system")
    hw_name = HARDWARE.get(system) if system else None
    if hw_name is None:
        if system is not None:
            raise UserError(f"gpu-runs.tsv row {run.row}: unknown system {system!r}; add it to HARDWARE")
        hw_name = "gb200"
        assumed.append("system=GB200 (not stated; the report's other 256-GPU DeepSeek-V3 runs)")
    hw = hardware(hw_name)
    gpn = hw.gpus_per_node
    if gpn == 72:
        gpn = 64
        assumed.append("64 GPUs per NVLink domain (16 of an NVL72 rack's 18 trays, as 4 x 64 = 256)")
    tt = src.startswith("TT")
    precision = take("precision", "bf16", "TFLOP/s / MFU = the H100's dense bf16 peak")
    seq = int(take("seq_len", 8192 if tt else 4096, "the source's train config" if tt else "the report's"))
    gpus = int(take("gpus", 256, "Table 3's title"))
    tp, pp, cp = (int(take(c, 1, "not stated")) for c in ("tp", "pp", "cp"))
    dp = int(take("dp", gpus // (tp * pp * cp), "GPUs / (TP PP CP)"))
    local = _local_batch(run, tt)
    mbs_default = 1 if not (tt and pp > 1) else max(1, local // pp)
    mbs = int(take("micro_batch", mbs_default, "torchtitan splits the local batch into PP microbatches" if tt and pp > 1
                   else ("the stated local batch" if tt else "Megatron's default")))
    gbs_text, unit = run.get("global_batch"), run.get("global_batch_unit")
    if src == "TT-2412":
        assumed.append("no gradient accumulation (torchtitan gained it in June 2025, PR #1238)")
    if gbs_text is None and tt:
        gbs = (local or mbs) * dp
        assumed.append(f"global_batch={gbs} (local batch x DP: no gradient accumulation stated)")
    elif gbs_text is None:
        gbs = 8192
        assumed.append("global_batch=8192 (the report's DeepSeek-V3 runs)")
    elif unit == "tokens":
        gbs = int(float(gbs_text.rstrip("M")) * 2**20) // seq if gbs_text.endswith("M") else int(gbs_text) // seq
    else:
        gbs = int(gbs_text)
    if src == "LLAMA3" and run.get("vpp") is None:
        vpp = LLAMA3_VPP
        unstated.add("vpp")
        assumed.append(f"vpp={vpp}: one layer a model chunk (s3.3.2: with a layer fewer the first chunk holds "
                       f"only the embedding, the last only the output and loss: {LLAMA3_LAYOUT})")
    else:
        vpp = int(take("vpp", 1, "not stated: plain 1F1B")) if pp > 1 else int(run.get("vpp") or 1)
    ep = int(take("ep", 1, "dense"))
    etp = int(take("etp", 1, "Table 17: expert TP is always 1")) if m.is_moe else None
    fsdp = take("fsdp", "zero1" if RUNTIME[src] == "megatron-te" else "0",
                "the distributed optimizer, as Megatron's performance configs; at the README's commit "
                "--overlap-param-gather required it")
    strategy = {"1": "optim_grads_params", "zero1": "optim", "0": "optim" if not tt else "no_shard"}[fsdp]
    if src == "LLAMA3":
        strategy = "optim_grads"  # gradients and optimizer sharded; parameters not resharded after forward
    rc = take("recompute", "unknown", "")
    if rc == "unknown":
        rc = "selective" if m.is_moe else None
        assumed.append(f"recompute={rc or 'none'} (not stated)")
        unstated.add("recompute")
    options, words = MEMORY_OPTIONS_OF.get(run.row, ({}, ""))
    if words.startswith("assumed"):
        assumed.append(words)
    split = _split(run, m, pp, vpp, assumed, unstated)
    if "vpp" in unstated:
        unstated.add("split")  # a split is of PP x VPP stages
    tp_overlap = TP_OVERLAP_OF.get(run.row, (tp > 1, ""))[0]
    if tp > 1 and run.row not in TP_OVERLAP_OF:
        assumed.append("TP communication overlapped (not stated: Megatron's performance recipes turn on "
                       "--tp-comm-overlap with TP)")
    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, context_parallel_size=cp,
                              tp_comm_overlap=tp_overlap,
                              cp_comm_type=CP_COMM_OF.get(run.row, ("p2p",))[0],
                              pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                              expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                              overlap_moe_expert_parallel_comm=run.row in A2A_OVERLAP_OF,
                              moe_token_dispatcher_type=_dispatcher(run, m, assumed), **split)
    training = TrainingConfig(seq_length=seq, global_batch_size=gbs, micro_batch_size=mbs, precision=precision,
                              recompute_granularity=None if rc == "none" else rc,
                              recompute_modules=list(RECOMPUTE_MODULES_OF[run.row][0])
                              if rc == "selective" and run.row in RECOMPUTE_MODULES_OF else None,
                              recompute_method="uniform" if rc == "full" else None,
                              recompute_num_layers=1 if rc == "full" else None,
                              use_distributed_optimizer=strategy != "no_shard",
                              data_parallel_sharding_strategy=strategy, fp8_recipe=_fp8_recipe(run, tt), **options)
    cfg = Config(cluster=ClusterConfig(num_nodes=max(1, gpus // gpn), gpus_per_node=min(gpn, gpus), world_size=gpus),
                 parallel=parallel, model=m, training=training)
    tokens = run.num("tokens_per_s_per_gpu")
    if tokens is None and run.num("tflops_per_gpu") is not None:
        tokens = run.num("tflops_per_gpu") * 1e12 / flops_per_token(m, seq, FLOP_COUNTS[src])
    elif tokens is None and run.num("mfu") is not None:
        tokens = run.num("mfu") * hw.peak_flops(precision) / flops_per_token(m, seq, FLOP_COUNTS[src])
    memory = run.num("memory_gib_per_gpu")
    basis = MEMORY_BASIS.get(src) if memory is not None else None
    if memory is not None:
        memory *= GiB if basis == "reserved GiB" else 1e9
    # Llama 3 s3.3.4: "FP32 gradient accumulation ... and also reduce-scatter gradients in FP32"
    return Case(run, model_name, hw_name, gpn, cfg, RUNTIME[src], tokens, memory, basis, assumed,
                frozenset(unstated & LAYOUT_FIELDS.keys()), fp32_grads=src == "LLAMA3",
                accumulates=src != "TT-2412", eager_loss=src == "TT-2412")


def runtime_of(case: Case, rt: Runtime) -> Runtime:
    """`rt` (the case's runtime profile, or a trial of it) as the run's dated version ran: with the
    eager loss where `Case.eager_loss`."""
    return with_eager_loss(rt) if case.eager_loss else rt


def stated_layout(case: Case) -> Callable[[Config], bool]:
    """Whether a config has every layout field the case's source states (the unstated ones are free)."""
    fields = {name: get for name, get in LAYOUT_FIELDS.items() if name not in case.unstated}
    mine = Plan(case.config)
    wanted = {name: get(mine) for name, get in fields.items()}

    def states(cfg: Config) -> bool:
        theirs = Plan(cfg)
        return all(get(theirs) == wanted[name] for name, get in fields.items())
    return states


LAYOUT_IN_NOTES = re.compile(r"PP layout ([EtmL|()*\d]+)")


def _split(run: Run, m: ModelConfig, pp: int, vpp: int, assumed: list[str], unstated: set[str]) -> dict:
    """The layer split as ParallelConfig fields: the stated layout string, Llama 3's 'first and last
    stages one layer fewer' (`LLAMA3_LAYOUT`), else the planner's own choice for PP x VPP (`layer_splits`); an assumed
    one is said in `assumed` and "split" added to `unstated`."""
    if found := LAYOUT_IN_NOTES.search(run.cells["notes"]):
        return {"pipeline_layers_per_stage": list(parse_layout(found.group(1), pp, vpp, m.num_layers).decoder)}
    for other in read_runs():  # a layout the same source states for the same model and stage count
        found = LAYOUT_IN_NOTES.search(other.cells["notes"])
        if found and other.source == run.source and other.cells["model"] == run.cells["model"]:
            stages = parse_layout(found.group(1))
            if stages.stages == pp * vpp:
                assumed.append(f"PP layout {found.group(1)} (stated in row {other.row} for the same stages)")
                unstated.add("split")
                return {"pipeline_layers_per_stage": list(stages.decoder)}
    if run.source == "LLAMA3":
        return {"pipeline_layers_per_stage": list(parse_layout(LLAMA3_LAYOUT, pp, vpp, m.num_layers).decoder)}
    options = layer_splits(m.num_layers, pp, vpp, last_extra=mtp_stage_layers(m))
    if options != [{}]:
        assumed.append(f"layer split {options[0]} (not stated)")
        unstated.add("split")
    return options[0]


def _fp8_recipe(run: Run, tt: bool) -> str:
    """The fp8 scaling the notes name: MXFP8 (the MoE report's Blackwell runs), blockwise (its H100 run),
    torchao's tensorwise Float8 for torchtitan; Megatron's default (delayed) where fp8 is not run."""
    notes = run.cells["notes"]
    if "MXFP8" in notes:
        return "mxfp8"
    if "blockwise FP8" in notes:
        return "blockwise"
    return "tensorwise" if tt else "delayed"


def _dispatcher(run: Run, m: ModelConfig, assumed: list[str]) -> str:
    """The MoE token dispatcher the notes name: DeepEP / HybridEP is Megatron's flex dispatcher, "all-to-all
    dispatcher" its alltoall; unnamed (rows 38, 42, 44): flex, as the source's other runs (assumed)."""
    notes = run.cells["notes"]
    if not m.is_moe or "all-to-all dispatcher" in notes:
        return "alltoall"
    if "DeepEP" not in notes and "HybridEP" not in notes:
        assumed.append("dispatcher flex (not stated: DeepEP / HybridEP, as the source's other MoE runs)")
    return "flex"


def _local_batch(run: Run, tt: bool) -> int | None:
    """torchtitan's 'local batch size N' from the notes (sequences per DP rank per step)."""
    if not tt:
        return None
    m = re.search(r"local(?:_batch_size=| batch size )(\d+)", run.cells["notes"])
    return int(m.group(1)) if m else None


def cases(path: Path = RUNS) -> list[Case]:
    """Every row not in `EXCLUDED`, as planner inputs."""
    return [case_of(r) for r in read_runs(path) if r.row not in EXCLUDED]
