"""Start-up is not a hang: a rank still importing (alive, no heartbeat yet) is waited for up to the
start-up bound, and can be asked for its stack meanwhile; a rank stopped before its first heartbeat
is a hang after the timeout, named as stopped, with the reason it has no stack."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _train_util import corpus, tiny_config, write_spec
from fivefold.cli.train import prepare
from fivefold.runtime.heartbeat import Beat
from fivefold.watchdog import diagnose, find_hang

REPO = Path(__file__).resolve().parents[1]

SLOW_IMPORT = """import os, sys, time
class _SlowTorch:  # rank {rank} of a launched job: `import torch` takes {delay} s more, as on a loaded node
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep({delay})
if os.environ.get("RANK") == "{rank}" and os.environ.get("FIVEFOLD_LAUNCHED"):
    sys.meta_path.insert(0, _SlowTorch())
"""


def _beat(rank, since=0.0, alive=100.0, ops=1, what="init_process_group tag=init group=world"):
    return Beat(rank, 1000 + rank, -1, ops, alive, since or alive, since, what)


# --- the diagnosis (pure, milliseconds) ----------------------------------------------------------

def test_a_rank_alive_without_a_heartbeat_is_starting_until_the_startup_bound():
    beats = {0: _beat(0, since=50.0), 1: None}  # rank 0 has waited 50 s in init_process_group for rank 1
    assert find_hang(beats, now=100.0, timeout_s=10, started=40.0, startup_s=70, states={0: "S", 1: "R"}) is None
    beats[0] = _beat(0, since=50.0, alive=110.0)
    hang = diagnose(beats, now=111.0, timeout_s=10, started=40.0, startup_s=70, states={0: "S", 1: "D"})
    assert hang.suspects == [1] and hang.message.startswith("not started within 70 s (the start-up bound")
    assert "rank 1 has no heartbeat: alive, still starting" in hang.message


def test_a_rank_stopped_before_its_first_heartbeat_is_a_hang_after_the_timeout():
    beats = {0: _beat(0, since=95.0), 1: None}
    assert find_hang(beats, now=100.0, timeout_s=10, started=95.0, startup_s=600, states={0: "S", 1: "T"}) is None
    beats[0] = _beat(0, since=95.0, alive=106.0)
    hang = diagnose(beats, now=106.0, timeout_s=10, started=95.0, startup_s=600, states={0: "S", 1: "T"})
    assert hang.suspects == [1] and "rank 1 is stopped (SIGSTOP, or a debugger holds it) before its first heartbeat" \
        in hang.message


def test_a_stopped_rank_after_startup_is_named_stopped_and_an_unseen_one_stays_generic():
    beats = {0: _beat(0, since=89.0, ops=5, what="all_reduce tag=loss group=dp"), 1: _beat(1, alive=88.0, ops=4)}
    stopped = find_hang(beats, now=100.0, timeout_s=10, started=0.0, states={0: "S", 1: "T"})
    assert "rank 1 is not running: stopped (SIGSTOP, or a debugger holds it; heartbeat silent for 12 s)" in stopped
    unseen = find_hang(beats, now=100.0, timeout_s=10, started=0.0)  # under torchrun: no process to look at
    assert "rank 1 is not running (stopped, or stuck in native code holding the GIL" in unseen


def test_once_a_rank_left_init_a_missing_heartbeat_is_on_another_node_not_starting():
    """Every rank had joined init_process_group: a rank whose heartbeat is not seen runs elsewhere, and a
    peer's wait for it is a hang after the timeout, not after the start-up bound."""
    beats = {0: _beat(0, since=85.0, ops=3, what="all_reduce tag=loss group=dp"), 1: None}
    hang = diagnose(beats, now=100.0, timeout_s=10, started=0.0, startup_s=600)
    assert hang.suspects == [1] and "runs on another node" in hang.message


# --- launched jobs ---------------------------------------------------------------------------------

def _launch(tmp_path: Path, delay_rank: int, delay_s: float, timeout_s: float, steps: int) -> tuple[subprocess.Popen, Path]:
    cfg = tiny_config(corpus(tmp_path / "corpus"), world=2, gbs=2, steps=steps, distributed_timeout_seconds=timeout_s)
    out = tmp_path / "out"
    spec = write_spec(cfg, out, prepare(cfg, out))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_IMPORT.format(rank=delay_rank, delay=delay_s))
    code = ("import sys, pathlib; from fivefold.launch import launch; "
            f"sys.exit(launch(2, [{str(spec)!r}], pathlib.Path({str(out / 'logs')!r}), timeout_s={timeout_s}))")
    job = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{REPO}"})
    return job, out


def _pid_once_starting(job: subprocess.Popen, out: Path, rank: int) -> int:
    """The pid of `rank` once it has stamped its start (its stack handler registered)."""
    stamp, deadline = out / "logs" / f"starting-{rank}", time.monotonic() + 60
    while not stamp.exists() or not stamp.read_text():
        assert job.poll() is None and time.monotonic() < deadline, "the rank did not start"
        time.sleep(0.05)
    return json.loads(stamp.read_text())["pid"]


def test_a_rank_slow_to_import_is_waited_for_and_gives_its_stack_meanwhile(tmp_path):
    """Rank 1's `import torch` takes 15 s more than rank 0's, with a 2 s timeout: rank 0 waits in
    init_process_group past the timeout, which is no hang while rank 1 is alive and starting. Asked for
    its stack meanwhile (SIGUSR1, which killed a rank still importing), rank 1 writes it: the import."""
    job, out = _launch(tmp_path, delay_rank=1, delay_s=15, timeout_s=2, steps=2)
    try:
        pid = _pid_once_starting(job, out, 1)
        time.sleep(1)
        os.kill(pid, signal.SIGUSR1)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, err
    stack = (out / "logs" / "rank-1.stack").read_text()
    assert "most recent call first" in stack and "sitecustomize.py" in stack and "fivefold/cli/rank.py" in stack


def test_a_rank_stopped_while_it_starts_ends_the_job_after_the_timeout_named_stopped(tmp_path):
    job, out = _launch(tmp_path, delay_rank=1, delay_s=60, timeout_s=3, steps=2)
    try:
        pid = _pid_once_starting(job, out, 1)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    took = time.monotonic() - stopped_at
    assert job.returncode == 1 and took < 3 + 30, (took, err)
    assert "rank 1 is stopped (SIGSTOP, or a debugger holds it) before its first heartbeat" in err, err
    assert "rank 1's Python stack: none: it is stopped (SIGSTOP, or a debugger holds it), and a stopped process " \
           "runs no handler" in err, err
    assert f"rank 0: {out / 'logs' / 'rank-0.stack'}" in err, err  # the rank that waits gave its stack
    assert "init_process_group" in (out / "logs" / "rank-0.stack").read_text() or \
        "most recent call first" in (out / "logs" / "rank-0.stack").read_text()
