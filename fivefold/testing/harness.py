"""Run a function on N gloo ranks and get each rank's result back, reusing the started workers.

    pool = Workers(4)
    results = pool.run(case, 3)   # case(rank, world, 3) on ranks 0..3, results[r] from rank r
    pool.close()

Workers are spawned once (importing torch costs ~1.3 s per process) with `torch.distributed`
initialised over all N (gloo, one intra-op thread each), then loop: receive (fn, args), run, send back
the result or the traceback. A failure raises RankFailed naming the rank with its traceback; a case
that does not finish within the timeout kills the pool (a rank stuck in a collective cannot be
recovered) and raises; the next `run` starts a fresh pool. The workers' temporary files (among them
the folder multiprocessing makes to hand a tensor's file descriptor over the pipe) go into one folder
of the pool's, removed when it closes: a killed worker leaves nothing behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

from fivefold.launch import free_port

GRACE_S = 5.0
"""After a rank fails, how long the others get to finish before the pool is deemed stuck."""


class RankFailed(RuntimeError):
    """A test function raised on one (or more) ranks; the message has each failed rank's traceback."""

    def __init__(self, failures: dict[int, str], fn_name: str):
        self.failures = failures
        parts = [f"rank {r} failed in {fn_name}:\n{tb}" for r, tb in sorted(failures.items())]
        super().__init__("\n".join(parts))


class WorkersTimeout(TimeoutError):
    """A case did not finish within its timeout; the pool was killed."""


def _worker(rank: int, world: int, port: int, conn, tmp: str) -> None:
    tempfile.tempdir = tmp  # before anything makes a temporary file (multiprocessing's pymp-* folder too)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - any failure goes back to the caller with its traceback
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class Workers:
    """N spawned gloo ranks, started once, reused across test cases."""

    def __init__(self, world_size: int, *, timeout: float = 120, grace: float = GRACE_S):
        self.world_size, self.timeout, self.grace = world_size, timeout, grace
        self._procs: list = []
        self._conns: list = []
        self._tmp: str | None = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._tmp = tempfile.mkdtemp(prefix="fivefold-workers-")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world_size, port, child, self._tmp),
                            daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        replies = self._collect(time.monotonic() + self.timeout, "starting the workers")
        failures = {r: v for r, (kind, v) in replies.items() if kind == "error"}
        if failures:
            self.close()
            raise RankFailed(failures, "startup")

    def _collect(self, deadline: float, what: str) -> dict[int, tuple[str, object]]:
        """Each rank's reply; on a failure the others get `grace` seconds more; past the deadline: kill, raise."""
        replies: dict[int, tuple[str, object]] = {}
        while len(replies) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                missing = [r for r in range(self.world_size) if r not in replies]
                errors = {r: v for r, (k, v) in replies.items() if k == "error"}
                self.close(kill=True)
                if errors:
                    raise RankFailed(errors, what)
                raise WorkersTimeout(f"{what} on {self.world_size} ranks did not finish within the timeout; "
                                     f"ranks {missing} never answered (pool killed; the next run restarts it)")
            for r, conn in enumerate(self._conns):
                if r in replies or not conn.poll(0):
                    continue
                try:
                    replies[r] = conn.recv()
                except EOFError:
                    code = self._procs[r].exitcode
                    replies[r] = ("error", f"the worker process died (exit code {code})")
                if replies[r][0] == "error":
                    deadline = min(deadline, time.monotonic() + self.grace)
            if len(replies) < self.world_size:
                time.sleep(0.002)
        return replies

    def run(self, fn, *args, timeout: float | None = None) -> list:
        """fn(rank, world, *args) on every rank (fn importable by name); each rank's result, by rank."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args))
        name = getattr(fn, "__qualname__", repr(fn))
        replies = self._collect(time.monotonic() + (timeout or self.timeout), name)
        failures = {r: v for r, (kind, v) in replies.items() if kind == "error"}
        if failures:
            raise RankFailed(failures, name)
        return [replies[r][1] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        """Stop the workers (politely, unless `kill`)."""
        for conn in self._conns:
            if not kill:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self._procs:
            if not kill:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for conn in self._conns:
            conn.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._procs, self._conns, self._tmp = [], [], None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
