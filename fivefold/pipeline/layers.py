"""Which decoder layers each stage of a schedule builds (pure; stage s = the s-th piece of the model).

Counts come from `fivefold.config.split.layers_per_stage` (Megatron's even split and its uneven
options), or from an explicit list given in stage order (`parallel.pipeline_layers_per_stage`).
layers_per_stage numbers virtual stages `chunk * pp + rank`, which is the stage number of the
standard and interleaved placements; for any other placement (DualPipeV's V, a CSV schedule) the
entry of (chunk c, rank r) goes to the c-th stage rank r holds. Options that name the first or last
*stage* (account_for_embedding/loss) are applied in stage order, where the embedding and the loss
are. Stage s then builds the contiguous layers after those of stages 0..s-1.
"""
from __future__ import annotations

from fivefold.config.schema import ParallelConfig
from fivefold.config.split import layers_per_stage
from fivefold.errors import UserError
from fivefold.pipeline.ir import Schedule


def stage_layer_counts(num_layers: int, schedule: Schedule, parallel: ParallelConfig) -> list[int]:
    """Decoder layers of each stage of `schedule`, in stage order; UserError naming the rule broken."""
    n_stages, pp = schedule.num_stages, schedule.num_ranks
    p = parallel
    if p.pipeline_layers_per_stage is not None:
        counts = list(p.pipeline_layers_per_stage)
        if len(counts) != n_stages or sum(counts) != num_layers or min(counts) < 0:
            raise UserError(f"parallel.pipeline_layers_per_stage={counts}: schedule {schedule.name} has "
                            f"{n_stages} stages, so give {n_stages} counts >= 0 summing to num_layers={num_layers}")
        return counts
    chunks = {len(schedule.stages_of(r)) for r in range(pp)}
    try:
        if p.decoder_first_pipeline_num_layers is None and p.decoder_last_pipeline_num_layers is None:
            return layers_per_stage(num_layers, n_stages, None, account_for_embedding=p.account_for_embedding_in_pipeline_split,
                                    account_for_loss=p.account_for_loss_in_pipeline_split)
        if len(chunks) != 1:
            raise ValueError(f"ranks hold different numbers of stages ({sorted(chunks)}); give "
                             "parallel.pipeline_layers_per_stage instead")
        v = chunks.pop()
        virtual = layers_per_stage(num_layers, pp, v, p.decoder_first_pipeline_num_layers,
                                   p.decoder_last_pipeline_num_layers)
    except ValueError as e:
        raise UserError(f"splitting num_layers={num_layers} over the {n_stages} stages of schedule "
                        f"{schedule.name}: {e}") from None
    counts = [0] * n_stages
    for r in range(pp):
        for c, s in enumerate(schedule.stages_of(r)):
            counts[s] = virtual[c * pp + r]
    return counts


def stage_layers(num_layers: int, schedule: Schedule, parallel: ParallelConfig) -> list[list[int]]:
    """Global indices of the decoder layers of each stage, in stage order."""
    out, start = [], 0
    for n in stage_layer_counts(num_layers, schedule, parallel):
        out.append(list(range(start, start + n)))
        start += n
    return out
