"""The one place every collective and p2p call is counted (per process).

Convention — call bytes, not wire bytes: the size of the full tensor a collective produces or
consumes. all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the unscattered
input; all-to-all: the input; broadcast: the tensor; send / recv: the tensor sent / received.
Each call carries a tag naming what issued it ("tp", "sp", "cp", "ep", "pp", "dp-grad", "loss", ...)
so model communication can be told from bookkeeping. Calls over a one-rank group are not counted.

`events` logs (kind, tag, phase, time) for asynchronous ops ("start" at launch, "end" when
`Work.wait()` returns) and for the communication inside differentiable ops' backward, so tests can
assert that a collective overlapped a computation. Training never resets the log, so it keeps only
the latest `MAX_EVENTS` (a deque): memory stays bounded over a long run.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from contextlib import contextmanager
from typing import NamedTuple

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


class Event(NamedTuple):
    kind: str
    tag: str
    phase: str  # "start" | "end"
    time: float  # time.perf_counter()


_calls: dict[tuple[str, str, str], int] = defaultdict(int)
_bytes: dict[tuple[str, str, str], int] = defaultdict(int)
MAX_EVENTS = 100_000
"""Events kept; older ones are dropped (several per layer and microbatch are logged every step)."""
events: deque[Event] = deque(maxlen=MAX_EVENTS)


def record(kind: str, tag: str, group: str, nbytes: int) -> None:
    """Count one call of `kind` issued by `tag` over the group named `group`."""
    assert kind in KINDS, kind
    _calls[kind, tag, group] += 1
    _bytes[kind, tag, group] += nbytes


def event(kind: str, tag: str, phase: str) -> None:
    events.append(Event(kind, tag, phase, time.perf_counter()))


@contextmanager
def span(kind: str, tag: str):
    """Log a "start" event now and an "end" event when the block exits."""
    event(kind, tag, "start")
    yield
    event(kind, tag, "end")


def reset() -> None:
    """Forget every count and event."""
    _calls.clear()
    _bytes.clear()
    events.clear()


def _group_name(group) -> str | None:
    return group if group is None or isinstance(group, str) else group.name


def _sum(table: dict, kind, tag, group) -> int:
    g = _group_name(group)
    return sum(v for (k, t, n), v in table.items()
               if (kind is None or k == kind) and (tag is None or t == tag) and (g is None or n == g))


def bytes(kind: str | None = None, tag: str | None = None, group=None) -> int:  # noqa: A001
    """Bytes of the calls matching every given filter (`group`: a Group or its name)."""
    return _sum(_bytes, kind, tag, group)


def calls(kind: str | None = None, tag: str | None = None, group=None) -> int:
    """Number of calls matching every given filter."""
    return _sum(_calls, kind, tag, group)


def table() -> list[tuple[str, str, str, int, int]]:
    """(kind, tag, group name, calls, bytes) per combination seen, sorted."""
    return sorted((k, t, g, _calls[k, t, g], _bytes[k, t, g]) for (k, t, g) in _calls)
