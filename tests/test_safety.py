"""Hangs end with a name (heartbeats + watchdog), and a non-finite loss or gradient norm stops the run."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from _train_util import corpus, tiny_config, write_spec
from fivefold.checkpoint import io as ckpt
from fivefold.cli.train import prepare
from fivefold.config.load import load_config
from fivefold.config.schema import to_dict
from fivefold.errors import UserError
from fivefold.runtime import heartbeat
from fivefold.runtime.heartbeat import Beat
from fivefold.train.metrics import MetricsLog, plot_loss_curve, read_metrics
from fivefold.watchdog import STARTUP_S, find_hang, timeout_of

REPO = Path(__file__).resolve().parents[1]


# --- heartbeats and the diagnosis (pure, milliseconds) -------------------------------------------

def test_heartbeat_file_round_trip(tmp_path):
    beat = heartbeat.start(tmp_path, 3, tick=0.05)
    try:
        heartbeat.at_step(7)
        with heartbeat.in_flight("all_reduce", "dp-grad", "dp"):
            inside = heartbeat.read(tmp_path, 3)
        after = heartbeat.read(tmp_path, 3)
        time.sleep(0.2)
        ticked = heartbeat.read(tmp_path, 3)
    finally:
        heartbeat.stop()
    assert inside.in_flight and inside.what == "all_reduce tag=dp-grad group=dp" and inside.step == 7
    assert inside.ops == 1 and inside.pid == os.getpid() and inside.rank == 3
    assert not after.in_flight and after.what == inside.what  # the last collective stays named
    assert ticked.alive > after.alive  # the thread stamps it
    assert beat.path == tmp_path / "heartbeat-3" and heartbeat.read(tmp_path, 4) is None
    with heartbeat.in_flight("barrier", "barrier", "world"):  # no heartbeat installed: a no-op
        pass


def _beat(rank, *, step=3, ops=10, alive=100.0, since=0.0, what="all_reduce tag=loss group=dp"):
    return Beat(rank, 1000 + rank, step, ops, alive, since or alive, since, what)


def test_no_hang_before_the_timeout():
    beats = {0: _beat(0, since=95.0), 1: _beat(1, alive=99.0)}
    assert find_hang(beats, now=100.0, timeout_s=10, started=0.0) is None


def test_a_stopped_rank_is_named_with_its_step_and_collective():
    # rank 1 stopped (heartbeat silent) 12 s ago; rank 0 has waited 11 s in the loss all-reduce
    beats = {0: _beat(0, since=89.0), 1: _beat(1, alive=88.0, step=5, what="all_gather tag=metrics group=world")}
    msg = find_hang(beats, now=100.0, timeout_s=10, started=0.0)
    first = msg.splitlines()[1]
    assert first.startswith("rank 1 is not running") and "at step 5" in first
    assert "last: all_gather tag=metrics group=world" in first
    assert "rank 0: at step 3, in all_reduce tag=loss group=dp for 11 s" in msg


def test_a_busy_rank_is_named_when_its_peers_wait():
    beats = {0: _beat(0, since=85.0), 1: _beat(1, since=85.0), 2: _beat(2, ops=9)}
    msg = find_hang(beats, now=100.0, timeout_s=10, started=0.0)
    assert msg.splitlines()[1].startswith("rank 2 is outside any collective")


def test_mismatched_collectives_name_the_rank_behind():
    beats = {0: _beat(0, ops=11, since=85.0), 1: _beat(1, ops=10, since=85.0, what="broadcast tag=x group=pp")}
    msg = find_hang(beats, now=100.0, timeout_s=10, started=0.0)
    assert msg.splitlines()[1].startswith("rank 1 waits in a collective its peers never entered")
    assert "broadcast tag=x group=pp" in msg.splitlines()[1]


def test_a_rank_that_never_started_is_named_after_the_startup_grace():
    beats = {0: _beat(0, since=85.0, step=-1, ops=1, what="init_process_group tag=init group=world"), 1: None}
    # rank 0 waits in init_process_group for rank 1
    assert find_hang(beats, now=100.0, timeout_s=10, started=100.0 - STARTUP_S) is None  # importing torch
    msg = find_hang(beats, now=100.0, timeout_s=10, started=99.0 - STARTUP_S)
    assert "rank 1 has no heartbeat" in msg
    # rank 1 came late, after rank 0 had waited 15 s in init_process_group: the wait counts from then
    beats[1] = _beat(1, since=99.0, what="init_process_group tag=init group=world")
    assert find_hang(beats, now=100.0, timeout_s=10, started=0.0, ready=99.0) is None
    assert find_hang(beats, now=110.0, timeout_s=10, started=0.0, ready=99.0) is not None


def test_timeout_flags_and_fields(tmp_path):
    def cfg(*words):
        return load_config(None, list(words)).config.training

    assert timeout_of(cfg()) == 600  # Megatron's default: 10 minutes
    assert timeout_of(cfg("--distributed-timeout-minutes", "2")) == 120
    assert timeout_of(cfg("--distributed-timeout-minutes", "2", "training.distributed_timeout_seconds=7")) == 7
    assert cfg().check_for_nan_in_loss_and_grad is True
    assert cfg("--no-check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad is False
    assert cfg("--no-check-for-nan-in-loss-and-grad", "--check-for-nan-in-loss-and-grad").check_for_nan_in_loss_and_grad
    for bad in (["--distributed-timeout-minutes", "0"], ["training.distributed_timeout_seconds=-1"],
                ["training.distributed_timeout_seconds=inf"], ["--distributed-timeout-minutes", "1e12"]):
        with pytest.raises(UserError, match="distributed_timeout_.*must be > 0"):
            timeout_of(cfg(*bad))


# --- a stopped rank ends the job, named ----------------------------------------------------------

def _launch(cfg, out: Path, nproc: int) -> subprocess.Popen:
    spec = write_spec(cfg, out, prepare(cfg, out))
    code = ("import sys, pathlib; from fivefold.launch import launch; "
            f"sys.exit(launch({nproc}, [{str(spec)!r}], pathlib.Path({str(out / 'logs')!r}), "
            f"timeout_s={timeout_of(cfg.training)}))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def _wait_for_training(job: subprocess.Popen, out: Path, lines: int = 2) -> None:
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 90
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= lines):
        assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.1)


def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    cfg = tiny_config(corpus(tmp_path / "corpus"), world=2, gbs=4, steps=100000, distributed_timeout_seconds=10)
    out = tmp_path / "out"
    job = _launch(cfg, out, 2)
    try:
        _wait_for_training(job, out)
        pids = json.loads((out / "logs" / "ranks.json").read_text())["pids"]
        os.kill(pids[0], signal.SIGSTOP)  # a stand-in for a rank stuck in a kernel or a dead NIC
        stopped_at = time.monotonic()
        _, err = job.communicate(timeout=40)
    finally:
        job.kill()
    took = time.monotonic() - stopped_at
    assert job.returncode == 1, err
    assert took < 30, f"the job took {took:.0f} s to end"
    assert "no progress for 10 s" in err and "rank 0 is not running: stopped (SIGSTOP" in err, err
    named = next(line for line in err.splitlines() if line.startswith("rank 0 is not running"))
    assert "at step" in named and ("in " in named or "last: " in named)
    assert "rank 1: at step" in err  # where the peer waits
    # the stopped rank can give no stack, and the message says why; the live one wrote its own, in the
    # collective it waits in
    assert "rank 0's Python stack: none: it is stopped (SIGSTOP, or a debugger holds it)" in err, err
    stack = (out / "logs" / "rank-1.stack").read_text()
    assert "most recent call first" in stack and "collectives.py" in stack
    assert f"rank 1: {out / 'logs' / 'rank-1.stack'}" in err
    assert not any(Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"
                   for p in pids)


# --- non-finite loss or gradient norm ------------------------------------------------------------

def _train_to_nan(tmp_path, *words) -> tuple[subprocess.CompletedProcess, Path]:
    """`fivefold train` of a tiny 2-rank DP config with a huge learning rate and no clipping (as the issue's
    `examples/demo.yaml --lr 1e4 training.clip_grad=0`; warmed up so that checkpoints come first): its
    loss grows ~1000x and its gradient norm goes NaN at step 4 (measured; the tests read the step)."""
    cfg = tiny_config(corpus(tmp_path / "corpus"), world=2, gbs=4, mbs=2, steps=10)
    out = tmp_path / "out"
    config_yaml = tmp_path / "nan.yaml"
    config_yaml.write_text(yaml.safe_dump(to_dict(cfg)))
    cmd = [sys.executable, "-m", "fivefold", "train", str(config_yaml), "--out", str(out),
           "--lr", "60", "--lr-warmup-iters", "8", "training.clip_grad=0", "--save-interval", "2", *words]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return run, out


def test_nan_stops_the_run_at_that_step_and_the_last_good_checkpoint_loads(tmp_path):
    run, out = _train_to_nan(tmp_path)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    bad = next(r["step"] for r in rows if r["loss"] is None or r["grad_norm"] is None)
    assert rows[-1]["step"] == bad  # the step that went non-finite is the last one taken
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: step {bad}: the ")
    assert "first non-finite gradient: rank " in errors[0]
    ckpts = ckpt.complete_checkpoints(out / "checkpoints")
    assert ckpts and int(ckpts[-1].name.split("_")[1]) <= bad  # steps done: nothing of the bad step was saved
    assert f"the last checkpoint is {ckpts[-1]}" in errors[0]
    assert not any((c / ckpt.NONFINITE).exists() for c in ckpts)
    # the last good checkpoint loads into the model and holds finite parameters only
    from fivefold.model import build_decoder
    from fivefold.train.context import RankContext
    from fivefold.config.schema import config_from_dict

    config = config_from_dict(json.loads((out / "run.json").read_text())["config"])
    ctx = RankContext.single(tmp_path / "load")
    model = build_decoder(config, ctx.mesh)
    meta = ckpt.load_checkpoint(ckpts[-1], model=model, optimizer=None, rank=0, world_size=1)
    assert meta["step"] == int(ckpts[-1].name.split("_")[1])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_with_the_check_off_training_goes_on_json_stays_valid_and_the_good_checkpoint_stays(tmp_path):
    run, out = _train_to_nan(tmp_path, "--no-check-for-nan-in-loss-and-grad")
    assert run.returncode == 0, run.stderr
    rows = read_metrics(out / "metrics.jsonl")  # json.loads: NaN would be accepted, so check the text
    assert "NaN" not in (out / "metrics.jsonl").read_text() and "Infinity" not in (out / "metrics.jsonl").read_text()
    assert len(rows) == 10 and rows[-1]["loss"] is None
    ckpts = ckpt.complete_checkpoints(out / "checkpoints")
    finite = [c for c in ckpts if not (c / ckpt.NONFINITE).exists()]
    assert finite, "the last finite checkpoint was rotated out by non-finite ones"
    assert ckpts[-1].name == "step_00000010" and (ckpts[-1] / ckpt.NONFINITE).exists()
    assert set(ckpts) == set(ckpts[-2:]) | {finite[-1]}  # the two newest, and the newest finite one
    assert len(ckpts) == 3  # measured: NaN at step 4, so step_4 is the newest finite, older than 8 and 10
    assert "holds non-finite values" in run.stderr
    assert (out / "loss.png").is_file()


def test_metrics_log_writes_null_for_non_finite_values(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write({"step": 0, "loss": 2.0, "grad_norm": 1.0, "peak_memory_mib": [1.0, 2.0]})
    log.write({"step": 1, "loss": math.nan, "grad_norm": math.inf, "peak_memory_mib": [1.0, -math.inf]})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    strict = {"parse_constant": lambda c: pytest.fail(f"{c} in metrics.jsonl")}  # NaN, Infinity
    rows = [json.loads(line, **strict) for line in text.splitlines()]
    assert rows[1] == {"step": 1, "loss": None, "grad_norm": None, "peak_memory_mib": [1.0, None]}
    assert plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png").is_file()


def test_a_metrics_line_cut_off_by_a_stopped_run_is_left_out(tmp_path, capsys):
    """A run killed while writing metrics.jsonl leaves its last line cut off (no newline): resuming the
    run (which keeps the rows before its step) and `fivefold plot` read the rows before it (a traceback
    once); a damaged line elsewhere is refused naming the file and line."""
    from fivefold.cli import main

    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(3):
        log.write({"step": step, "loss": 2.0 - step / 10})
    log.close()
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text()[:-12])
    assert [r["step"] for r in read_metrics(path)] == [0, 1]
    assert main(["plot", str(tmp_path), "--what", "loss"]) == 0 and (tmp_path / "loss.png").is_file()
    MetricsLog(tmp_path, tensorboard=False, resume_from=2).close()  # a resume at step 2 keeps steps 0 and 1
    assert path.read_text().endswith("\n") and [r["step"] for r in read_metrics(path)] == [0, 1]
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0][:-12] + "\n" + lines[1])
    with pytest.raises(UserError, match=r"metrics.jsonl:1: malformed JSON line"):
        read_metrics(path)
    assert main(["plot", str(tmp_path)]) == 2 and "metrics.jsonl:1: malformed JSON line" in capsys.readouterr().err


def test_under_torchrun_a_rank_waiting_past_the_timeout_names_the_stopped_peer_and_exits(tmp_path):
    """The self-watch (no launcher of ours): rank 0 waits in a collective; rank 1's heartbeat is silent.
    (A whole torchrun job was measured by hand, see docs/training.md; torchrun itself adds 30 s.)"""
    code = f"""
