"""The training loop of one rank: build, (resume), step, evaluate, log, checkpoint, summarise.

Everything a step uses is a function of (config, step): the LR is `lr_at(step)`, the data is global
batch `step`, so a run resumed from a checkpoint at step k (parameters, AdamW moments, RNG) continues
with exactly the losses of an uninterrupted run.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from fivefold.checkpoint import io as ckpt
from fivefold.config.schema import Config, to_dict
from fivefold.checkpoint.async_save import AsyncSaver
from fivefold.checkpoint.metadata import resume_step
from fivefold.data.dataset import dataset_of, load_splits
from fivefold.hf.load import read_hf_shards
from fivefold.hf.export import export_hf
from fivefold.data.documents import document_rules
from fivefold.data.loader import BatchLoader
from fivefold.errors import UserError, writing_file
from fivefold.model import build_decoder
from fivefold.runtime import comm, heartbeat
from fivefold.parallel.data.reducer import GradReducer
from fivefold.train.parallelize import Parts, parallelize
from fivefold.train.context import RankContext, layout_text
from fivefold.train.manual_gc import after_step, around_eval, manual_gc
from fivefold.train.metrics import MetricsLog, flops_per_token, peak_memory_bytes, plot_loss_curve, read_metrics
from fivefold.train.moe_metrics import moe_record, plot_expert_load
from fivefold.train.nonfinite import is_finite, nonfinite_error
from fivefold.train.optim import state_bytes
from fivefold.train.profile import StepProfiler, profile_steps
from fivefold.config.batch_sizes import BatchSizes, microbatches_per_step
from fivefold.train.schedule import lr_at
from fivefold.pipeline.stages import build_pipeline
from fivefold.train.pipeline_step import pipeline_evaluate, trace_report
from fivefold.train.step import evaluate, train_step


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    """Step -> global-batch loss, for the steps this run took."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    peak_memory: list[int] = field(default_factory=list)
    """Per rank, bytes (see metrics.peak_memory_bytes)."""
    checkpoint: Path | None = None
    optimizer_state_bytes: int = 0
    """This rank's AdamW moments (1/DP of them with the distributed optimizer)."""
    plot: Path | None = None
    expert_load_plot: Path | None = None
    """MoE with logging.moe_per_layer_logging: OUT/expert_load.png (fivefold.train.moe_metrics)."""
    start_step: int = 0
    """The step the run started from (the loaded checkpoint's; 0 without --load)."""


def _loaders(config: Config, ctx: RankContext, data_dir: Path) -> tuple[BatchLoader, BatchLoader | None]:
    d, t = config.data, config.training
    train_split, eval_split = load_splits(data_dir, d.eval_fraction)
    kw = dict(global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
              dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, documents=document_rules(d, Path(data_dir)))
    train_ds = dataset_of(train_split, t.seq_length, d.packing)
    if len(train_ds) < ctx.dp_size:
        raise UserError(f"data: the training split has {len(train_ds)} samples of seq_length={t.seq_length}; "
                        f"need at least {ctx.dp_size} (give more data or a shorter training.seq_length)")
    eval_loader = None
    if t.eval_interval and t.eval_iters:  # eval_iters 0: no evaluation, as Megatron
        eval_ds = dataset_of(eval_split, t.seq_length, d.packing)
        if len(eval_ds) < ctx.dp_size:
            raise UserError(f"data: the eval split has {len(eval_ds)} samples of seq_length={t.seq_length}; raise "
                            "data.eval_fraction or unset training.eval_interval")
        eval_loader = BatchLoader(eval_ds, seed=t.seed, shuffle=False, **kw)
    return BatchLoader(train_ds, seed=t.seed, sizes=BatchSizes.of(t), **kw), eval_loader


def _save(config: Config, ctx: RankContext, root: Path, step: int, parts: Parts, saver: AsyncSaver | None) -> Path:
    # DP x CP replica 0 writes the dense parameters, EDP replica 0 the experts it holds; a rank that
    # is one but not the other writes copies equal to the owner's, which the checkpoint lists once.
    writes = ctx.dp_group.rank == 0 or (config.model.is_moe and ctx.mesh.edp.rank == 0)
    dp = parts.dp
    extra = {"optimizer_step": step, "world_size": ctx.world_size, "data": {"next_step": step,
             "consumed_samples": BatchSizes.of(config.training).start(step)}, "config": to_dict(config),
             **({"loss_scaler": dp.scaler.state_dict()} if dp.scaler is not None else {})}
    kw = dict(model=parts.model, optimizer=dp, writes_params=writes, optim_shards=dp.optim_shards(),
              writes_optim=dp.shards_state or writes, extra=extra)
    with dp.full_params():  # ZeRO-3: the parameters whole while they are written (async: copied)
        if saver is not None:
            return saver.save(root, step, **kw)
        return ckpt.save_checkpoint(root, step, rank=ctx.rank, barrier=lambda: comm.barrier(ctx.world_group),
                                    all_ok=lambda ok: _all_ok(ok, ctx), **kw)


