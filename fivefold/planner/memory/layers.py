"""A rank's decoder layers' per-microbatch activation terms (`activations.py`), summed by layer
kind and cached: the search sizes the same rank shapes under many layouts.
"""
from __future__ import annotations

from functools import lru_cache

from fivefold.config.modules import OFFLOAD_MODULES
from fivefold.planner.memory.traits import ArchTraits
from fivefold.planner.memory.activations import (Sharding, backward_transient, full_recompute_transient,
                                                 gathered_kv_bytes, layer_activation_bytes, weight_grad_join_bytes)
from fivefold.planner.layout import Plan
from fivefold.planner.memory.params import is_moe_layer


@lru_cache(maxsize=64)
def _for_precision(traits: ArchTraits, precision: str, recipe: str) -> ArchTraits:
    return traits.for_precision(precision, recipe)


_LAYERS: dict[tuple, tuple] = {}
"""Per-microbatch layer state of a rank shape, by what it depends on (the model by identity, kept
alive beside its id): the search sizes the same shapes under many layouts."""


def _layers(plan: Plan, kinds: tuple, r: int, sh: Sharding, traits: ArchTraits, gathers: bool, deferred: bool):
    """(activation bytes by tensor, per-microbatch total, recompute transient, W-pending join bytes,
    backward transient, offloaded bytes, one layer of the last group's bytes) of rank r's layers, whose
    kinds are `kinds` ((MoE?, recomputed?, count), ...); `gathers`: all-gather CP (its gathered K/V a
    backward temporary); `deferred`: the schedule defers W (else no join waits: 0)."""
    m, b, s = plan.config.model, plan.mbs, plan.seq
    key = (id(m), kinds, b, s, sh, traits, plan.offload_modules, gathers, deferred)
    got = _LAYERS.get(key)
    if got is not None and got[0] is m:
        return got[1]
    detail: dict[str, float] = {}
    per_mb, transient, joins, bwd, offloaded, last = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    offload = [OFFLOAD_MODULES[name] for name in plan.offload_modules]
    for i, recomputed, n in plan.layer_groups(r):
        saved, total, peak, join, held = _layer_kind(plan, i, recomputed, sh, traits, gathers, deferred)
        for k, v in saved.items():
            detail[k] = detail.get(k, 0.0) + v * n
            per_mb += v * n
        last = total
        offloaded += sum(saved.get(key, 0.0) for key in offload) * n
        transient = max(transient, peak)
        joins += join * n
        bwd = max(bwd, held)
    out = (detail, per_mb, transient, joins, bwd, offloaded, last)
    _LAYERS[key] = (m, out)
    return out


_KINDS: dict[tuple, tuple] = {}
"""One layer's terms of `_layers` by what they depend on (its kind, not its index: layers of a kind
hold the same, as `_LAYERS`' keys assume; the model kept alive beside its id): the same kinds recur
on many ranks and splits."""


def _layer_kind(plan: Plan, i: int, recomputed: bool, sh: Sharding, traits: ArchTraits, gathers: bool,
                deferred: bool) -> tuple:
    """(activation bytes by tensor, their total, recompute transient, W-pending join bytes, backward
    transient) of layer `i` (`_layers`' arguments)."""
    m, b, s = plan.config.model, plan.mbs, plan.seq
    left = not recomputed and plan.recompute == "full"  # a layer full recompute leaves alone (MTP's)
    key = (id(m), is_moe_layer(m, i), recomputed, left, b, s, sh, traits, gathers, deferred)
    got = _KINDS.get(key)
    if got is not None and got[0] is m:
        return got[1]
    layer_sh = Sharding.of(tp=sh.tp, sp=sh.sp, cp=sh.cp, etp=sh.etp, recompute=None) if left else sh
    saved = layer_activation_bytes(m, i, b, s, layer_sh, traits)
    reruns = recomputed or (sh.recompute == "selective" and traits.op_level_sac)  # the layer's backward rebuilds it
    peak = full_recompute_transient(m, i, b, s, sh, traits) if reruns else 0.0
    join = weight_grad_join_bytes(m, i, b, s, sh, traits) if deferred else 0.0
    held = max(backward_transient(m, i, b, s, sh, traits), gathered_kv_bytes(m, b, s, sh, traits) if gathers else 0.0)
    out = (saved, sum(saved.values()), peak, join, held)
    _KINDS[key] = (m, out)
    return out
