"""Several components (models or engines) on one world: AReaL allocation modes and `models:` lists.

AReaL allocation modes (seed 003) name each component's sizes with letters d (DP), t (TP), p (PP),
c (CP), e (EP); a component needs d*t*p*c GPUs (EP folds into them, ETP defaults to 1 as in AReaL).
- Legacy form `sglang.d2t2p1+d1t4p1`: an inference engine on the first d*t*p GPUs, then training.
- Colon form `sglang:d4t2+megatron:d2p2t4`: `+` puts components on consecutive, disjoint GPUs;
  `|` puts components on the same GPUs (colocated; equal sizes); a MoE training component may split
  attention and experts, `megatron:(attn:d1p2t4|ffn:d1p2e4)`: PP must match, expert DP is derived
  as (t*c*d of attn) / (t*e of ffn).
Within its GPUs, a component numbers ranks as Megatron does (order tp-cp-ep-dp-pp), so one GPU has
different coordinates per component ("GPU 2 is TP rank 1 for the actor, TP rank 0 for the reference").

A `models:` entry is trained or forward-only (`role: train | forward`): RL's frozen reference (AReaL's
ModelName("ref")) and a reward model only compute log-probs or scores, through `Engine.forward`. Without
`role:` the name decides: a name with the word ref, reference, reward or rm in it (case-insensitive, words
split at anything but letters: `ref`, `Reference`, `ref_model`, `reward-model`, `RM`, `ref0`) is
forward-only, any other name trained.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from fivefold.config.fields import ALIASES, SECTION_OF, set_value
from fivefold.config.schema import Config
from fivefold.errors import UserError
from fivefold.topology import Layout

MAX_GPUS = 1 << 17
"""Allocations list every GPU of every component; more GPUs than this are refused, not listed."""
INFERENCE = ("sglang", "vllm")
TRAINING = ("megatron", "fsdp", "archon", "train")
_DIMS = re.compile(r"([dtpce])(\d+)")
ROLES = {"train": "training", "forward": "forward-only"}
"""A `models:` entry's `role:` value -> its Component.role."""
FORWARD_NAMES = ("ref", "reference", "reward", "rm")
"""Words of a model's name that make it forward-only when it gives no `role:` (`role_of`)."""


@dataclass(frozen=True)
class Component:
    name: str
    """Backend (sglang, megatron, ...) for an allocation mode, the model name for a `models:` list."""
    role: str
    """inference (an allocation mode's generation engine), training (a trainer, or a `models:` entry
    that is trained) or forward-only (a `models:` entry that only runs forward: `role_of`)."""
    layout: Layout
    ranks: tuple[int, ...]
    """Global rank of each local rank of this component."""
    config: Config | None = None
    """The canonical config of a training component or listed model (world = its GPU count)."""

    def coords(self, global_rank: int) -> dict[str, int] | None:
        """This component's dense (and expert, when MoE) coordinates of a global rank; None if not its."""
        if global_rank not in self.ranks:
            return None
        local = self.ranks.index(global_rank)
        out = dict(self.layout.dense.coords(local))
        if self.layout.ep > 1:
            out.update({k: v for k, v in self.layout.expert.coords(local).items() if k in ("etp", "ep", "edp")})
        return out


@dataclass(frozen=True)
class Allocation:
    components: tuple[Component, ...]
    world_size: int

    def training(self) -> Component | None:
        return next((c for c in self.components if c.role == "training"), None)

    def by_rank(self, global_rank: int) -> list[tuple[str, dict[str, int]]]:
        return [(c.name, c.coords(global_rank)) for c in self.components if global_rank in c.ranks]


