"""Per-rank heartbeats: the step and the collective in flight, where a watchdog can read them.

Each rank keeps one small memory-mapped file, FOLDER/heartbeat-R (SIZE bytes): writing it is a
few stores into shared memory, no system call, so every collective can mark itself (`in_flight`,
called by fivefold.runtime.collectives around each blocking op) at a cost of ~2 us. A daemon thread
stamps `alive` every `tick` seconds; it stops when the process is stopped (SIGSTOP) or when native
code holds the GIL, which is how a watcher tells a rank that does not run from one that waits.
The reader is fivefold.watchdog (the launcher's monitor, or the rank's own thread under torchrun).

One heartbeat per process (like the traffic counters): `start` installs it, `stop` removes it;
without one, `in_flight` costs one global lookup. `start` also registers faulthandler on SIGUSR1, so
`kill -USR1 PID` makes the rank write every thread's Python stack to its stderr, unless the rank
registered it at its start already (a launched rank: fivefold.runtime.startup, into OUT/logs/rank-R.stack).

Layout (little-endian): alive (double, written by the thread only) | seq (u64; odd while the main
thread writes) | pid, step (i64) | ops (u64: collectives entered) | changed, since (double:
time.time() of the last progress, and of entering the collective in flight, 0 when none) | what
(WHAT_BYTES of UTF-8: the collective in flight, or the last one).
"""
from __future__ import annotations

import faulthandler
import math
import mmap
import os
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fivefold.runtime import startup

_ALIVE = struct.Struct("<d")
_SEQ = struct.Struct("<Q")
WHAT_BYTES = 200
_BODY = struct.Struct(f"<qqQdd{WHAT_BYTES}s")
_BODY_AT = _ALIVE.size + _SEQ.size
SIZE = _BODY_AT + _BODY.size


def path_of(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"heartbeat-{rank}"


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat as read from its file (times are time.time())."""

    rank: int
    pid: int
    step: int
    """The training step in progress; -1 before the first."""
    ops: int
    """Collectives entered so far."""
    alive: float
    """The last tick of the rank's heartbeat thread."""
    changed: float
    """The last progress: a step started, a collective entered or left."""
    since: float
    """When the collective in flight was entered; 0 when none is."""
    what: str
    """The collective in flight (or, when none is, the last one), e.g. 'all_reduce tag=loss group=dp'."""

    @property
    def in_flight(self) -> bool:
        return self.since > 0


def read(folder: str | Path, rank: int) -> Beat | None:
    """Rank `rank`'s heartbeat, or None when it has none (yet)."""
    try:
        with open(path_of(folder, rank), "rb") as f:
            for _ in range(10):  # retry while the rank is halfway through a write (seq odd or changed)
                buf = os.pread(f.fileno(), SIZE, 0)
                if len(buf) < SIZE:
                    return None
                (seq,) = _SEQ.unpack_from(buf, _ALIVE.size)
                if seq % 2 == 0 and os.pread(f.fileno(), _SEQ.size, _ALIVE.size) == buf[_ALIVE.size:_BODY_AT]:
                    break
    except OSError:
        return None
    (alive,) = _ALIVE.unpack_from(buf, 0)
    pid, step, ops, changed, since, what = _BODY.unpack_from(buf, _BODY_AT)
    return Beat(rank, pid, step, ops, alive, changed, since, what.rstrip(b"\0").decode(errors="replace"))


class Heartbeat:
    """This rank's heartbeat file and the thread that stamps it."""

    def __init__(self, folder: str | Path, rank: int, *, tick: float = 1.0,
                 on_tick: Callable[[Heartbeat], None] | None = None):
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path, self.rank = path_of(folder, rank), rank
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.step, self.ops, self.since, self.what = -1, 0, 0.0, ""
        self.changed = time.time()
        self._seq = 0
        self._stamp()
        self._write()
        self._stop = threading.Event()
        self._tick, self._on_tick = tick, on_tick
        self._thread = threading.Thread(target=self._run, name="fivefold-heartbeat", daemon=True)
        self._thread.start()

    def _stamp(self) -> None:
        _ALIVE.pack_into(self._mm, 0, time.time())

    def _write(self) -> None:
        self._seq += 1
        _SEQ.pack_into(self._mm, _ALIVE.size, self._seq)  # odd: a reader retries
        _BODY.pack_into(self._mm, _BODY_AT, os.getpid(), self.step, self.ops, self.changed, self.since,
                        self.what.encode()[:WHAT_BYTES])
        self._seq += 1
        _SEQ.pack_into(self._mm, _ALIVE.size, self._seq)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            self._stamp()
            if self._on_tick is not None:
                self._on_tick(self)

    def at_step(self, step: int) -> None:
        self.step, self.changed = step, time.time()
        self._write()

    def enter(self, what: str) -> None:
        self.ops += 1
        self.since = self.changed = time.time()
        self.what = what
        self._write()

    def leave(self) -> None:
        self.since, self.changed = 0.0, time.time()
        self._write()

    def close(self) -> None:
        """Stop the thread and mark the rank as leaving (`alive` = inf: a watcher takes the silence of a rank
        that is ending, its process group torn down and the interpreter exiting, for no hang)."""
        self._stop.set()
        self._thread.join(timeout=2 * self._tick)
        _ALIVE.pack_into(self._mm, 0, math.inf)
        self._mm.close()


_current: Heartbeat | None = None
_dumps_to_stderr = False


def start(folder: str | Path, rank: int, *, tick: float = 1.0,
          on_tick: Callable[[Heartbeat], None] | None = None) -> Heartbeat:
    """Install this process's heartbeat (replacing any) and the SIGUSR1 stack dump."""
    global _current, _dumps_to_stderr
    stop()
    _current = Heartbeat(folder, rank, tick=tick, on_tick=on_tick)
    if hasattr(signal, "SIGUSR1") and not startup.stacks_to_file():
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        _dumps_to_stderr = True
    return _current


def stop() -> None:
    global _current, _dumps_to_stderr
    if _current is not None:
        _current.close()
        _current = None
    if _dumps_to_stderr:
        faulthandler.unregister(signal.SIGUSR1)
        _dumps_to_stderr = False


def at_step(step: int) -> None:
    if _current is not None:
        _current.at_step(step)


class in_flight:  # noqa: N801 - used as a function: `with in_flight(...)`
    """Mark the block as collective `kind` issued by `tag` over `group` (a no-op without a heartbeat).
    A class rather than a @contextmanager generator: this runs around every collective."""

    __slots__ = ("what",)

    def __init__(self, kind: str, tag: str, group: str):
        self.what = (kind, tag, group)

    def __enter__(self) -> None:
        if _current is not None:
            kind, tag, group = self.what
            _current.enter(f"{kind} tag={tag} group={group}")

    def __exit__(self, *exc) -> None:
        if _current is not None:
            _current.leave()