def _all_ok(ok: bool, ctx: RankContext) -> bool:
    bad = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
    comm.all_reduce_(bad, ctx.world_group, tag="checkpoint")
    return float(bad) == 0


def _step(config: Config, ctx: RankContext, step: int, parts: Parts, train_loader):
    """Train step `step`: forward/backward per microbatch, or through the pipeline schedule (PP > 1)."""
    t = config.training
    trace = parts.pipe is not None and config.logging.trace_schedule and step + 1 == t.train_iters
    r = train_step(parts, train_loader.step_batch(step), lr=lr_at(step, t), clip_grad=t.clip_grad,
                   device=ctx.device, trace=trace, per_token_loss=t.calculate_per_token_loss)
    if trace:
        report = trace_report(parts.pipe, r.run, ctx.mesh, ctx.out_dir / "schedule_trace.png")
        if ctx.is_main:
            text = ctx.out_dir / "schedule_trace.txt"
            with writing_file(text, "the measured pipeline timeline"):
                text.write_text(report + "\n")
            tqdm.write(report)
    return r


def build(config: Config, ctx: RankContext, *, reducer_cls: type[GradReducer] = GradReducer) -> Parts:
    """This rank's model (with PP its stages), parallelized as `config` says (fivefold.train.parallelize:
    CP, recompute, the data-parallel mode): the training loop's, and fivefold.testing.measure's, so
    that a measured step is the step `train` runs."""
    if ctx.layout.pp > 1:  # the stages this rank holds; steps run through the pipeline schedule
        model = build_pipeline(config, ctx.mesh, microbatches_per_step(config, ctx.dp_size), device=ctx.device)
    else:
        model = build_decoder(config, ctx.mesh).to(ctx.device)
    return parallelize(model, ctx.mesh, config, reducer_cls=reducer_cls)


def _exits(t, step: int, began: float, ctx: RankContext) -> bool:
    """Megatron's --exit-interval / --exit-duration-in-mins after `step`: the same answer on every rank
    (the elapsed time is the slowest rank's)."""
    if t.exit_interval and (step + 1) % t.exit_interval == 0:
        return True
    if t.exit_duration_in_mins is None:
        return False
    elapsed = torch.tensor([time.monotonic() - began], dtype=torch.float64)
    comm.all_reduce_(elapsed, ctx.world_group, tag="exit-duration", op="max")
    return float(elapsed) / 60 > t.exit_duration_in_mins


def nothing_to_load(c, warn: bool) -> bool:
    """--load names a folder without any checkpoint and the run may start fresh (Megatron's rule, unless
    --exit-on-missing-checkpoint); a folder in a format we cannot read is never "nothing"."""
    path = Path(c.load)
    if c.exit_on_missing_checkpoint or ckpt.resolve(path) is not None or ckpt.foreign_format(path):
        return False
    if warn:
        print(f"warning: --load {c.load}: no checkpoint there yet; training starts from step 0 (give "
              "--exit-on-missing-checkpoint to stop instead)", file=sys.stderr, flush=True)
    return True


