"""Start N local ranks and watch them: one failing rank ends the whole job within seconds.

Each rank is `python -m fivefold.cli.rank RUN_JSON` with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and one intra-op thread
(OMP_NUM_THREADS=1: N ranks on few cores otherwise oversubscribe them many times over). Rank 0
writes to the terminal; rank R > 0 to OUT/logs/rank-R.log. Ranks die with the launcher (Linux
PR_SET_PDEATHSIG), so no rank outlives it even if it is killed, and ignore SIGINT: Ctrl-C is the
launcher's, which stops them all and says "interrupted" (fivefold.cli), with no rank's traceback.

When a rank exits non-zero, the others are sent SIGTERM, then SIGKILL after a grace period, and the
launcher reports the rank that failed first (its error file, or the tail of its log).

When the ranks make no progress for `timeout_s` (training.distributed_timeout_*: a rank waits in one
collective that long, or stops running), the watchdog (fivefold.watchdog) names the rank that holds
the job up, with its step and the collective it is in; every live rank writes its Python stack to
its log (SIGUSR1, faulthandler), then all are killed and the launcher exits 1.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import UserError, write_failed
from fivefold.watchdog import Monitor, clear

POLL_S = 0.05
GRACE_S = 3.0
STACKS_S = 1.0
"""After a hang, how long the live ranks get to write their Python stacks before they are killed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_signals() -> None:
    """In a rank, before it runs: die with the launcher, and ignore SIGINT. A terminal's Ctrl-C reaches
    the whole process group; a rank still importing torch printed its KeyboardInterrupt traceback
    before the launcher's "interrupted". The launcher alone takes Ctrl-C: it stops the ranks (SIGTERM,
    then SIGKILL: `_stop`), at any point of their run. (An ignored SIGINT stays ignored across exec,
    and Python then installs no KeyboardInterrupt handler of its own.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def place(config, local_ranks: int, rank: int = 0) -> None:
    """Settle `config.cluster.device` for `local_ranks` ranks on this node before a rank starts (the
    ranks read the answer from the config); rank 0 prints why `auto` chose the CPU beside GPUs."""
    from fivefold.runtime.mesh import resolve_device

    config.cluster.device, notice = resolve_device(config.cluster.device, local_ranks)
    if notice and rank == 0:
        print(notice, file=sys.stderr)


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               FIVEFOLD_LAUNCHED="1")
    return env


@dataclass
class Failure:
    rank: int
    returncode: int

    def describe(self) -> str:
        if self.returncode < 0:
            return f"rank {self.rank} was killed by {signal.Signals(-self.returncode).name}"
        return f"rank {self.rank} exited with code {self.returncode}"


def _stop(procs: list[subprocess.Popen], grace: float = GRACE_S) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _report(failure: Failure, log_dir: Path) -> int:
    """Raise UserError for a rank's user error (exit 2), else print what is known and return 1."""
    err = log_dir / f"rank-{failure.rank}.error"
    info = json.loads(err.read_text()) if err.is_file() else {}
    if info.get("kind") == "user":
        raise UserError(f"{info['message']} (rank {failure.rank})")
    if info.get("kind") == "stopped":  # a run stopped on purpose (non-finite loss): its message says all
        print(f"error: {info['message']}", file=sys.stderr)
        return 1
    print(f"error: {failure.describe()}; the job was stopped", file=sys.stderr)
    if failure.rank != 0:
        log = log_dir / f"rank-{failure.rank}.log"
        if log.is_file():
            tail = log.read_text(errors="replace").splitlines()[-25:]
            print(f"--- last lines of {log} ---\n" + "\n".join(tail), file=sys.stderr)
    return 1


def _stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP: it cannot write its stack); False where /proc cannot tell."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _hang(message: str, procs: list[subprocess.Popen], log_dir: Path) -> int:
    """Every live rank writes its Python stack (faulthandler on SIGUSR1), then all are killed; returns 1."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(STACKS_S)
    where = ["rank 0: above" if r == 0 else str(log_dir / f"rank-{r}.log")
             for r, p in enumerate(procs) if not _stopped(p.pid)]
    _stop(procs, grace=0.0)
    print(f"error: {message}\nthe job was stopped; Python stacks of the ranks not stopped: {', '.join(where) or 'none'}. "
          "The timeout is training.distributed_timeout_minutes (--distributed-timeout-minutes) or "
          "training.distributed_timeout_seconds", file=sys.stderr)
    return 1


def launch(nproc: int, worker_args: list[str], log_dir: Path, *, timeout_s: float = 600.0) -> int:
    """Run `python -m fivefold.cli.rank *worker_args` on ranks 0..nproc-1; 0 when all succeed.
    A job whose ranks make no progress for `timeout_s` is stopped (see the module docstring)."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        for old in log_dir.glob("rank-*.error"):
            old.unlink()
        clear(log_dir)
        logs = [None] + [open(log_dir / f"rank-{r}.log", "w") for r in range(1, nproc)]
    except OSError as e:
        raise write_failed(e.filename or log_dir, e, "the ranks' logs") from None
    monitor = Monitor(log_dir, nproc, timeout_s)
    port = free_port()
    procs = []
    try:
        for r in range(nproc):
            out = logs[r]
            procs.append(subprocess.Popen([sys.executable, "-m", "fivefold.cli.rank", *worker_args],
                                          env=rank_env(r, nproc, port), stdout=out,
                                          stderr=subprocess.STDOUT if out else None, preexec_fn=_rank_signals))
        (log_dir / "ranks.json").write_text(json.dumps({"pids": [p.pid for p in procs], "launcher": os.getpid()}))
        while True:
            failed = [Failure(r, p.returncode) for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                # Peers of a dead rank fail right after it (broken connections): prefer the rank that was
                # killed by a signal or reported its own error, then the lowest rank.
                first = min(failed, key=lambda f: (f.returncode >= 0, not (log_dir / f"rank-{f.rank}.error").is_file()
                                                   or _is_peer_error(log_dir, f.rank), f.rank))
                _stop(procs)
                return _report(first, log_dir)
            if all(p.poll() == 0 for p in procs):
                return 0
            hang = monitor.check([r for r, p in enumerate(procs) if p.poll() is None])
            if hang is not None:
                return _hang(hang, procs, log_dir)
            time.sleep(POLL_S)
    finally:
        _stop(procs)
        for f in logs:
            if f:
                f.close()


def _is_peer_error(log_dir: Path, rank: int) -> bool:
    """True when a rank's crash is a collective that lost its peer (the cause is another rank)."""
    try:
        info = json.loads((log_dir / f"rank-{rank}.error").read_text())
    except (OSError, ValueError):
        return False
    tb = info.get("traceback", "")
    return info.get("peer", False) or any(s in tb for s in ("Connection closed by peer", "Connection reset",
                                                             "Broken pipe", "gloo"))
