"""A fix for a broken config: the valid sizes that change the fewest knobs.

Search by number of changed knobs (1, then 2 among the knobs the broken rules name), each candidate
run through the dialect's adjustments and every rule. Among fixes with as few changes, prefer those
that change only the knobs the broken rule names first, then the smallest change (|log2 new/old|
summed). Only when no one- or two-knob change works does a greedy walk (fix the first broken rule,
repeat) propose more.

A fix is printed only through `first_that_holds`: its text (`describe`) is read back into a copy of
the config as a user would type it, and the whole config validated again; a fix that does not hold
is never shown (the next one is tried, or "none found").
"""
from __future__ import annotations

import dataclasses
import math
from itertools import combinations, product

from fivefold.config.fields import resolve, set_value
from fivefold.config.rules import KNOB_FIELDS, Rule, adjust, dp_of, errors, etp_of, ffn_of, sizes_of
from fivefold.config.schema import (ACTIVATIONS, DROP_POLICIES, NORMALIZATIONS, POSITION_EMBEDDINGS, QK_NORM_SCOPES,
                                    ROUTER_DTYPES, ROUTER_SCORE_FUNCTIONS, SECTIONS, Config)
from fivefold.pipeline.schedules import REGISTRY

WORLD_KNOBS = ("tp", "pp", "cp", "ep", "etp")
_DEFAULTS = sizes_of(Config())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n <= 4096 else [1, 2, 4, 8, 16]