def train(config: Config, ctx: RankContext, data_dir: Path, *, progress: bool = True) -> TrainResult:
    t = config.training
    parts = build(config, ctx)
    model, pipe, dp = parts.model, parts.pipe, parts.dp
    train_loader, eval_loader = _loaders(config, ctx, data_dir)
    start = 0
    c = config.checkpoint
    if c.load and not nothing_to_load(c, ctx.is_main):
        optim = c.load_optim and not c.finetune
        with dp.full_params(writes=True):
            meta = ckpt.load_checkpoint(c.load, model=model, optimizer=dp if optim else None, rank=ctx.rank,
                                        world_size=ctx.world_size, optim_shards=dp.optim_shards(),
                                        model_config=to_dict(config)["model"], load_rng=c.load_rng and not c.finetune)
        start = 0 if c.finetune else resume_step(meta, Path(c.load))
        if not optim:  # --no-load-optim / --finetune: AdamW fresh; main parameters from the loaded weights
            dp.reload_mains()
        elif dp.scaler is not None and "loss_scaler" in meta:
            dp.scaler.load_state_dict(meta["loss_scaler"])
    elif c.load_hf:  # weights only: AdamW starts fresh at step 0 (Megatron's --finetune)
        with dp.full_params(writes=True):
            read_hf_shards(model, c.load_hf, config.model)
        dp.reload_mains()
    save_root = Path(config.checkpoint.save or ctx.out_dir / "checkpoints")
    saver = AsyncSaver(ctx.rank, lambda: comm.barrier(ctx.world_group), lambda ok: _all_ok(ok, ctx)) \
        if config.checkpoint.async_save else None
    lg = config.logging
    log = MetricsLog(ctx.out_dir, lg.tensorboard, resume_from=start, tensorboard_dir=lg.tensorboard_dir,
                     wandb_project=lg.wandb_project, wandb_exp_name=lg.wandb_exp_name) if ctx.is_main else None
    fpt = flops_per_token(config.model, t.seq_length)
    result = TrainResult(start_step=start)
    bar = tqdm(total=t.train_iters, initial=start, disable=not (progress and ctx.is_main), desc="train",
               dynamic_ncols=True)
    times = []
    profiler = StepProfiler(config.logging.profile and ctx.rank in config.logging.profile_ranks,
                            profile_steps(start, t.train_iters), ctx.out_dir, ctx.rank, ctx.device)
    began = time.monotonic()
    with manual_gc(t):  # --manual-gc: the collector off while training
        for step in range(start, t.train_iters):
            heartbeat.at_step(step)
            t0 = time.perf_counter()
            with profiler.step(step):
                r = _step(config, ctx, step, parts, train_loader)
            dt = time.perf_counter() - t0
            times.append((r.tokens, dt))
            result.losses[step] = r.loss
            last = step + 1 == t.train_iters or _exits(t, step, began, ctx)
            # Same values on every rank (see train/nonfinite.py): every rank stops at this step.
            # An fp16 step skipped for overflow is not an error: the loss scaler backs off and training goes on.
            stops = t.check_for_nan_in_loss_and_grad and \
                not (is_finite(r.loss) and (r.skipped or is_finite(r.grad_norm)))
            evaluates = eval_loader is not None and ((step + 1) % t.eval_interval == 0 or last) and not stops
            record = {"step": step, "loss": r.loss, "grad_norm": r.grad_norm, "lr": lr_at(step, t),
                      "tokens": r.tokens, "step_time_s": dt, "tokens_per_s": r.tokens / dt,
                      "tflops_per_rank": fpt * r.tokens / dt / ctx.world_size / 1e12}
            if r.moe_totals is not None:
                record.update(moe_record(r.moe_totals, config.model, config.logging.moe_per_layer_logging))
            if r.mtp_loss is not None:
                record["mtp_loss"] = r.mtp_loss
            if dp.scaler is not None:  # fp16: the scale the next step uses, and the overflow steps so far
                record.update(loss_scale=dp.scaler.scale, skipped_steps=dp.scaler.skipped)
            every = config.logging.log_interval  # read like save_interval: unset/0 = the last and eval steps only
            logs = bool(every and (step + 1) % every == 0) or last or evaluates or stops
            if logs:  # a collective over every rank: once per metrics line, not every step
                peak = comm.all_gather(torch.tensor([peak_memory_bytes(ctx.device)], dtype=torch.float64), 0,
                                       ctx.world_group, tag="metrics")  # (world,)
                record["peak_memory_mib"] = [round(float(b) / 2**20, 1) for b in peak]
                result.peak_memory = [int(b) for b in peak]
            if evaluates:
                batches = [eval_loader.step_batch(i) for i in range(t.eval_iters)]
                with around_eval(t):
                    record["eval_loss"] = result.eval_losses[step] = evaluate(
                        model, batches, dp_group=ctx.dp_group, device=ctx.device) if pipe is None \
                        else pipeline_evaluate(pipe, batches, mesh=ctx.mesh)
            if log is not None and logs:
                log.write(record)
            if stops:  # before this step's checkpoint: the last one written stays the last good one
                bar.close()
                if saver is not None:
                    saver.finish()
                raise nonfinite_error(step, r.loss, r.grad_norm, model, ctx.world_group,
                                      result.checkpoint or config.checkpoint.load)
            bar.set_postfix(loss=f"{r.loss:.4f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
            interval = config.checkpoint.save_interval
            if (interval and (step + 1) % interval == 0) or last:
                result.checkpoint = _save(config, ctx, save_root, step + 1, parts, saver)
            after_step(t, step)  # --manual-gc-interval
            if last:
                break
    bar.close()
    if saver is not None:
        saver.finish()  # the last checkpoint committed before anything reads it
    if config.checkpoint.save_hf and result.checkpoint is not None:
        if ctx.is_main:
            export_hf(result.checkpoint, config.checkpoint.save_hf)
        comm.barrier(ctx.world_group)  # every rank returns once the folder is complete
    result.optimizer_state_bytes = state_bytes(dp)
    steady = times[1:] or times  # the first step pays for warm-up (allocations, thread pools)
    result.tokens_per_s = sum(n for n, _ in steady) / max(1e-9, sum(dt for _, dt in steady))
    if log is not None:
        log.close()
        if result.losses or log.path.stat().st_size:
            result.plot = plot_loss_curve(log.path, ctx.out_dir / "loss.png", title=layout_text(ctx.layout))
            if config.logging.moe_per_layer_logging:
                result.expert_load_plot = plot_expert_load(read_metrics(log.path), ctx.out_dir / "expert_load.png")
    return result
