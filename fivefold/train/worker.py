"""One rank of a training job: `run_rank`, called by `python -m fivefold.cli.rank OUT/run.json` (started by
the launcher) or in-process under torchrun. Reads the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

A rank that fails writes OUT/logs/rank-R.error (JSON: kind "user" with the message, "stopped" with
the message of a run stopped on purpose (a non-finite loss or gradient norm), or "crash" with the
traceback) so that the launcher can report it, and exits 2 (user error) or 1.

Each rank keeps a heartbeat in OUT/logs (fivefold.runtime.heartbeat) for the hang watchdog: the
launcher's, or under torchrun the rank's own (fivefold.watchdog.self_watch).
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from fivefold.config.schema import Config
from fivefold.config.validate import layout_of
from fivefold.checkpoint.io import PeerFailed
from fivefold.errors import UserError
from fivefold.runtime import heartbeat
from fivefold.runtime.mesh import Mesh, init_distributed
from fivefold.train.context import RankContext, layout_text
from fivefold.train.loop import TrainResult, train
from fivefold.train.nonfinite import NonFiniteError
from fivefold.watchdog import self_watch, startup_bound, tick_for, timeout_of

PG_SLACK_S = 60.0
"""The process group's own timeout is the watchdog's start-up bound (fivefold.watchdog.startup_bound:
init_process_group waits that long for a peer still importing) plus this: the watchdog, which names
the stuck rank, fires first; torch's timeout remains a backstop."""


def init_rank(config: Config, out_dir: Path) -> RankContext:
    """Join the process group (NCCL on CUDA, gloo on CPU) and build this rank's mesh."""
    timeout = timedelta(seconds=startup_bound(timeout_of(config.training)) + PG_SLACK_S)
    with heartbeat.in_flight("init_process_group", "init", "world"):
        rank, world, device = init_distributed(timeout=timeout, device=config.cluster.device)
    layout = layout_of(config)
    if layout.world_size != world:
        raise UserError(f"the layout needs {layout.world_size} ranks, the job has {world}")
    with heartbeat.in_flight("new_group", "mesh", "world"):  # every rank creates every process group
        mesh = Mesh.build(layout, device=device)
    return RankContext(mesh, out_dir)


def describe(ctx: RankContext, backend: str, config: Config) -> str:
    p = config.parallel
    extras = (["SP"] if p.sequence_parallel and ctx.layout.tp > 1 else []) + \
        ([f"CP {p.cp_comm_type}"] if ctx.layout.cp > 1 else []) + \
        ([f"schedule {p.pipeline_schedule_csv or p.pipeline_schedule}"] if ctx.layout.pp > 1 else [])
    return (f"{layout_text(ctx.layout)}{''.join(', ' + e for e in extras)} (order {ctx.layout.order}), "
            f"{ctx.world_size} ranks, {backend} on {ctx.device.type}")


def summary(result: TrainResult, ctx: RankContext, config: Config, first_loss: float | None) -> str:
    lines = [f"layout: {describe(ctx, dist.get_backend(), config)}"]
    if result.losses:
        last = result.losses[max(result.losses)]
        if first_loss:
            lines.append(f"loss: {first_loss:.4f} -> {last:.4f} ({(last - first_loss) / first_loss:+.0%}) "
                         f"at step {max(result.losses) + 1}")
    elif result.start_step >= config.training.train_iters:  # (Megatron's loop runs no step either)
        lines.append(f"nothing trained: the loaded checkpoint is at step {result.start_step}, training.train_iters="
                     f"{config.training.train_iters} (--train-iters); raise it to train on")
        return "\n".join(lines)
    if result.eval_losses:
        lines.append(f"eval loss: {result.eval_losses[max(result.eval_losses)]:.4f}")
    lines.append(f"throughput: {result.tokens_per_s:,.0f} tokens/s")
    mem = ", ".join(f"{b / 2**20:.0f}" for b in result.peak_memory)
    lines.append(f"peak memory per rank (MiB, {'CUDA tensors' if ctx.device.type == 'cuda' else 'process RSS'}): {mem}")
    lines.append(f"checkpoint: {result.checkpoint}")
    lines.append(f"metrics: {ctx.out_dir / 'metrics.jsonl'}   loss curve: {result.plot}")
    return "\n".join(lines)


def run_rank(config: Config, out_dir: Path, data_dir: Path, job=None) -> int:
    """Train as this rank (or run `job(config, ctx) -> summary text`, e.g. fivefold.rl); on failure write
    the error file. Returns the exit code."""
    rank = int(os.environ.get("RANK", 0))
    err = out_dir / "logs" / f"rank-{rank}.error"
    try:
        start_heartbeat(config, out_dir / "logs", rank)
        ctx = init_rank(config, out_dir)
        if job is not None:
            text = job(config, ctx)
            if ctx.is_main:
                print(text, flush=True)
            dist.destroy_process_group()
            return 0
        result = train(config, ctx, data_dir)
        if ctx.is_main:
            from fivefold.train.metrics import read_metrics

            rows = read_metrics(out_dir / "metrics.jsonl")
            print(summary(result, ctx, config, rows[0]["loss"] if rows else None), flush=True)
        dist.destroy_process_group()
        return 0
    except UserError as e:
        _error_file(err, {"kind": "user", "message": str(e), **({"peer": True} if isinstance(e, PeerFailed) else {})})
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteError as e:
        err.write_text(json.dumps({"kind": "stopped", "message": str(e)}))
        if rank or not os.environ.get("FIVEFOLD_LAUNCHED"):  # rank 0's launcher prints it once
            print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:  # noqa: BLE001 - any crash is reported with its traceback
        tb = traceback.format_exc()
        _error_file(err, {"kind": "crash", "traceback": tb})
        if peer_lost(e):  # a peer that ended first has the job's error: one line here, its traceback in the file
            print(f"error (rank {rank}): stopped: a peer rank ended ({str(e).splitlines()[0][:200]})", file=sys.stderr,
                  flush=True)
        else:
            print(tb, file=sys.stderr, flush=True)
        return 1
    finally:
        heartbeat.stop()


PEER_LOST = ("Connection closed by peer", "Connection reset", "Broken pipe")
"""What a collective raises on a rank whose peer process ended (gloo's messages)."""


def peer_lost(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(s in str(e) for s in PEER_LOST)


def _error_file(err: Path, info: dict) -> None:
    """The launcher's record of how this rank ended; a full disk leaves it unwritten (the console says)."""
    try:
        err.parent.mkdir(parents=True, exist_ok=True)
        err.write_text(json.dumps(info))
    except OSError:
        pass


def start_heartbeat(config: Config, log_dir: Path, rank: int) -> None:
    """This rank's heartbeat; under torchrun (no launcher of ours watching) it also watches itself."""
    timeout = timeout_of(config.training)
    world = int(os.environ.get("WORLD_SIZE", 1))
    watch = None if os.environ.get("FIVEFOLD_LAUNCHED") else \
        self_watch(log_dir, world, timeout, log_dir / f"rank-{rank}.error")
    heartbeat.start(log_dir, rank, tick=tick_for(timeout), on_tick=watch)
