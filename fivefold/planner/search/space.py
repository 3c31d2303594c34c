"""The layouts the search tries: every TP x CP x PP x DP factorisation of the GPUs, EP and ETP
(MoE folding), VPP (2 up to layers / PP, where the layers split: `layer_splits`) and schedule, the
layer split, micro-batch size, recompute, distributed optimizer.

Left out of the search, because under the cost model they never win (`fivefold estimate` still
evaluates them): SP off with TP > 1 (same bytes as SP on, more memory); the distributed optimizer
off (reduce-scatter + all-gather moves fewer bytes than the all-reduce, and holds less); TP groups
larger than a node (every TP collective on the network); GPipe (1F1B has the same bubble, less
memory).
"""
from __future__ import annotations

import itertools
from functools import lru_cache
from dataclasses import dataclass

from fivefold.config.schema import ModelConfig
from fivefold.pipeline.schedules import REGISTRY
from fivefold.planner.memory.mtp import mtp_stage_layers


@dataclass(frozen=True)
class SearchSpace:
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    accumulate: bool = True
    """Gradient accumulation allowed. Without it a layout without PP takes its whole share of the
    global batch (B / DP sequences) as one micro-batch, as torchtitan did before June 2025 (its
    `training.batch_size` was the local batch; PR #1238 added `training.global_batch_size`) and as any
    run does whose global batch is its local batch x DP; with PP that share is the pipeline's
    microbatches, of the sizes above."""
    recompute: tuple[str | None, ...] = (None, "selective", "full")
    """Recompute modes in order of cost: None, 'selective' (the attention core), 'selective(m1,m2)'
    (Megatron's --recompute-modules), 'full'. The search stops at the first that fits."""
    module_recompute: bool = True
    """MoE models: Megatron's usual module sets where their cost puts them (`MOE_RECOMPUTE`):
    layernorm + moe_act (memory-bound reruns) for selective, and layernorm + moe (the MoE layer again,
    its all-to-alls included) before full."""
    max_cp: int = 16
    max_vpp: int | None = None
    """Largest VPP (model chunks per pipeline rank) tried; None = layers / PP (one layer per virtual
    stage), as published runs go up to VPP 24. Only VPPs with a split `layer_splits` finds are tried."""
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    """Pipeline schedules tried (any of gpipe, 1f1b, interleaved, zb-h1, dualpipev)."""
    cp_comm_types: tuple[str, ...] = ("p2p", "a2a")
    dispatcher: str = "alltoall"
    """The token dispatcher every MoE layout is timed with (`ParallelConfig.moe_token_dispatcher_type`;
    the runtime's, `Runtime.dispatcher`)."""
    a2a_overlap: bool = False
    """MoE layouts run with Megatron's 1F1B all-to-all overlap wherever its rules allow it (EP > 1, no
    full recompute, VPP under PP, ...: `config.rules.a2a_overlap_problems`), for a runtime that has it
    (`Runtime.a2a_overlap`). A runtime switch, not a layout: under the time model it only hides EP
    traffic, so it is on where allowed rather than a second variant."""
    tp_comm_overlap: bool = False
    """Layouts with TP run with TP communication overlap (`ParallelConfig.tp_comm_overlap`: Megatron's
    --tp-comm-overlap, torchtitan's async TP), for a runtime that has it (`Runtime.tp_comm_overlap`). A
    runtime switch, not a layout: every layout the search makes has SP with TP, which the overlap needs,
    and under the time model it only hides TP traffic, so it is on wherever TP > 1."""
    group_rule: str = "megatron"
    """How interleaving groups a microbatch count PP does not divide (`pipeline.schedules.smallest_group`):
    Megatron's rule (a shorter last group allowed), or torch.distributed.pipelining's equal rounds
    (torchtitan, `Runtime.group_rule`)."""
    megatron_fsdp: bool = False
    """ZeRO-2/3 layouts run as Megatron-FSDP (`Runtime.megatron_fsdp`: gradients reduce-scattered every
    microbatch, also under PP)."""
    fp8_recipe: str = "delayed"
    """The fp8 scaling every layout runs under fp8 (`TrainingConfig.fp8_recipe`: its scales' bytes; MXFP8
    only on Blackwell)."""
    dp_modes: tuple[str, ...] = ("optim",)
    """Data-parallel modes tried (TrainingConfig.sharding_strategy): optim (the distributed optimizer,
    ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (ZeRO-3: FSDP2, Megatron-FSDP), no_shard. The
    runtime profile gives its own (`Runtime.dp_modes`: torchtitan's is FSDP2); `plan --dp-modes`.
    A more sharded mode is ranked only at a micro-batch where no less sharded one fits with as little
    recompute (`pruning.DOMINATED`): it moves more bytes, and its time is never shorter but by the
    per-microbatch overlap of its reduce-scatters (2 of ~55,000 twins checked, by 1e-5 and 6e-5)."""
    per_stage_splits: bool = False
    """Also try interleaved layouts whose layers split over PP x VPP only as a per-stage list
    (Megatron's --pipeline-model-parallel-layout; 61 layers on PP8 x VPP4). Off by default: for a
    61-layer model every VPP from 2 to layers / PP is such a layout (~10x the search)."""


MOE_RECOMPUTE = {"selective": ("selective(layernorm,moe_act)",), "full": ("selective(layernorm,moe)", "full")}
"""Where `SearchSpace.module_recompute` puts module sets for a MoE model: each mode -> the modes it
becomes. The attention core alone (Megatron's default) is left out: with a flash kernel it drops only
the log-sum-exp and costs an attention forward, so layernorm + moe_act (less time, more memory freed)
ranks wherever it would."""


