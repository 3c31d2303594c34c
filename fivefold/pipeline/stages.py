"""A pipeline rank's part of the model: its stages as Decoders, the schedule, and the executor.

Stage s is `build_decoder(config, mesh, layers=<its layers>, embedding=(s == 0), head=(s == S-1))`:
the same mapping of the config (TP from the mesh, sequence parallelism) as the whole model, and
Decoder's per-name initialisation makes every stage (and every TP shard of it) start from exactly
the one-process model's weights. Stage boundaries carry (b, s/tp, h) under sequence parallelism.

Tied input/output embeddings (model.tie_word_embeddings): the embedding lives on stage 0 and the
output layer on stage S-1. When both stages are on one rank (DualPipeV's V puts them on rank 0) the
head simply reuses the embedding's Parameter. Otherwise each of the two ranks holds a copy,
initialised equal; after every backward the two gradients are summed over the layout's "embedding"
group (first and last pipeline rank), so both copies take the same optimizer step and stay equal,
as in Megatron. With TP each copy is a vocabulary shard, and the embedding group pairs the first and
last pipeline ranks of the same TP rank, so the shards summed are the same rows. The gradient norm
counts the copy on the last stage's rank zero times.

Multi-token prediction (model.mtp_num_layers) runs on the last stage and embeds tokens with the
model's input embedding: the last stage then holds a copy of embedding.weight (its head shares it
when tied), kept equal to stage 0's by the same gradient sum over the embedding group (Megatron
does the same for its MTP embedding on the last stage).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fivefold.config.schema import Config
from fivefold.errors import UserError
from fivefold.model.decoder import Decoder, build_decoder
from fivefold.pipeline.csvio import load_csv
from fivefold.pipeline.executor import PipelineExecutor
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.ir import Schedule
from fivefold.pipeline.layers import stage_layers
from fivefold.pipeline.lowering import lower
from fivefold.pipeline.verify import verify
from fivefold.parallel.data.reducer import grad_target
from fivefold.config.precision import Precision
from fivefold.runtime import comm


def schedule_for(config: Config, num_microbatches: int) -> Schedule:
    """The verified schedule the config asks for (a CSV file, or a generator) for this many microbatches."""
    p = config.parallel
    pp = p.pipeline_model_parallel_size
    if p.pipeline_schedule_csv:
        schedule = lower(load_csv(p.pipeline_schedule_csv))
        if schedule.num_ranks != pp or schedule.num_microbatches != num_microbatches:
            raise UserError(f"parallel.pipeline_schedule_csv={p.pipeline_schedule_csv}: has {schedule.num_ranks} "
                            f"rows (ranks) and {schedule.num_microbatches} microbatches; this run needs "
                            f"pipeline_model_parallel_size={pp} rows and global_batch_size / (micro_batch_size "
                            f"x DP) = {num_microbatches} microbatches")
    else:
        schedule = build_schedule(p.pipeline_schedule, pp, num_microbatches, p.virtual_pipeline_model_parallel_size,
                                  p.microbatch_group_size_per_vp_stage)
    verify(schedule)
    return schedule


class StageStack(nn.Module):
    """This rank's stages as one module whose parameters and buffers carry the one-process model's
    names (`layers.5.mlp...`, `embedding.weight`), so checkpoints and optimizers see the global names."""

    def __init__(self, stages: dict[int, Decoder]):
        super().__init__()
        self.stages = nn.ModuleDict({str(s): m for s, m in sorted(stages.items())})

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        seen = set()
        for stage in self.stages.values():
            for name, p in stage.named_parameters(prefix=prefix, recurse=recurse):
                if id(p) not in seen or not remove_duplicate:
                    seen.add(id(p))
                    yield name, p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for stage in self.stages.values():
            yield from stage.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def forward(self, *args):
        raise TypeError("a pipeline rank's stages run through its PipelineExecutor, not forward()")


@dataclass
class PipelineModel:
    """This rank's stages and how to run them."""

    schedule: Schedule
    stages: dict[int, Decoder]
    executor: PipelineExecutor
    tied: list[nn.Parameter]
    """Tied embedding copies on this rank whose gradients are summed over the embedding group."""
    embedding_group: object | None
    """The mesh's embedding Group when `tied` copies live on two ranks, else None."""
    make_executor: Callable[[int], PipelineExecutor] | None = None
    """The executor of the same schedule kind for another microbatch count (a step batch-size schedule)."""
    _others: dict[int, PipelineExecutor] = field(default_factory=dict)

    def executor_for(self, num_microbatches: int) -> PipelineExecutor:
        """The executor that runs `num_microbatches` (built once per count, over the same stages)."""
        if num_microbatches == self.schedule.num_microbatches:
            return self.executor
        if num_microbatches not in self._others:
            self._others[num_microbatches] = self.make_executor(num_microbatches)
        return self._others[num_microbatches]

    @property
    def module(self) -> StageStack:
        return StageStack(self.stages)

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter of this rank's stages, once (a shared tied weight appears once)."""
        return [p for _, p in StageStack(self.stages).named_parameters()]

    def uncounted_parameters(self) -> list[nn.Parameter]:
        """Parameters this rank leaves out of the global gradient norm: the last stage's copy of a
        tied (or MTP) embedding held on another rank (its gradient equals the first stage's after
        `sync_tied_grads`, which counts it)."""
        last = self.schedule.num_stages - 1
        return [_embedding_copy(self.stages[last])] if self.embedding_group is not None and last in self.stages else []

    def sync_tied_grads(self) -> None:
        """Sum the tied embedding's gradient over its two copies (first and last pipeline rank)."""
        if self.embedding_group is None or not self.tied:
            return
        for p in self.tied:
            if grad_target(p) is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce_(grad_target(p), self.embedding_group, tag="embedding-grad")


