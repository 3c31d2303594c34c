"""Hang watchdog: a job whose ranks make no progress ends with a message naming the rank that holds it up.

It reads the ranks' heartbeats (fivefold.runtime.heartbeat: step, collective in flight, and a thread's
`alive` stamp) and, where it can see them, the ranks' processes (/proc/PID/stat). A rank with no
heartbeat yet that is alive and not stopped is still starting: no hang until the start-up bound
(`startup_bound`, 10 minutes or the timeout). Else a job hangs when some rank has waited in one
collective for the timeout, or has not run (its heartbeat thread silent) for the timeout, or was
stopped before its first heartbeat for the timeout. The rank named is:
  1. a rank that does not run (stopped by SIGSTOP, or stuck in native code that holds the GIL),
  2. else a rank stopped before its first heartbeat,
  3. else a rank still starting past the start-up bound,
  4. else a rank outside any collective while others wait for it (busy, or stuck in Python),
  5. else (every rank waits: mismatched collectives) the ranks that entered the fewest collectives.
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
from dataclasses import dataclass
from pathlib import Path

from fivefold.errors import UserError
from fivefold.runtime import heartbeat, startup
from fivefold.runtime.heartbeat import Beat, Heartbeat

SHOWN = 8
"""Ranks listed one per line in a hang message; the rest are counted."""
STARTUP_S = 600.0
"""The start-up bound is max(timeout, STARTUP_S): a rank alive and running that has not written its
first heartbeat is still starting (importing torch and the user's stack, then meeting its peers in
init_process_group), not hung, for that long from the launch. Generous on purpose: on a loaded node
with a large software stack (Megatron's) imports alone take minutes, and stopping a run that would
have started costs more than waiting; a rank that is stopped, or dead, is not waited for."""
LONGEST_S = 7 * 86400.0
"""The longest timeout accepted (a week); longer ones are refused, not silently capped."""
STOPPED = ("T", "t")
"""/proc/PID/stat states of a stopped process (SIGSTOP; a debugger's trace stop): it runs no code,
not even a signal handler, so it can write no stack."""


def startup_bound(timeout_s: float) -> float:
    """Seconds from the launch a rank may take to write its first heartbeat (see STARTUP_S)."""
    return max(timeout_s, STARTUP_S)


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` (R running, S sleeping, D in I/O, T/t stopped, Z zombie), or
    None when it is gone or /proc cannot tell."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


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


@dataclass(frozen=True)
class Hang:
    message: str
    suspects: list[int]
    """The ranks named as holding the job up, first the likeliest."""


def _past_init(b: Beat) -> bool:
    """Whether a rank has left init_process_group (its first collective): then every rank had joined."""
    return b.ops > 1 or (b.ops == 1 and not b.in_flight)


def find_hang(beats: dict[int, Beat | None], now: float, timeout_s: float, started: float,
              ready: float = 0.0, **kw) -> str | None:
    """`diagnose`'s message, or None."""
    hang = diagnose(beats, now, timeout_s, started, ready, **kw)
    return hang.message if hang else None


def diagnose(beats: dict[int, Beat | None], now: float, timeout_s: float, started: float, ready: float = 0.0, *,
             startup_s: float | None = None, states: dict[int, str | None] | None = None) -> Hang | None:
    """The hang when a rank of `beats` (rank -> heartbeat, None when it has none yet; only the ranks still
    running) has made no progress for `timeout_s`, else None. `started`: when the ranks were started;
    `ready`: when the last of them wrote its first heartbeat (a wait counts from then: ranks that were
    early to init_process_group did not wait for a hung peer). `states`: rank -> `process_state` where the
    watcher can see the process (the launcher: all its ranks). A rank with no heartbeat is still
    starting, and its peers' waits are no hang, for `startup_s` (default `startup_bound`) while it is
    alive and not stopped (or its state is unknown and no rank has left init_process_group yet); a rank
    stopped before its first heartbeat is a hang after `timeout_s`. Times are time.time()."""
    startup_s = startup_bound(timeout_s) if startup_s is None else startup_s
    states = states or {}
    seen = {r: b for r, b in beats.items() if b is not None}
    missing = sorted(r for r, b in beats.items() if b is None)
    joined = any(_past_init(b) for b in seen.values())  # every rank had started: a missing one is elsewhere
    stopped_early = [r for r in missing if states.get(r) in STOPPED]
    starting = [r for r in missing if r not in stopped_early and not joined and (r not in states or states[r])]
    elsewhere = [r for r in missing if r not in stopped_early and r not in starting]
    late = now - started
    stuck = any(now - b.alive > timeout_s for b in seen.values()) or (stopped_early and late > timeout_s) or \
        (starting and late > startup_s) or \
        (not starting and any(b.in_flight and now - max(b.since, ready) > timeout_s for b in seen.values()))
    if not stuck:
        return None
    silent = sorted(r for r, b in seen.items() if now - b.alive > silent_after(timeout_s))
    waiting = [r for r, b in seen.items() if b.in_flight]
    busy = sorted(r for r, b in seen.items() if not b.in_flight and r not in silent)
    header = f"no progress for {timeout_s:g} s (the distributed timeout):"
    if silent:
        suspects = silent
        why = {r: (f"is not running: stopped (SIGSTOP, or a debugger holds it; heartbeat silent for "
                   f"{now - seen[r].alive:.0f} s)") if states.get(r) in STOPPED else
               (f"is not running (stopped, or stuck in native code holding the GIL; heartbeat silent for "
                f"{now - seen[r].alive:.0f} s)") for r in silent}
    elif stopped_early:
        suspects, why = stopped_early, {r: "is stopped (SIGSTOP, or a debugger holds it) before its first heartbeat"
                                        for r in stopped_early}
    elif starting and late > startup_s:
        header = (f"not started within {startup_s:g} s (the start-up bound: the larger of the distributed "
                  f"timeout and {STARTUP_S:g} s):")
        suspects = starting
        why = {r: "has no heartbeat: alive, still starting (importing, or not yet in init_process_group)"
               if r in states else "has no heartbeat (not started, or on another node)" for r in starting}
    elif elsewhere and waiting:
        suspects, why = elsewhere, {r: "has no heartbeat (its process ended, or it runs on another node)"
                                    for r in elsewhere}
    elif busy and waiting:
        suspects, why = busy, {r: "is outside any collective while its peers wait for it (busy, or stuck in Python)"
                               for r in busy}
    else:
        fewest = min(b.ops for b in seen.values())
        suspects = sorted(r for r, b in seen.items() if b.ops == fewest)
        why = {r: "waits in a collective its peers never entered (they are past it, or in another one)"
               for r in suspects}
    lines = [header]
    for r in suspects:
        b = seen.get(r)
        lines.append(f"rank {r} {why[r]}" + (f", {_where(b, now)}" if b is not None else ""))
    others = [r for r in sorted(beats) if r not in suspects]
    for r in others[:SHOWN]:
        b = seen.get(r)
        lines.append(f"  rank {r}: {_where(b, now) if b else 'no heartbeat yet (starting)' if r in starting else 'no heartbeat'}")
    if len(others) > SHOWN:
        lines.append(f"  ... and {len(others) - SHOWN} more ranks")
    return Hang("\n".join(lines), suspects)


def read_all(folder: str | Path, ranks) -> dict[int, Beat | None]:
    return {r: heartbeat.read(folder, r) for r in ranks}


def clear(folder: str | Path) -> None:
    """Remove the heartbeats, start stamps and stack files an earlier run left in `folder`."""
    for old in Path(folder).glob("heartbeat-*"):
        old.unlink(missing_ok=True)
    startup.clear(folder)


class Monitor:
    """The launcher's watcher over ranks 0..world-1 whose heartbeats live in `folder`."""

    def __init__(self, folder: str | Path, world: int, timeout_s: float, startup_s: float | None = None):
        self.folder, self.world, self.timeout_s = Path(folder), world, timeout_s
        self.startup_s = startup_bound(timeout_s) if startup_s is None else startup_s
        self.started = time.time()
        self.ready = 0.0
        """When every rank had written a heartbeat (0 until then)."""
        self._next = 0.0

    def check(self, running: dict[int, int]) -> Hang | None:
        """The hang over the `running` ranks (rank -> pid), or None (reads the files at most every half tick)."""
        now = time.time()
        if now < self._next:
            return None
        self._next = now + tick_for(self.timeout_s) / 2
        beats = read_all(self.folder, running)
        if not self.ready and all(b is not None for b in beats.values()):
            self.ready = now
        states = {r: process_state(pid) for r, pid in running.items()}
        return diagnose(beats, now, self.timeout_s, self.started, self.ready, startup_s=self.startup_s, states=states)


def self_watch(folder: str | Path, world: int, timeout_s: float,
               error_file: Path | None = None) -> Callable[[Heartbeat], None]:
    """A heartbeat `on_tick` for a rank with no launcher of ours watching (torchrun): when this rank has
    waited in one collective for `timeout_s`, it names the stuck rank from the heartbeats it can read
    (the ranks of this node), writes its own Python stack to stderr and exits 1; torchrun then stops
    the other ranks. A stopped rank cannot watch itself: the peers that wait for it name it."""
    started, ready = time.time(), 0.0

    def check(beat: Heartbeat) -> None:
        nonlocal ready
        now = time.time()
        if not ready and beat.ops <= 1 and beat.since:  # in init_process_group: when did the last peer come?
            if all(b is not None for b in read_all(folder, range(world)).values()):
                ready = now
        if not (beat.since and now - max(beat.since, ready) > timeout_s):
            return
        hang = diagnose(read_all(folder, range(world)), now, timeout_s, started, ready)
        if hang is None:
            return  # peers still starting (within the start-up bound): this wait is theirs
        message = hang.message
        sys.stderr.write(f"error (rank {beat.rank}): {message}\nits Python stack:\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if error_file is not None:
            error_file.write_text(json.dumps({"kind": "hang", "message": message}))
        os._exit(1)

    return check
