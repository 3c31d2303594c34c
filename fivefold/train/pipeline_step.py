"""The forward/backward of a step with pipeline parallelism (PP > 1): the schedule runs the
microbatches; fivefold.train.step.train_step does the rest, as without PP.

The same loss and gradient as the one-process pass: every microbatch backpropagates
sum(token losses) / N_global, through the stages the schedule runs (fivefold.pipeline.executor).
No gradient is reduced during the schedule (a rank's last backward may be any stage's W): the DP
reduction runs after it, once the tied embedding's two copies are summed over the embedding group.
The loss is on the last stage's rank: its sum is added over the pipeline group, then over DP.
Also here: evaluation and log-probs through the forward-only schedule, and the traced timeline.
"""
from __future__ import annotations

from pathlib import Path

import torch

from fivefold.data.loader import StepBatch
from fivefold.errors import UserError
from fivefold.pipeline.executor import RunResult
from fivefold.pipeline.render import draw_png, text_timeline
from fivefold.pipeline.simulate import simulate
from fivefold.pipeline.trace import measured_result, stage_costs
from fivefold.pipeline.stages import PipelineModel
from fivefold.runtime import comm
from fivefold.train.loss import cp_tokens, dropout_kwargs, global_mean


def _inputs(pipe: PipelineModel, batch: StepBatch, dp_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    if batch.global_samples and len(batch.sample_ids) * dp_size != batch.global_samples:
        raise UserError(f"schedule {pipe.schedule.name}: this DP rank got {len(batch.sample_ids)} of the step's "
                        f"{batch.global_samples} samples (pipeline parallelism needs every DP rank to get "
                        "global_batch_size / DP samples, so that all run as many microbatches: keep data.packing on)")
    return _cp_split(pipe, [mb.input_ids for mb in batch.microbatches], [mb.labels for mb in batch.microbatches])


def _cp_split(pipe: PipelineModel, input_ids, labels) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This CP rank's (b, s/cp) share of each microbatch (every stage splits the sequence alike)."""
    first = next(iter(pipe.stages.values()))
    split = [cp_tokens(first, ids, lab) for ids, lab in zip(input_ids, labels)]
    return [ids for ids, _ in split], [lab for _, lab in split]


def pipeline_forward_backward(pipe: PipelineModel, dp, batch: StepBatch, *, mesh, trace: bool = False,
                              divisors: list[float] | None = None) -> tuple[torch.Tensor, RunResult]:
    """Run the step's schedule with `dp` (fivefold.parallel.data.data_parallel.DataParallel) holding the
    gradients; returns this rank's float64 loss sum (non-zero on the last stage's rank only) and the
    executor's result (its action log and, with `trace`, timings)."""
    ids, labels = _inputs(pipe, batch, mesh.dp.size)
    dp.prepare(last=False)  # no reduction during the schedule: finish() reduces every bucket
    if trace:
        comm.barrier(mesh.pp)  # a common start, so the ranks' timings line up
    scale = dp.loss_scale / batch.global_tokens if divisors is None else [dp.loss_scale / d for d in divisors]
    run = pipe.executor_for(len(ids)).run(ids, labels, loss_scale=scale, trace=trace,
                            docs=[mb.docs for mb in batch.microbatches],
                            noise=[dropout_kwargs(batch.step, mb).get("noise") for mb in batch.microbatches])
    pipe.sync_tied_grads()  # before the DP reduction (the sums commute): with ZeRO-1 it reduce-scatters
    local = torch.zeros((), dtype=torch.float64)
    for mb, s in run.loss_sums.items():
        local += s.double().cpu() if divisors is None else s.double().cpu() / divisors[mb]
    return local, run


@torch.no_grad()
def pipeline_evaluate(pipe: PipelineModel, batches: list[StepBatch], *, mesh) -> float:
    """Per-token mean loss over the eval batches, through the forward-only schedule (all ranks)."""
    local = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        ids, labels = _inputs(pipe, batch, mesh.dp.size)
        run = pipe.executor_for(len(ids)).run(ids, labels, mode="loss", docs=[mb.docs for mb in batch.microbatches])
        local += sum(float(s) for s in run.loss_sums.values())
    return global_mean(local, sum(b.global_tokens for b in batches), mesh.pp, mesh.dp_cp)


def pipeline_logprobs(pipe: PipelineModel, input_ids: list[torch.Tensor], labels: list[torch.Tensor], *,
                      mesh) -> list[torch.Tensor]:
    """Per-token log p(label) (b, s) of each microbatch, on every rank of the pipeline (broadcast from the
    last stage's rank over the pipeline group): what an RL step needs for its reference/old policy.
    Under context parallelism: this CP rank's (b, s/cp) tokens, in parallel.context's chunk order."""
    input_ids, labels = _cp_split(pipe, input_ids, labels)  # (b, s/cp) each under CP
    run = pipe.executor.run(input_ids, labels, mode="logprobs")
    src = mesh.pp.global_rank(pipe.schedule.placement[-1])
    out = []
    for mb, ids in enumerate(input_ids):
        t = run.logprobs.get(mb)
        if t is None:
            t = torch.empty(ids.shape, dtype=torch.float32, device=pipe.executor.device)
        out.append(comm.broadcast_(t.contiguous(), src, mesh.pp, tag="logprobs"))
    return out


def gather_times(pipe: PipelineModel, run: RunResult, mesh) -> list[list[tuple[float, float]]]:
    """Every pipeline rank's (start, end) per action, relative to its own first action (all ranks)."""
    longest = max(len(a) for a in pipe.schedule.ranks)
    mine = torch.zeros(longest, 2, dtype=torch.float64)
    if run.times:
        t0 = run.times[0][0]
        mine[: len(run.times)] = torch.tensor([[a - t0, b - t0] for a, b in run.times], dtype=torch.float64)
    every = comm.all_gather(mine.unsqueeze(0), 0, mesh.pp, tag="trace")  # (pp, longest, 2)
    return [[(float(a), float(b)) for a, b in every[r, : len(pipe.schedule.ranks[r])]]
            for r in range(pipe.schedule.num_ranks)]


def trace_report(pipe: PipelineModel, run: RunResult, mesh, png: Path | None) -> str:
    """The measured timeline of a traced step (all ranks call it; rank 0's text is the one to print):
    text timeline, measured bubble per rank next to the simulator's on the measured per-stage costs,
    and the PNG drawn like `fivefold schedule --png`."""
    schedule = pipe.schedule
    measured = measured_result(schedule, gather_times(pipe, run, mesh))
    predicted = simulate(schedule, stage_costs(schedule, measured))
    lines = [text_timeline(schedule, measured), f"measured schedule {schedule.name} (ms): makespan "
             f"{measured.makespan:.1f} (simulator on the measured per-stage costs: {predicted.makespan:.1f})"]
    for r in range(schedule.num_ranks):
        lines.append(f"  rank {r}: bubble {measured.bubble[r]:.1%} measured, {predicted.bubble[r]:.1%} simulated")
    if png is not None and mesh.rank == 0:
        draw_png(schedule, measured, str(png))
        lines.append(f"wrote {png}")
    return "\n".join(lines)