def _split_top(text: str, sep: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _dims(text: str, where: str) -> dict[str, int]:
    text = text.strip()
    if not text or _DIMS.sub("", text):
        raise UserError(f"allocation {where}: {text!r} is not a list of sizes like d2t4p1 (letters d t p c e)")
    found = _DIMS.findall(text)
    letters = [k for k, _ in found]
    if len(set(letters)) != len(letters):
        raise UserError(f"allocation {where}: {text!r} gives a size twice")
    if any(len(v) > 7 for _, v in found):
        raise UserError(f"allocation {where}: a size in {text[:40]!r} is beyond {MAX_GPUS} GPUs")
    sizes = {k: int(v) for k, v in found}
    if min(sizes.values()) < 1:
        raise UserError(f"allocation {where}: sizes must be >= 1 in {text!r}")
    return sizes


def _layout(backend: str, spec: str) -> Layout:
    spec = spec.strip()
    if spec.startswith("("):
        if not spec.endswith(")"):
            raise UserError(f"allocation {backend}: unbalanced parentheses in {spec!r}")
        parts = dict(p.split(":", 1) for p in _split_top(spec[1:-1], "|") if ":" in p)
        if set(parts) != {"attn", "ffn"}:
            raise UserError(f"allocation {backend}: a MoE split is (attn:...|ffn:...), got {spec!r}")
        a, f = _dims(parts["attn"], backend + " attn"), _dims(parts["ffn"], backend + " ffn")
        if "c" in f:
            raise UserError(f"allocation {backend}: the ffn part has no context parallelism (c)")
        if f.get("p", 1) != a.get("p", 1):
            raise UserError(f"allocation {backend}: attn and ffn must use the same PP "
                            f"(p{a.get('p', 1)} vs p{f.get('p', 1)})")
        dense = a.get("t", 1) * a.get("c", 1) * a.get("d", 1)
        etp, ep = f.get("t", 1), f.get("e", 1)
        if dense % (etp * ep):
            raise UserError(f"allocation {backend}: ffn t*e = {etp * ep} must divide attn t*c*d = {dense}")
        if "d" in f and f["d"] != dense // (etp * ep):
            raise UserError(f"allocation {backend}: ffn d{f['d']} should be the derived expert DP "
                            f"{dense // (etp * ep)} = (t*c*d of attn) / (t*e of ffn)")
        return Layout(tp=a.get("t", 1), cp=a.get("c", 1), pp=a.get("p", 1), dp=a.get("d", 1), ep=ep, etp=etp)
    s = _dims(spec, backend)
    if backend in INFERENCE and (s.get("p", 1) > 1 or s.get("e", 1) > 1):
        raise UserError(f"allocation {backend}: an inference engine takes d, t and c sizes only")
    lay = Layout(tp=s.get("t", 1), cp=s.get("c", 1), pp=s.get("p", 1), dp=s.get("d", 1), ep=s.get("e", 1), etp=1)
    if (lay.tp * lay.cp * lay.dp) % lay.ep:
        raise UserError(f"allocation {backend}: e{lay.ep} must divide t*c*d = {lay.tp * lay.cp * lay.dp}")
    return lay


def _component(text: str, legacy_first: bool, legacy: bool) -> tuple[str, Layout]:
    text = text.strip()
    if legacy:
        backend, dot, spec = text.partition(".")
        if not dot:
            backend, spec = "train", text
        elif backend not in INFERENCE + TRAINING:
            raise UserError(f"allocation: unknown backend {backend!r} (one of {', '.join(INFERENCE + TRAINING)})")
        return backend, _layout(backend, spec)
    backend, colon, spec = text.partition(":")
    if not colon:
        backend, spec = "train", text
    backend = backend.strip()
    if backend not in INFERENCE + TRAINING:
        raise UserError(f"allocation: unknown backend {backend!r} (one of {', '.join(INFERENCE + TRAINING)})")
    return backend, _layout(backend, spec)


def parse_allocation(mode: str) -> Allocation:
    """An AReaL allocation mode -> components with their layouts and exact global ranks."""
    mode = mode.strip().replace(" ", "")
    legacy = ":" not in mode
    components, start = [], 0
    for i, group in enumerate(_split_top(mode, "+")):
        members = [_component(m, i == 0, legacy) for m in _split_top(group, "|")]
        sizes = {lay.world_size for _, lay in members}
        if len(sizes) != 1:
            raise UserError(f"allocation: components sharing GPUs with | must have equal sizes, got "
                            f"{' | '.join(f'{b}:{lay.world_size} GPUs' for b, lay in members)}")
        n = sizes.pop()
        if start + n > MAX_GPUS:
            raise UserError(f"allocation: its components reach {start + n} GPUs; fivefold lays out at most {MAX_GPUS}")
        for backend, lay in members:
            role = "inference" if backend in INFERENCE else "training"
            components.append(Component(backend, role, lay, tuple(range(start, start + n))))
        start += n
    return Allocation(tuple(components), start)


def parse_gpus(spec, where: str) -> tuple[int, ...]:
    """'0-3', '0,2,4', 5 or [0, 1] -> the ranks."""
    parts = spec if isinstance(spec, list) else str(spec).split(",")
    ranks: list[int] = []
    for part in parts:
        lo, dash, hi = (str(part).strip().partition("-") if not isinstance(part, int) or isinstance(part, bool)
                        else (str(part), "", ""))
        try:
            lo_i, hi_i = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise UserError(f"{where}: gpus {spec!r} is not like 0-3, 0,2 or a list of GPU numbers") from None
        if lo_i < 0 or hi_i < lo_i or len(ranks) + hi_i - lo_i >= MAX_GPUS:
            raise UserError(f"{where}: gpus {spec!r}: GPU numbers are 0 to {MAX_GPUS - 1}, ranges low-high")
        ranks += range(lo_i, hi_i + 1)
    if not ranks:
        raise UserError(f"{where}: gpus is empty (give e.g. 0-3)")
    if len(set(ranks)) != len(ranks):
        raise UserError(f"{where}: gpus {spec!r} lists a GPU twice")
    return tuple(ranks)


def _with_sizes(base: Config, lay: Layout, world: int) -> Config:
    cfg = copy.deepcopy(base)
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = lay.tp, lay.pp
    p.context_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size = lay.cp, lay.ep, lay.etp
    cfg.cluster.world_size = world
    return cfg


def models_allocation(base: Config, models: list, world_size: int | None) -> Allocation:
    """A YAML `models:` list -> one component per model, each with its own canonical config."""
    if not isinstance(models, list) or not models:
        raise UserError("models: must be a list of {name, gpus, parallel/model overrides}")
    comps = []
    for i, entry in enumerate(models):
        if not isinstance(entry, dict) or "gpus" not in entry:
            raise UserError(f"models[{i}]: needs at least gpus (e.g. gpus: 0-1)")
        name = str(entry.get("name", f"model{i}"))
        if any(c.name == name for c in comps):
            raise UserError(f"models[{i}]: a second model named {name!r}: give each model its own name")
        ranks = parse_gpus(entry["gpus"], f"models[{i}] ({name})")
        role = role_of(name, entry.get("role"), f"models[{i}] ({name})")
        cfg = copy.deepcopy(base)
        explicit: set[str] = set()
        for key, value in entry.items():
            if key in ("name", "gpus", "role"):
                continue
            items = value.items() if isinstance(value, dict) else [(None, value)]
            for sub, v in items:
                dotted = _model_key(key, sub, f"models[{i}] ({name})")
                set_value(cfg, dotted, v, explicit)
        cfg.cluster.world_size = len(ranks)
        from fivefold.config.validate import layout_of
        p = cfg.parallel
        sizes_ok = min(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                       p.expert_model_parallel_size, p.expert_tensor_parallel_size or 1) >= 1
        # An invalid layout stands as one rank until validate() reports it with its fix.
        lay = layout_of(cfg) if sizes_ok and len(ranks) % _mp(cfg) == 0 else Layout()
        comps.append(Component(name, role, lay, ranks, cfg))
    world = world_size if world_size is not None else max(max(c.ranks) for c in comps) + 1
    for c in comps:
        if max(c.ranks) >= world:
            raise UserError(f"model {c.name}: gpus up to {max(c.ranks)} go beyond the world of {world} GPUs")
    return Allocation(tuple(comps), world)


def role_of(name: str, given, where: str) -> str:
    """The Component.role of a `models:` entry: its `role:` (train or forward), else from its name's words
    (`FORWARD_NAMES`: forward-only; any other name trained)."""
    if given is None:
        words = re.split(r"[^a-z]+", name.lower())
        return ROLES["forward"] if any(w in FORWARD_NAMES for w in words) else ROLES["train"]
    if not isinstance(given, str) or given not in ROLES:
        raise UserError(f"{where}: role {given!r} is not one of {', '.join(ROLES)} (train: trained, as an actor or "
                        "critic; forward: forward-only, as a frozen reference or a reward model)")
    return ROLES[given]


def _mp(cfg: Config) -> int:
    p = cfg.parallel
    return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size


def _model_key(key: str, sub: str | None, where: str) -> str:
    if sub is None:
        if key in ALIASES:
            return ALIASES[key]
        if key in SECTION_OF:
            return f"{SECTION_OF[key]}.{key}"
        raise UserError(f"{where}: unknown key {key!r}")
    if sub in ALIASES:
        return ALIASES[sub]
    if sub in SECTION_OF:
        return f"{SECTION_OF[sub]}.{sub}"
    raise UserError(f"{where}: unknown key {key}.{sub}")


def attach(loaded, special: dict) -> None:
    """Resolve `allocation_mode` / `models:` of a loaded config (see fivefold.config.load)."""
    from fivefold.config.validate import Problem

    cfg = loaded.config
    given = cfg.cluster.world_size if "cluster.world_size" in loaded.explicit else (
        cfg.cluster.resolved_world_size if {"cluster.num_nodes", "cluster.gpus_per_node"} & loaded.explicit
        else None)
    if "allocation_mode" in special and "models" in special:
        raise UserError("give either allocation_mode or models:, not both")
    if "models" in special:
        loaded.allocation = models_allocation(cfg, special["models"], given)
        loaded.config = loaded.allocation.components[0].config
        return
    alloc = parse_allocation(str(special["allocation_mode"]))
    if given is not None and given != alloc.world_size:
        raise UserError(f"allocation mode {special['allocation_mode']} uses {alloc.world_size} GPUs; "
                        f"the cluster has {given}")
    comps = []
    for c in alloc.components:
        if c.role == "training":
            for dotted in ("parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                           "parallel.context_parallel_size", "parallel.expert_model_parallel_size"):
                if dotted in loaded.explicit:
                    loaded.warnings.append(Problem(dotted, None, "the allocation mode sets the training "
                                                   "layout; this value is replaced", "drop it", "warning"))
            c = Component(c.name, c.role, c.layout, c.ranks, _with_sizes(cfg, c.layout, len(c.ranks)))
        comps.append(c)
    loaded.allocation = Allocation(tuple(comps), alloc.world_size)
    train = loaded.allocation.training()
    if train is not None:
        loaded.config = train.config
