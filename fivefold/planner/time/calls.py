"""A rank's collectives timed on the links their groups cross (`links.py`), by the part of the step
time they are reported under (`PART`), and added to a rank's parts where they do not hide behind
compute; kept across layouts (`_CALLS`): the search meets the same pipeline ranks many times.
"""
from __future__ import annotations

from fivefold.planner.time.layer_collectives import Collective
from fivefold.planner.time.rank_collectives import stage_collectives, step_collectives
from fivefold.planner.layout import Plan
from fivefold.planner.time.links import Links


PART = {"tp": "tp", "etp": "tp", "tp-cp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "embedding": "pp", "dp": "dp",
        "dp-replicate": "dp", "edp": "dp"}
"""Which part of the step time (and of `comm_bytes`) a group's traffic is reported under."""


Timed = tuple[tuple[str, float, float, "str | None", int], ...]
"""Calls as (reported part, seconds on their link, wire bytes, what they hide behind, microbatches
they are spread over), in call order."""


def _timed(calls: list[Collective], links: Links, sizes: dict[str, int]) -> Timed:
    out = []
    for c in calls:
        n = sizes[c.group]
        out.append((PART[c.group], links.time(c.group, c.wire_bytes(n), c.steps(n), n, c.kind), c.wire_bytes(n),
                    c.hides_behind, c.spread))
    return tuple(out)


ByPart = tuple[tuple[str, tuple[float, ...], tuple[float, ...]], ...]
"""Calls on the critical path by reported part: (part, their seconds, their wire bytes), each in call order."""


def _add_timed(by_part: ByPart, parts: dict, sent: dict) -> None:
    """`_add_calls` for calls on the critical path, already timed: a part's sum takes its calls in call
    order, so it reaches the floats adding every call in call order does."""
    for part, times, wires in by_part:
        t, wire = parts[part], sent[part]
        for x in times:
            t += x
        for x in wires:
            wire += x
        parts[part], sent[part] = t, wire


_CALLS: dict[tuple, tuple] = {}
"""What the ranks' stage calls (per microbatch) or step calls (once) depend on but the rank -> (the
model, the hardware, {what they read of the rank: the calls timed}): the search meets the same
pipeline ranks under many layouts (EP, split, recompute)."""


def _kept(cache: dict, key: tuple, m, hw, compute):
    """`compute()`, kept in `cache` under `key`, which names the model and the hardware (None: not read)
    by id: both are kept alive beside the value and checked by identity, so a reused id never hits."""
    got = cache.get(key)
    if got is None or got[0] is not m or got[1] is not hw:
        got = cache[key] = (m, hw, compute())
    return got[2]


def _stage_calls(plan: Plan, r: int, links: Links, sizes: dict[str, int], kept: dict) -> ByPart:
    """`stage_collectives` of pipeline rank r, timed (none hides behind compute; `kept`: `_Keys.stage`)."""
    shape = plan.rank_shapes[r][1:]
    got = kept.get(shape)
    if got is None:
        got = kept[shape] = _on_the_path(_timed(stage_collectives(plan, r), links, sizes))
    return got


def _on_the_path(timed: Timed) -> ByPart:
    """`timed`, checked to hide behind nothing (stage calls are added whole: `_add_timed`), by part,
    its pipeline sends and receives (four per chunk boundary: tens under VPP) as one entry. A rank's
    layers report nothing under pp (`_rank_cost` adds them first), so their sum taken here, in call
    order from 0, is the float `_add_timed` would reach adding them one by one."""
    assert all(behind is None for *_, behind, _ in timed)
    by_part: dict[str, tuple[list, list]] = {}
    for part, seconds, sent, *_ in timed:
        times, wires = by_part.setdefault(part, ([], []))
        times.append(seconds)
        wires.append(sent)
    if "pp" in by_part:
        t = wire = 0.0
        for seconds, sent in zip(*by_part["pp"]):
            t += seconds
            wire += sent
        by_part["pp"] = ([t], [wire])
    return tuple((part, tuple(times), tuple(wires)) for part, (times, wires) in by_part.items())


def _step_calls(plan: Plan, r: int, links: Links, sizes: dict[str, int], kept: dict) -> tuple[tuple, dict]:
    """`step_collectives` of pipeline rank r, timed (`kept`: `_Keys.step`): (part, seconds, what they hide
    behind, microbatches they are spread over) per call, in call order, and the wire bytes by part
    (summed in call order: read only)."""
    held = _held(plan, r)
    got = kept.get(held)
    if got is None:
        calls, sent = [], {}
        for part, t, wire, behind, spread in _timed(step_collectives(plan, r), links, sizes):
            calls.append((part, t, behind, spread))
            sent[part] = sent.get(part, 0.0) + wire
        got = kept[held] = tuple(calls), sent
    return got


def _held(plan: Plan, r: int) -> tuple:
    """What pipeline rank r's step calls read of the rank: its dense and MoE layers' counts (recomputed
    or not, in whatever chunks) and whether it holds the embedding or the head (its parameters follow)."""
    def count():
        kinds, first, last, _ = plan.rank_shapes[r]
        return (sum(n for moe, _, n in kinds if not moe), sum(n for moe, _, n in kinds if moe), first, last)
    return plan.cached(("held", r), count)


def _add_calls(calls: list[Collective], links: Links, sizes: dict[str, int], parts: dict, sent: dict,
               hidden: float = 0.0, ep_share: float = 0.0, tp_share: float = 0.0) -> None:
    """Add the time and wire bytes of `calls` (critical path, or hidden behind `hidden` seconds of
    compute for those that overlap the attention core) to `parts` / `sent`, by reported part;
    `tp_share` of the TP traffic (`_tp_share`) and `ep_share` of the EP traffic are hidden."""
    overlapped = 0.0
    hidden_share = {"tp": tp_share, "ep": ep_share}
    timed: dict[tuple, tuple[float, float]] = {}  # calls of one kind, group and size cost the same
    for c in calls:
        key = (c.kind, c.group, c.call_bytes)
        got = timed.get(key)
        if got is None:
            n = sizes[c.group]
            wire = c.wire_bytes(n)
            got = timed[key] = (links.time(c.group, wire, c.steps(n), n, c.kind), wire)
        t, wire = got
        sent[PART[c.group]] += wire
        if c.hides_behind == "attention":
            overlapped += t
        else:
            parts[PART[c.group]] += t * (1 - hidden_share.get(PART[c.group], 0.0))
    if overlapped:
        parts["cp"] += max(0.0, overlapped - hidden * links.ta.cp_overlap)