def recompute_modes(space: SearchSpace, m: ModelConfig) -> tuple[str | None, ...]:
    """The recompute modes the search tries for `m`, in order of cost."""
    if not (space.module_recompute and m.is_moe):
        return space.recompute
    return tuple(x for mode in space.recompute for x in MOE_RECOMPUTE.get(mode, (mode,)))


def recompute_fields(mode: str | None) -> tuple[str | None, list[str] | None]:
    """A recompute mode as TrainingConfig's (recompute_granularity, recompute_modules)."""
    if mode and mode.startswith("selective("):
        return "selective", mode[len("selective("):-1].split(",")
    return mode, None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


@lru_cache(maxsize=None)
def layer_splits(num_layers: int, pp: int, vpp: int, explicit: bool = False, last_extra: int = 0) -> list[dict]:
    """Ways to put `num_layers` on pp x vpp stages, as ParallelConfig fields: the even split when it
    exists; else the embedding and/or loss counted as layers (Megatron's account-for options), and
    the most balanced first/last-stage counts (Megatron's decoder_first/last_pipeline_num_layers);
    with `explicit`, where none of those exists (61 layers on PP8 x VPP4), a per-stage list as
    Megatron's --pipeline-model-parallel-layout writes it, the first and last virtual stages one layer
    lighter (`plan --compare`; the search leaves these out: they would triple a 61-layer search).
    `last_extra` layers' worth of other work on the last stage (multi-token prediction's layers:
    Megatron's layouts give them a stage of their own, `...tmL`) is weighed when balancing the
    first/last-stage counts."""
    chunks = pp * vpp
    if num_layers % chunks == 0:
        return [{}]
    out = []
    for emb, loss in ((True, True), (False, True), (True, False)):
        units = num_layers + emb + loss
        if units % chunks == 0 and units // chunks >= 1:
            out.append({"account_for_embedding_in_pipeline_split": emb, "account_for_loss_in_pipeline_split": loss})
            break
    if pp > 2:
        best = None
        for first in range(vpp, num_layers, vpp):
            for last in range(vpp, num_layers - first, vpp):
                rest = num_layers - first - last
                if rest % (pp - 2) or (rest // (pp - 2)) % vpp or rest <= 0:
                    continue
                worst = max(first, last + last_extra, rest // (pp - 2))
                key = (worst, -min(first, last + last_extra))
                if best is None or key < best[0]:
                    best = (key, first, last)
        if best:
            out.append({"decoder_first_pipeline_num_layers": best[1], "decoder_last_pipeline_num_layers": best[2]})
    if explicit and not out and num_layers >= chunks:  # what Megatron's --pipeline-model-parallel-layout writes out
        q, extra = divmod(num_layers, chunks)
        start = 1 if extra <= chunks - 2 else 0  # the first and last virtual stages (embedding, loss) lighter
        out.append({"pipeline_layers_per_stage": [q + (start <= i < start + extra) for i in range(chunks)]})
    return out


def structures(m: ModelConfig, world: int, gpus_per_node: int, seq: int, space: SearchSpace):
    """Yield dicts of ParallelConfig fields, one per layout skeleton (no batch/recompute knobs)."""
    heads, mtp_extra = m.num_attention_heads, mtp_stage_layers(m)
    for tp in pow2_upto(min(gpus_per_node, heads)):
        if world % tp or heads % tp:
            continue
        for cp in pow2_upto(space.max_cp):
            if world % (tp * cp) or (cp > 1 and seq % (2 * cp)):  # (CP splits a sequence in 2 x CP chunks)
                continue
            rest = world // (tp * cp)
            for pp in divisors(rest):
                if pp > m.num_layers:
                    break
                dp = rest // pp
                for ep, etp in _expert_layouts(m, tp, cp, dp):
                    for vpp, schedule in _pipelines(pp, m.num_layers, space):
                        for split in layer_splits(m.num_layers, pp, vpp, space.per_stage_splits and vpp > 1,
                                                  mtp_extra):
                            for comm in (space.cp_comm_types if cp > 1 else ("p2p",)):
                                yield dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                           context_parallel_size=cp, cp_comm_type=comm,
                                           pipeline_model_parallel_size=pp,
                                           virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                                           pipeline_schedule=schedule, expert_model_parallel_size=ep,
                                           expert_tensor_parallel_size=etp, **split)


def _expert_layouts(m: ModelConfig, tp: int, cp: int, dp: int):
    if not m.is_moe:
        yield 1, None
        return
    folded = tp * cp * dp
    for ep, etp in itertools.product(divisors(m.num_experts), sorted({1, tp})):
        if folded % (ep * etp) == 0:
            yield ep, etp


def _pipelines(pp: int, num_layers: int, space: SearchSpace):
    if pp == 1:
        yield 1, "1f1b"
        return
    for name in (n for n in REGISTRY if n in space.schedules):  # the registry's order
        cap = num_layers // pp if space.max_vpp is None else space.max_vpp
        for v in REGISTRY[name].planner_vpps(pp, num_layers, cap):
            yield v, name


def megatron_fsdp(runtime_has_it: bool, dp_mode: str) -> bool:
    """Whether a config of `dp_mode` runs as Megatron-FSDP (`TrainingConfig.use_megatron_fsdp`) on a
    runtime that has it: its ZeRO-2/3 (the distributed optimizer is Megatron's DDP, not Megatron-FSDP)."""
    return runtime_has_it and dp_mode in ("optim_grads", "optim_grads_params")
