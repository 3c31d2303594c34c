"""One optimizer step on one rank, with or without pipeline parallelism:

    forward/backward of the step's microbatches (one by one, or through the pipeline schedule:
    fivefold.train.pipeline_step) -> DataParallel.finish (gradients reduced over DP) -> MoE expert
    biases moved by the step's load (aux-loss-free balancing, fivefold.model.router) -> fp16: unscale,
    and skip the step on every rank if any rank overflowed -> clip by the global norm -> AdamW on the
    main parameters (fivefold.parallel.data.data_parallel, fivefold.config.precision).

The step's loss is the per-token mean over the global batch (fivefold.train.loss).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fivefold.data.loader import StepBatch
from fivefold.model.moe import layer_totals, reset_step_totals, update_expert_biases
from fivefold.runtime import comm
from fivefold.parallel.data.data_parallel import DataParallel
from fivefold.train.parallelize import Parts
from fivefold.pipeline.executor import RunResult
from fivefold.runtime.mesh import Group
from fivefold.train.loss import global_mean, loss_sum
from fivefold.train.pipeline_step import pipeline_forward_backward


@dataclass
class StepResult:
    loss: float
    grad_norm: float | None
    """None on a step skipped for an fp16 overflow."""
    tokens: int
    moe_totals: torch.Tensor | None = None
    """MoE: (layers, 3 + E) float64 on the CPU, each layer's aux + z loss (mean over micro-batches; not in
    `loss`), assignments dropped and made, and assignments per expert, summed over every rank; MTP
    layers after the decoder's (fivefold.model.moe.layer_totals; fivefold.train.moe_metrics turns them
    into metrics)."""
    mtp_loss: float | None = None
    """Multi-token prediction: the mean over depths of the MTP loss (unscaled, normalised as `loss`);
    not in `loss`."""
    run: RunResult | None = None
    """With PP: the executor's result (its action log and, when traced, timings)."""
    skipped: bool = False
    """fp16: the gradients overflowed on some rank, so no rank stepped (fivefold.config.precision)."""


def _forward_backward(model: nn.Module, dp: DataParallel, batch: StepBatch, device: torch.device,
                      divisors: list[float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each microbatch forward and backward in turn; the last one's backward reduces the dense
    buckets as they complete. Returns this rank's float64 loss sum; with `divisors` (Megatron's
    per-microbatch mean) each microbatch's sum divided by its divisor; and the same of the MTP
    losses summed over depths (0 without MTP)."""
    local = torch.zeros((), dtype=torch.float64, device=device)  # on the device: no host sync per microbatch
    mtp = torch.zeros((), dtype=torch.float64, device=device)
    n = len(batch.microbatches)
    for i, mb in enumerate(batch.microbatches):
        dp.prepare(last=i == n - 1)
        s = loss_sum(model, mb, device, batch.step)
        (s * (dp.loss_scale / (batch.global_tokens if divisors is None else divisors[i]))).backward()
        local += s.detach().double() if divisors is None else s.detach().double() / divisors[i]
        if model.cfg.mtp_num_layers:  # summed over depths
            mtp += model.mtp_loss_sums.sum() / (1 if divisors is None else divisors[i])
    if n == 0:
        dp.prepare(last=True)
    return local.cpu(), mtp.cpu()


def train_step(parts: Parts, batch: StepBatch, *, lr: float, clip_grad: float, device: torch.device,
               trace: bool = False, per_token_loss: bool = True) -> StepResult:
    """One step of `parts` (fivefold.train.parallelize) on this rank's share of the global batch.
    `trace` (PP only): time every action of the schedule (StepResult.run.times). `per_token_loss`
    False: Megatron's default loss, the mean over the global batch's microbatches of each one's
    per-token mean (StepBatch.loss_divisors); the same as the per-token mean when every microbatch has
    as many target tokens."""
    divisors = None if per_token_loss else batch.loss_divisors(per_token=False)
    dp, mesh = parts.dp, parts.mesh
    dp.set_lr(lr)
    dp.zero_grad()
    run = None
    cfg = parts.decoders[0].cfg
    reset_step_totals(parts.model)
    if parts.pipe is None:
        local, mtp = _forward_backward(parts.model, dp, batch, device, divisors)
        loss_groups: tuple[Group, ...] = (mesh.dp_cp,)
    else:
        local, run = pipeline_forward_backward(parts.pipe, dp, batch, mesh=mesh, trace=trace, divisors=divisors)
        mtp = torch.zeros((), dtype=torch.float64)  # the last stage's rank's MTP sums (fivefold.model.mtp)
        for mb, sums in run.mtp_sums.items():
            mtp += sums.sum().cpu() / (1 if divisors is None else divisors[mb])
        loss_groups = (mesh.pp, mesh.dp_cp)  # only the last stage's rank holds a loss sum
    dp.finish()
    update_expert_biases(parts.model, mesh.group("tp-cp-dp"))
    skipped = not dp.unscale_grads()  # fp16: an overflow on any rank skips the step on every rank
    norm = None if skipped else dp.clip_grads(clip_grad)
    if not skipped:
        dp.step()
    loss = global_mean(local, batch.global_tokens if divisors is None else 1, *loss_groups)
    depths = cfg.mtp_num_layers or 0  # MTP: its loss summed and divided like the loss, then averaged over depths
    mtp_loss = global_mean(mtp, batch.global_tokens if divisors is None else 1, *loss_groups) / depths \
        if depths else None
    return StepResult(loss, norm, batch.global_tokens, moe_totals=moe_step_totals(parts), mtp_loss=mtp_loss,
                      run=run, skipped=skipped)


def moe_step_totals(parts: Parts) -> torch.Tensor | None:
    """MoE: the (layers, 3 + E) totals of the step since `reset_step_totals`, decoder layers then MTP
    layers, summed over every rank (a rank without some layer adds zeros): DP x CP x TP x PP = world.
    None for a dense model. Collective over the world."""
    cfg = parts.decoders[0].cfg
    if not cfg.is_moe:
        return None
    totals = layer_totals(parts.model, cfg.num_layers + (cfg.mtp_num_layers or 0), cfg.num_experts)
    for group in (parts.mesh.dp_cp, parts.mesh.group("model-parallel")):
        comm.all_reduce_(totals, group, tag="moe-metrics")
    return totals.cpu()


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[StepBatch], *, dp_group: Group, device: torch.device) -> float:
    """Per-token mean loss over the given eval batches (all DP ranks)."""
    local = torch.zeros((), dtype=torch.float64)
    for batch in batches:
        for mb in batch.microbatches:
            local += float(loss_sum(model, mb, device))
    return global_mean(local, sum(b.global_tokens for b in batches), dp_group)