import pathlib, time
from fivefold.runtime import heartbeat
from fivefold.watchdog import self_watch
folder = pathlib.Path({str(tmp_path)!r})
rank_1 = heartbeat.Heartbeat(folder, 1, tick=3600)  # rank 1: its heartbeat never ticks again, as a stopped rank's
heartbeat.start(folder, 0, tick=0.05, on_tick=self_watch(folder, 2, 0.5, error_file=folder / "rank-0.error"))
heartbeat.at_step(4)
with heartbeat.in_flight("all_reduce", "loss", "dp"):
    time.sleep(30)
"""
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert time.monotonic() - t0 < 20 and run.returncode == 1, run.stderr
    assert "error (rank 0): no progress for 0.5 s" in run.stderr and "rank 1 is not running" in run.stderr
    assert "most recent call first" in run.stderr  # its own stack
    assert json.loads((tmp_path / "rank-0.error").read_text())["kind"] == "hang"


def test_plot_of_an_rl_run_draws_its_rl_curves_not_a_loss_curve(tmp_path, capsys):
    """An RL run's metrics.jsonl (`fivefold rl`: reward, KL, entropy, mismatch, and GRPO's loss per step)
    is drawn again as rl.png; it once became loss.png, GRPO's loss labelled as nats per token."""
    import json

    from fivefold.cli import main

    rows = [{"step": s, "reward": 0.1 * s, "exact": 0.0, "kl": 0.01, "entropy": 1.5, "logprob_mismatch": 0.0,
             "loss": -0.2} for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "rl.png").is_file() and not (tmp_path / "loss.png").exists()
    assert main(["plot", str(tmp_path), "--what", "loss"]) == 2
    assert "an RL (GRPO) run's metrics; its curve is --what rl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 2.0}) + "\n")
    assert main(["plot", str(tmp_path), "--what", "rl"]) == 2
    assert "a training run's metrics; its curve is --what loss" in capsys.readouterr().err


@pytest.mark.parametrize("line, says", [('{"step": 5, "loss": [1, 2]}', "loss [1, 2] is not a number"),
                                        ('{"step": 5, "loss": "oops"}', "loss 'oops' is not a number"),
                                        ('{"step": "five", "loss": 1.0}', "step 'five' is not a number")])
def test_plot_refuses_a_metrics_line_that_is_not_a_number(line, says, tmp_path, capsys):
    """A hand-edited metrics.jsonl line with a list (a numpy traceback once) or a string (drawn as text
    labels, the curve out of order once) is named by file and line."""
    from fivefold.cli import main

    (tmp_path / "metrics.jsonl").write_text('{"step": 4, "loss": 2.0}\n' + line + "\n")
    assert main(["plot", str(tmp_path)]) == 2
    assert f"metrics.jsonl:2: {says}" in capsys.readouterr().err
    assert not (tmp_path / "loss.png").exists()
