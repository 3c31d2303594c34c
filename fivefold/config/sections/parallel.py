"""parallel: the layout's sizes and their options (TP and SP, PP, its schedule and layer split, CP and its exchange,
EP / ETP and the token dispatcher, the order of the dimensions), a section of fivefold.config.schema.Config;
the CP exchange's spellings. DP is what the world size leaves; ZeRO's sharding is a training field."""
from __future__ import annotations

from dataclasses import dataclass

from fivefold.errors import NotImplementedYet

CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
CP_COMM_SPELLINGS = {"all_gather": "allgather"}
"""TransformerEngine's and TransformerConfig's spelling -> ours (Megatron-LM's --cp-comm-type help)."""


def cp_comm_name(value) -> str:
    """A CP exchange as ours: TransformerEngine's spelling renamed; Megatron-Bridge's per-layer list
    taken when every layer has the same one (different exchanges per layer are not built), also as a
    command-line word "[all_gather,all_gather]"."""
    if isinstance(value, str) and value.strip().startswith("["):
        value = value.strip().strip("[]").replace(",", " ").split()
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise NotImplementedYet(f"cp_comm_type {list(value)} (one exchange for every layer is built)")
        value = value[0]
    return CP_COMM_SPELLINGS.get(str(value), str(value))


DIM_NAMES = ("tp", "cp", "ep", "dp", "pp")


@dataclass(kw_only=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP: ranks that split each weight matrix (heads, FFN, vocab). Default 1."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages (groups of layers on different ranks). Default 1."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP: model chunks per pipeline rank for the interleaved schedule. Default None (no interleaving)."""
    context_parallel_size: int = 1
    """CP: ranks that split the whole sequence (ring attention). Default 1."""
    cp_comm_type: str = "p2p"
    """CP attention communication: p2p (ring), a2a (all-to-all over heads), allgather (K and V gathered
    from the whole group before attention, exposed: Llama 3's; TransformerEngine's all_gather) or
    a2a+p2p. Default p2p."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """For cp_comm_type a2a+p2p: [a2a size, p2p size], product = CP. Default None."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split the MoE experts (folded into TP x CP x DP ranks). Default 1."""
    expert_tensor_parallel_size: int | None = None
    """ETP: TP inside each expert. Default None = TP (Megatron); AReaL's dialect sets 1."""
    sequence_parallel: bool = False
    """SP (Megatron's): shard norms/dropout/residual along the sequence in the TP group. Default False."""
    moe_token_dispatcher_type: str = "alltoall"
    """How the EP exchange is sent (Megatron's --moe-token-dispatcher-type): alltoall (a copy of each
    token per routed expert), allgather (the EP group's tokens gathered on every rank, the outputs
    reduce-scattered back), flex (DeepEP / HybridEP: a token once per node it is routed to, then over
    NVLink). The same sums: fivefold's runtime sends an all-to-all whatever this says; the planner
    times the one named for a runtime that has them (megatron-te). Default alltoall (Megatron-LM's,
    for a Megatron command line that leaves it out: allgather)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Megatron's 1F1B all-to-all overlap (--overlap-moe-expert-parallel-comm): one microbatch's EP
    dispatch / combine run beside another's compute. A schedule choice with the same sums: fivefold's
    runtime computes them without it; the planner times it for a runtime that has it (megatron-te).
    Megatron-LM's rules hold: EP > 1, the alltoall or flex dispatcher, no full recompute, VPP when
    PP > 1, at most one MTP layer, 16-bit. Default False."""
    tp_comm_overlap: bool = False
    """TP / SP communication overlapped with the GEMMs (Megatron's --tp-comm-overlap, TransformerEngine's
    userbuffers; torchtitan's async TP): a runtime switch with the same sums. fivefold's runtime computes
    them without it; the planner hides the runtime's share of the TP traffic where it is on
    (megatron-te, torchtitan). Megatron-LM's rule holds: sequence parallelism (so TP > 1). Default False."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying first. Default Megatron's tp-cp-ep-dp-pp."""
    pipeline_schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved, zb-h1 or dualpipev. Default 1f1b (interleaved when VPP is set)."""
    pipeline_schedule_csv: str | None = None
    """Path of a hand-written schedule in the IR's CSV form; overrides pipeline_schedule. Default None."""
    pipeline_layers_per_stage: list[int] | None = None
    """Explicit decoder layers per pipeline stage (sums to num_layers). Default None (even split)."""
    pipeline_model_parallel_layout: str | None = None
    """Megatron's --pipeline-model-parallel-layout: the virtual stages in model order, `|` between them, `E`
    the embedding (first stage), `t` a decoder layer, `m` an MTP layer (with `L`, the loss, in the last
    stage: our runtime runs MTP beside the loss), `X*n` / `(...)*n` repeats, e.g. `Et*3|(tt|)*5|tmL`.
    validate resolves it into pipeline_layers_per_stage and VPP = stages / PP. Default None."""
    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage (Megatron's uneven split). Default None."""
    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage (Megatron's uneven split). Default None."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one layer of the first stage when splitting. Default False."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer + loss as one layer of the last stage when splitting. Default False."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Megatron's way to ask for interleaving: layers per model chunk; VPP = num_layers / (PP x this).
    Default None (use virtual_pipeline_model_parallel_size)."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Interleaving runs the microbatches in groups of N: a group's forwards through chunk 0, then chunk
    1, ..., then the next group (Megatron's --microbatch-group-size-per-virtual-pipeline-stage; the
    Llama 3 paper's tunable N). PP <= N <= microbatches, and the last group (microbatches mod N) empty
    or at least PP: so N lets interleaving run a microbatch count that is not a multiple of PP (N =
    all of them is breadth-first). Rank r holds 2(PP - r - 1) + (VPP - 1) N + 1 chunk activations at
    its peak: a larger N holds more; the bubble is (PP - 1) / VPP whatever N. The same sums in any
    order. Default None = PP (depth-first); ignored without interleaving, as Megatron-LM does."""