def _near_multiples(x: int, bases: list[int], keep: int = 24) -> list[int]:
    vals = set()
    for b in bases:
        if b >= 1:
            vals.add((x // b) * b)
            vals.add(-(-x // b) * b)
    vals.discard(0)
    vals.discard(x)
    return sorted(vals, key=lambda v: (abs(math.log2(v) - math.log2(x)), v))[:keep]


def candidates(knob: str, s: dict) -> list:
    """Values worth trying for `knob` given the current sizes `s`."""
    world, layers = s["world"], s["layers"]
    v = s.get(knob)
    if isinstance(v, int) and not isinstance(v, bool) and v < 1:  # nonsense: the default, or small sizes
        return list(dict.fromkeys([_DEFAULTS[knob] or 1, 1]))
    if knob in WORLD_KNOBS:
        return _divisors(world)
    if knob == "vpp":
        return [None] + [v for v in _divisors(layers) if 2 <= v <= 16]
    if knob == "group":  # unset (PP), or a group the last of which is whole: a divisor of the microbatches
        model = s["tp"] * s["pp"] * s["cp"]
        dp = dp_of(s) if model >= 1 and world % model == 0 else 0
        m = s["gbs"] // (s["mbs"] * dp) if dp and s["gbs"] and s["mbs"] >= 1 else 0
        return [None] + [d for d in _divisors(m) if d >= s["pp"]][:8]
    if knob in ("sp", "a2a_overlap", "tp_overlap"):
        return [True, False]
    if knob == "seq":
        return _near_multiples(s["seq"], [2 ** k for k in range(1, 14)])
    if knob == "gbs":
        bases = sorted({d * k for d in _divisors(world) for k in {1, s["mbs"]}})
        if s["gbs"] is None:  # Megatron's default (micro batch x DP) is one of the candidates
            return sorted({s["mbs"] * b for b in bases})[:64]
        return _near_multiples(s["gbs"], bases, keep=64)
    if knob == "mbs":
        return [d for d in _divisors(s["gbs"]) if d <= 64]
    if knob == "world":  # the multiples of the model-parallel size nearest to it, smaller first
        model = s["tp"] * s["pp"] * s["cp"]
        if model < 1:
            return []
        k = world // model  # (arithmetic: a world of 10^12 has too many multiples to list)
        return sorted((model * j for j in range(max(1, k - 2), k + 3)), key=lambda n: (abs(n - world), n))[:4]
    if knob == "rnum":
        return [1] + _divisors(max(layers // s["pp"], 1))[1:4]
    if knob == "hcp":
        return [(a, s["cp"] // a) for a in _divisors(s["cp"])]
    if knob == "cp_comm":
        return ["p2p", "a2a", "a2a+p2p", "allgather"]
    if knob == "dispatcher":
        return ["alltoall", "flex", "allgather"]
    if knob == "norm":
        return list(NORMALIZATIONS)
    if knob == "kv":
        return [None] + _divisors(s["heads"])
    if knob == "topk":
        return list(range(1, min(s["experts"] or 1, 16) + 1))
    if knob in ("first", "last"):
        return [None] + list(range(1, min(layers, 64) + 1))
    if knob == "hidden":
        return _near_multiples(s["hidden"], [s["heads"], 64 * s["heads"]], keep=8)
    if knob == "heads":
        return [d for d in _divisors(s["hidden"]) if d <= 1024][:64]
    if knob == "ffn":
        return _near_multiples(ffn_of(s), [s["tp"], 64 * s["tp"]], keep=8)
    if knob == "moe_ffn":
        return _near_multiples(s["moe_ffn"] or ffn_of(s), [etp_of(s), 64 * etp_of(s)], keep=8)
    if knob == "shared":
        return _near_multiples(s["shared"], [s["tp"], 64 * s["tp"]], keep=8)
    if knob == "split":
        return [None]
    if knob == "schedule":
        return sorted(REGISTRY, key=lambda name: name != "1f1b")  # the default first
    if knob == "order":
        return ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"]
    if knob == "rgran":
        return [None, "selective", "full"]
    if knob == "rmethod":
        return [None, "uniform", "block"]
    if knob == "vpp_layers":
        return [None] + _divisors(layers)[:8]
    if knob == "maxpos":
        return [s["seq"]]
    if knob == "capacity":
        return [None, 1.0, 1.25, 1.5, 2.0]
    if knob == "pad":
        return [False, True]
    if knob == "drop":
        return list(DROP_POLICIES)
    if knob == "qk_scope":
        return list(QK_NORM_SCOPES)
    if knob in ("act", "pos"):
        return list(ACTIVATIONS if knob == "act" else POSITION_EMBEDDINGS)
    if knob in ("score", "rdtype"):
        return list(ROUTER_SCORE_FUNCTIONS if knob == "score" else ROUTER_DTYPES)
    if knob == "groups":
        return [None] + _divisors(s["experts"] or 1)
    if knob == "gtopk":
        return [None] + list(range(1, min(s["groups"] or 1, 64) + 1))
    if knob in ("ebias", "brate", "rscale"):
        return {"ebias": [False, True], "brate": [1e-3], "rscale": [None]}[knob]
    return []


def _distance(old, new) -> float:
    """|log2(new/old)| for sizes (summed over a list's entries); 1 for a switch or a value set from unset."""
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return sum(_distance(a, b) for a, b in zip(old, new))
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool) \
            and not isinstance(new, bool) and old > 0 and new > 0:
        return abs(math.log2(new) - math.log2(old))
    return 1.0


def _valid(s: dict, dialect: str) -> bool:
    t = dict(s)
    adjust(t, dialect)
    return not errors(t)


def _roundness(v) -> int:
    """Trailing zero bits of an int (4096 is rounder than 4104), 0 otherwise."""
    return (v & -v).bit_length() if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _scored(base: dict, changes: dict, preferred: tuple[str, ...]) -> tuple:
    pref = 0 if all(k in preferred[:1] for k in changes) else (1 if all(k in preferred for k in changes) else 2)
    dist = sum(_distance(base[k], v) for k, v in changes.items())
    return (len(changes), pref, round(dist, 3), -sum(_roundness(v) for v in changes.values()))


def search(base: dict, broken: list[Rule], dialect: str) -> dict[int, list[dict]]:
    """For each broken rule (by index), the sets of knob changes that make `base` valid, best first."""
    knobs = []
    for r in broken:
        knobs += [k for k in r.knobs if k not in knobs]
    pool: list[dict] = []
    for k in knobs:
        for v in candidates(k, base):
            if v != base[k] and _valid({**base, k: v}, dialect):
                pool.append({k: v})
    if not pool:
        for a, b in combinations(knobs, 2):
            for va, vb in product(candidates(a, base), candidates(b, base)):
                if va != base[a] and vb != base[b] and _valid({**base, a: va, b: vb}, dialect):
                    pool.append({a: va, b: vb})
    if not pool:
        greedy = _greedy(base, dialect)
        pool = [greedy] if greedy else []
    return {i: sorted(pool, key=lambda c: _scored(base, c, r.knobs)) for i, r in enumerate(broken) if pool}


def first_that_holds(config: Config, ranked: list[dict], dialect: str, tries: int = 8) -> str:
    """The text of the first fix in `ranked` that, typed back in as printed, gives a valid config."""
    for changes in ranked[:tries]:
        text = describe(changes)
        if holds(config, text, dialect):
            return text
    return "none found"


def holds(config: Config, text: str, dialect: str) -> bool:
    """Does `config` with the printed fix `text` ('name=value, name=value') applied validate?"""
    # A copy per section is enough: set_value replaces fields, it never mutates a list in place.
    fixed = Config(**{name: dataclasses.replace(getattr(config, name)) for name in SECTIONS})
    for part in text.split(", "):
        name, _, value = part.partition("=")
        set_value(fixed, resolve(name), value, set())
    s = sizes_of(fixed)
    adjust(s, dialect)
    return not errors(s)


def _greedy(base: dict, dialect: str, steps: int = 8) -> dict | None:
    s, changes = dict(base), {}
    for _ in range(steps):
        t = dict(s)
        adjust(t, dialect)
        broken = errors(t)
        if not broken:
            return changes
        best = None
        for k in broken[0].knobs:
            for v in candidates(k, s):
                t = {**s, k: v}
                adjust(t, dialect)
                n = len(errors(t))
                if v != s[k] and (best is None or n < best[0]):
                    best = (n, k, v)
        if best is None:
            return None
        s[best[1]] = best[2]
        changes[best[1]] = best[2]
    return None


def describe(changes: dict) -> str:
    """'tensor_model_parallel_size=2, global_batch_size=16' for a set of knob changes."""
    parts = []
    for k, v in changes.items():
        name = KNOB_FIELDS[k].split(".", 1)[1]
        text = "[" + ",".join(map(str, v)) + "]" if isinstance(v, (tuple, list)) else str(v)
        parts.append(f"{name}={text}")
    return ", ".join(parts)
