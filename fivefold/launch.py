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
the job up, with its step and the collective it is in. A rank still starting (alive, no heartbeat
yet) is no hang up to the start-up bound (fivefold.watchdog.startup_bound). Then each live rank is
asked for its Python stack (SIGUSR1: faulthandler, registered by the rank as its first act, writes
OUT/logs/rank-R.stack); the message quotes the named rank's and names the files, or says why a rank
has none (stopped: a stopped process runs no handler). Then all are killed and the launcher exits 1.
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
from fivefold.runtime import startup
from fivefold.watchdog import SHOWN, STOPPED, Hang, Monitor, clear, process_state

POLL_S = 0.05
GRACE_S = 3.0
STACKS_S = 5.0
"""After a hang, how long the live ranks get to write their Python stacks before they are killed (a
loaded node may take seconds to schedule them; the wait ends when all have written)."""
QUOTED = 16
"""Lines of the named rank's Python stack quoted in a hang message."""


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


def _quote(stack: str) -> str:
    """The main thread's part of a faulthandler dump (the thread that ran the handler), QUOTED lines at most."""
    blocks = stack.strip().split("\n\n")
    main = next((b for b in blocks if b.startswith("Current thread")), blocks[0]).splitlines()
    return "\n".join(main[:QUOTED] + ([f"  ... ({len(main) - QUOTED} more lines)"] if len(main) > QUOTED else []))


def _stacks(procs: list[subprocess.Popen], log_dir: Path) -> dict[int, str]:
    """Ask each live rank for its Python stack; returns rank -> its stack's text, or why it has none."""
    asked, why = {}, {}
    for r, p in enumerate(procs):
        state = process_state(p.pid) if p.poll() is None else None
        if state is None:
            why[r] = "none: its process had ended"
        elif state in STOPPED:
            why[r] = "none: it is stopped (SIGSTOP, or a debugger holds it), and a stopped process runs no handler"
        elif startup.read_stamp(log_dir, r) is None:
            why[r] = "none: it had not yet registered its stack handler (Python was still starting)"
        else:
            path = startup.stack_path(log_dir, r)
            asked[r] = (path, _size(path))  # the file may hold earlier dumps (`kill -USR1` by hand): read what follows
            p.send_signal(startup.STACK_SIGNAL)
    deadline = time.monotonic() + STACKS_S
    while time.monotonic() < deadline and not all(_size(path) > at for path, at in asked.values()):
        time.sleep(POLL_S)
    time.sleep(0.2)  # a dump is written in pieces: let the last one finish
    for r, (path, at) in asked.items():
        with open(path, "rb") as f:
            f.seek(at)
            text = f.read().decode(errors="replace")
        why[r] = text if "most recent call first" in text else \
            f"none: it wrote nothing in {STACKS_S:g} s (stuck in native code that holds the GIL?)"
    return why


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _hang(hang: Hang, procs: list[subprocess.Popen], log_dir: Path) -> int:
    """Every live rank writes its Python stack, then all are killed; prints the hang with the stacks, returns 1."""
    stacks = _stacks(procs, log_dir)
    _stop(procs, grace=0.0)
    lines = [f"error: {hang.message}", "the job was stopped."]
    for r in hang.suspects[:1]:
        text = stacks[r]
        lines.append(f"rank {r}'s Python stack ({startup.stack_path(log_dir, r)}):\n{_quote(text)}"
                     if not text.startswith("none:") else f"rank {r}'s Python stack: {text}")
    listed = [f"  rank {r}: {startup.stack_path(log_dir, r) if not text.startswith('none:') else text}"
              for r, text in sorted(stacks.items())]
    lines.append("Python stacks of the ranks:\n" + "\n".join(listed[:SHOWN]) +
                 (f"\n  ... and {len(listed) - SHOWN} more ranks" if len(listed) > SHOWN else ""))
    lines.append("The timeout is training.distributed_timeout_minutes (--distributed-timeout-minutes) or "
                 "training.distributed_timeout_seconds")
    print("\n".join(lines), file=sys.stderr)
    return 1


def launch(nproc: int, worker_args: list[str], log_dir: Path, *, timeout_s: float = 600.0,
           startup_s: float | None = None) -> int:
    """Run `python -m fivefold.cli.rank *worker_args` on ranks 0..nproc-1; 0 when all succeed.
    A job whose ranks make no progress for `timeout_s` is stopped (see the module docstring); ranks
    still starting are waited for `startup_s` (default fivefold.watchdog.startup_bound)."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        for old in log_dir.glob("rank-*.error"):
            old.unlink()
        clear(log_dir)
        logs = [None] + [open(log_dir / f"rank-{r}.log", "w") for r in range(1, nproc)]
    except OSError as e:
        raise write_failed(e.filename or log_dir, e, "the ranks' logs") from None
    monitor = Monitor(log_dir, nproc, timeout_s, startup_s)
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
            hang = monitor.check({r: p.pid for r, p in enumerate(procs) if p.poll() is None})
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
