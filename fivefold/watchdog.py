"""Hang watchdog: a job whose ranks make no progress ends with a message naming the rank that holds it up.

It reads the ranks' heartbeats (fivefold.runtime.heartbeat: step, collective in flight, and a thread's
`alive` stamp). A job hangs when some rank has waited in one collective for the timeout, or has not
run (its heartbeat thread silent) for the timeout, or has not started within it. The rank named is:
  1. a rank that does not run (stopped by SIGSTOP, or stuck in native code that holds the GIL),
  2. else a rank that never started,
  3. else a rank outside any collective while others wait for it (busy, or stuck in Python),
  4. else (every rank waits: mismatched collectives) the ranks that entered the fewest collectives.
The local launcher (fivefold.launch) runs `Monitor` beside its ranks; under torchrun, where no
launcher of ours runs, each rank's heartbeat thread runs `self_watch` (see docs/training.md).
Pure Python, no torch: the launcher imports it.
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fivefold.errors import UserError
from fivefold.runtime import heartbeat
from fivefold.runtime.heartbeat import Beat, Heartbeat

SHOWN = 8
"""Ranks listed one per line in a hang message; the rest are counted."""
STARTUP_S = 60.0
"""While a rank has no heartbeat yet, the job is starting (ranks import torch, then meet in
init_process_group): no hang is declared before max(timeout, STARTUP_S) from the start."""
LONGEST_S = 7 * 86400.0
"""The longest timeout accepted (a week); longer ones are refused, not silently capped."""


def timeout_of(training) -> float:
    """Seconds of a TrainingConfig's distributed timeout: distributed_timeout_seconds when set, else
    distributed_timeout_minutes x 60. UserError unless it is > 0 and at most a week."""
    if training.distributed_timeout_seconds is not None:
        field, value, seconds = "seconds", training.distributed_timeout_seconds, training.distributed_timeout_seconds
    else:
        field, value = "minutes", training.distributed_timeout_minutes
        seconds = 60 * value
    if not (math.isfinite(seconds) and 0 < seconds <= LONGEST_S):
        raise UserError(f"training.distributed_timeout_{field}={value!r}: must be > 0 and at most a week "
                        f"({LONGEST_S / 60:g} minutes); the default is 10 minutes")
    return seconds


def tick_for(timeout_s: float) -> float:
    """How often a rank stamps its heartbeat (and a watcher looks): 1 s, finer for short timeouts."""
    return min(1.0, timeout_s / 10)


def silent_after(timeout_s: float) -> float:
    """A heartbeat thread this late (several missed ticks) means the rank's Python does not run."""
    return min(timeout_s, max(3 * tick_for(timeout_s), 2.0))


def _where(b: Beat, now: float) -> str:
    step = f"at step {b.step}" if b.step >= 0 else "before the first step"
    if b.in_flight:
        return f"{step}, in {b.what} for {now - b.since:.0f} s"
    return f"{step}, not in a collective (last: {b.what or 'none'})"


def find_hang(beats: dict[int, Beat | None], now: float, timeout_s: float, started: float,
              ready: float = 0.0) -> str | None:
    """The hang message when a rank of `beats` (rank -> heartbeat, None when it has none; only the
    ranks still running) has made no progress for `timeout_s`, else None. `started`: when the ranks
    were started; `ready`: when the last of them wrote its first heartbeat (a wait counts from then:
    ranks that were early to init_process_group did not wait for a hung peer). Times are time.time()."""
    if any(b is None for b in beats.values()) and now - started <= max(timeout_s, STARTUP_S):
        return None  # still starting
    stuck = any(b is None or now - b.alive > timeout_s or (b.in_flight and now - max(b.since, ready) > timeout_s)
                for b in beats.values())
    if not stuck:
        return None
    missing = sorted(r for r, b in beats.items() if b is None)
    seen = {r: b for r, b in beats.items() if b is not None}
    silent = sorted(r for r, b in seen.items() if now - b.alive > silent_after(timeout_s))
    waiting = [r for r, b in seen.items() if b.in_flight]
    busy = sorted(r for r, b in seen.items() if not b.in_flight and r not in silent)
    if silent:
        suspects, why = silent, "is not running (stopped, or stuck in native code holding the GIL; " \
                                "heartbeat silent for {quiet:.0f} s)"
    elif missing:
        suspects, why = missing, "has no heartbeat (not started, or on another node)"
    elif busy and waiting:
        suspects, why = busy, "is outside any collective while its peers wait for it (busy, or stuck in Python)"
    else:
        fewest = min(b.ops for b in seen.values())
        suspects, why = sorted(r for r, b in seen.items() if b.ops == fewest), \
            "waits in a collective its peers never entered (they are past it, or in another one)"
    lines = [f"no progress for {timeout_s:g} s (the distributed timeout):"]
    for r in suspects:
        b = seen.get(r)
        detail = f", {_where(b, now)}" if b is not None else ""
        lines.append(f"rank {r} {why.format(quiet=now - b.alive if b else 0)}{detail}")
    others = [r for r in sorted(beats) if r not in suspects]
    for r in others[:SHOWN]:
        b = seen.get(r)
        lines.append(f"  rank {r}: {_where(b, now) if b else 'no heartbeat'}")
    if len(others) > SHOWN:
        lines.append(f"  ... and {len(others) - SHOWN} more ranks")
    return "\n".join(lines)


def read_all(folder: str | Path, ranks) -> dict[int, Beat | None]:
    return {r: heartbeat.read(folder, r) for r in ranks}


def clear(folder: str | Path) -> None:
    """Remove heartbeats left by an earlier run in `folder`."""
    for old in Path(folder).glob("heartbeat-*"):
        old.unlink(missing_ok=True)


class Monitor:
    """The launcher's watcher over ranks 0..world-1 whose heartbeats live in `folder`."""

    def __init__(self, folder: str | Path, world: int, timeout_s: float):
        self.folder, self.world, self.timeout_s = Path(folder), world, timeout_s
        self.started = time.time()
        self.ready = 0.0
        """When every rank had written a heartbeat (0 until then)."""
        self._next = 0.0

    def check(self, running: list[int]) -> str | None:
        """The hang message over the `running` ranks, or None (reads the files at most every half tick)."""
        now = time.time()
        if now < self._next:
            return None
        self._next = now + tick_for(self.timeout_s) / 2
        beats = read_all(self.folder, running)
        if not self.ready and all(b is not None for b in beats.values()):
            self.ready = now
        return find_hang(beats, now, self.timeout_s, self.started, self.ready)


def self_watch(folder: str | Path, world: int, timeout_s: float,
               error_file: Path | None = None) -> Callable[[Heartbeat], None]:
    """A heartbeat `on_tick` for a rank with no launcher of ours watching (torchrun): when this rank has
    waited in one collective for `timeout_s`, it names the stuck rank from the heartbeats it can read
    (the ranks of this node), writes its own Python stack to stderr and exits 1; torchrun then stops
    the other ranks. A stopped rank cannot watch itself: the peers that wait for it name it."""
    started = time.time()

    def check(beat: Heartbeat) -> None:
        now = time.time()
        if not (beat.since and now - beat.since > timeout_s):
            return
        beats = {r: b for r, b in read_all(folder, range(world)).items()}
        message = find_hang(beats, now, timeout_s, started) or \
            f"rank {beat.rank} waited {now - beat.since:.0f} s in {beat.what} at step {beat.step}"
        sys.stderr.write(f"error (rank {beat.rank}): {message}\nits Python stack:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if error_file is not None:
            error_file.write_text(json.dumps({"kind": "hang", "message": message}))
        os._exit(1)

    return check