def _embedding_copy(last: Decoder) -> nn.Parameter:
    """The last stage's copy of embedding.weight: the MTP embedding's (the tied head shares it), else the head's."""
    return last.embedding.weight if last.embedding is not None else last.head.weight


def _share_embedding(last: Decoder, weight: nn.Parameter, tied: bool) -> None:
    """First and last stage on one rank: the last stage's head (tied) and MTP embedding use stage 0's weight."""
    if tied:
        last.head.weight = weight
    if last.embedding is not None:
        last.embedding.weight = weight


def build_pipeline(config: Config, mesh, num_microbatches: int, *, device: torch.device,
                   seed: int | None = None) -> PipelineModel:
    """Schedule, stage modules and executor for this rank of `mesh` (its pipeline rank = mesh.pp.rank)."""
    cfg, pp = config.model, mesh.pp
    schedule = schedule_for(config, num_microbatches)
    layers = stage_layers(cfg.num_layers, schedule, config.parallel)
    last = schedule.num_stages - 1
    seed = config.training.seed if seed is None else seed
    stages = {s: build_decoder(config, mesh, layers=layers[s], embedding=s == 0, head=s == last, seed=seed).to(device)
              for s in schedule.stages_of(pp.rank)}
    tied, group = [], None
    if (cfg.tie_word_embeddings or cfg.mtp_num_layers) and schedule.num_stages > 1:
        first_rank, last_rank = schedule.placement[0], schedule.placement[last]
        if first_rank == last_rank:
            if pp.rank == first_rank:
                _share_embedding(stages[last], stages[0].embedding.weight, cfg.tie_word_embeddings)
        elif (first_rank, last_rank) == (0, pp.size - 1):
            group = mesh.embedding if pp.rank in (first_rank, last_rank) else None  # only they are in it
            tied = [stages[0].embedding.weight] if 0 in stages else []
            tied += [_embedding_copy(stages[last])] if last in stages else []
        else:
            what = "tied embeddings" if cfg.tie_word_embeddings else "multi-token prediction (its embedding copy)"
            raise UserError(f"{what} need the first stage on pipeline rank 0 and the last on rank "
                            f"{pp.size - 1} (or both on one rank); schedule {schedule.name} puts them on "
                            f"{first_rank} and {last_rank}")
    boundary = next(iter(stages.values())).hidden_shape  # (b, s/tp, h) under SP, else (b, s, h)

    def executor(sched: Schedule) -> PipelineExecutor:
        return PipelineExecutor(sched, stages, pp.rank, peer_rank=pp.global_rank, send_recv=comm.send_recv,
                                hidden_size=cfg.hidden_size, activation_shape=boundary, device=device,
                                dtype=Precision.of(config.training).param_dtype)  # the activations sent

    return PipelineModel(schedule, stages, executor(schedule), tied, group,
                         lambda n: executor(schedule_for(config, n)))
