"""The schedule registry: everything the rest of fivefold knows about a pipeline schedule, one entry each.

An entry holds the schedule's name, its generator (the per-rank compute order, generators.py), where
its stages sit (placement), how many model chunks a rank holds, its own rule on (pp, vpp,
microbatches), and the chunk counts the planner tries. Config validation, the fix suggestions, the
executor's stages, the planner's layouts and search space and the CLIs all read this registry, so a
new schedule is one entry here plus its generator; nothing else names schedules.

`microbatch_problem` is the one rule shared by config validation and `build_schedule`, so that the
validator accepts exactly what the generators build.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fivefold.errors import UserError
from fivefold.pipeline import generators
from fivefold.pipeline.ir import Action, Schedule, standard_placement, v_placement
from fivefold.pipeline.lowering import lower


@dataclass(frozen=True)
class ScheduleKind:
    name: str
    generate: Callable[[int, int, int, int | None], list[list[Action]]]
    """(pp, chunks per rank, microbatches, microbatch group or None) -> each rank's compute actions in order."""
    chunks: Callable[[int | None], int]
    """The configured virtual_pipeline_model_parallel_size (None when unset) -> model chunks per rank."""
    rule: Callable[[int, int | None, int, int | None], str | None]
    """(pp, vpp, microbatches, microbatch group or None) -> None when this schedule can run them, else
    the rule broken."""
    planner_vpps: Callable[[int, int, int], Iterable[int]]
    """(pp > 1, num_layers, the search's max vpp) -> the vpp values the planner tries (1 = unset)."""
    v_shape: bool = False
    """Stages in a V (rank r holds stages r and 2pp-1-r) rather than round-robin."""
    equal_stages: Callable[[int, int, int, int | None], "EqualStages | None"] | None = None
    """(pp, chunks per rank, microbatches, group) -> (makespan, peak in-flight chunks per rank, the loss
    stage's microbatches held (at the forward peak, beside a backward)) of the simulator with equal
    stages (F = B = W = 1/3 of a rank's microbatch time), in closed form, for a schedule whose
    backward is never split (nothing B-done-W-pending); None (the field, or its answer for some
    counts) = simulate. Proven equal to the simulator over a grid (tests/test_pipeline_registry.py);
    the planner reads it instead of simulating (a 64-rank 1F1B simulation costs ~0.4 s of CPU)."""

    def placement(self, pp: int, chunks: int) -> tuple[int, ...]:
        """Pipeline rank of each virtual stage."""
        return v_placement(pp) if self.v_shape else standard_placement(pp, chunks)


EqualStages = tuple[float, tuple[int, ...], tuple[int, int]]


def _configured(vpp: int | None) -> int:
    return vpp or 1


def _no_vpp(name: str) -> Callable[[int, int | None, int, int | None], str | None]:
    def rule(pp: int, vpp: int | None, m: int, group: int | None) -> str | None:
        if vpp not in (None, 1):
            return f"virtual_pipeline_model_parallel_size={vpp} applies only to the interleaved schedule, not {name}"
        return None
    return rule


def _interleaved_rule(pp: int, vpp: int | None, m: int, group: int | None) -> str | None:
    """Megatron-LM's (forward_backward_pipelining_with_interleaving): the group N in [PP, M], and the last
    group (M mod N) empty or at least PP; N defaults to PP, so then M must be a multiple of PP."""
    if pp < 2:
        return "interleaving (virtual pipeline stages) needs pipeline_model_parallel_size > 1"
    if not vpp or vpp < 2:
        return "interleaving needs virtual_pipeline_model_parallel_size >= 2"
    if group is None:
        if m % pp:
            return (f"interleaving needs the number of microbatches ({m}) to be a multiple of "
                    f"pipeline_model_parallel_size={pp} (or microbatch_group_size_per_vp_stage set so that "
                    "the last group of microbatches is empty or at least PP)")
        return None
    if not pp <= group <= m:
        return (f"microbatch_group_size_per_vp_stage={group} must lie in [pipeline_model_parallel_size={pp}, "
                f"the number of microbatches={m}]")
    if 0 < m % group < pp:
        return (f"the last group of microbatches ({m} mod microbatch_group_size_per_vp_stage={group} = "
                f"{m % group}) must be empty or at least pipeline_model_parallel_size={pp}: a smaller one "
                "waits on itself (Megatron-LM refuses it)")
    return None


def _dualpipev_rule(pp: int, vpp: int | None, m: int, group: int | None) -> str | None:
    if vpp not in (None, 2):
        return ("dualpipev always holds 2 stages per rank (V shape); leave "
                f"virtual_pipeline_model_parallel_size unset or 2, got {vpp}")
    if m < 2 * pp:
        return f"dualpipev needs at least 2*pipeline_model_parallel_size = {2 * pp} microbatches, got {m}"
    return None


def _one(pp: int, num_layers: int, max_vpp: int) -> Iterable[int]:
    return (1,)


def _interleaved_vpps(pp: int, num_layers: int, max_vpp: int) -> Iterable[int]:
    return (v for v in range(2, max_vpp + 1) if num_layers >= pp * v)


def _v_vpps(pp: int, num_layers: int, max_vpp: int) -> Iterable[int]:
    return (1,) if num_layers >= 2 * pp else ()


def _gpipe_equal(pp: int, chunks: int, m: int, group: int | None) -> EqualStages:
    """GPipe: the same m + (p - 1) as 1F1B (the same float, so the two tie exactly), every microbatch
    held, the loss state of all m at the last forward (m - 1 beside the first backward)."""
    return m + (pp - 1), (m,) * pp, (m, m - 1)


def _one_f_one_b_equal(pp: int, chunks: int, m: int, group: int | None) -> EqualStages:
    """1F1B: the last microbatch's forward reaches the last rank after p - 1 forwards, and its
    backward returns after p - 1 backwards: m + (p - 1) stage times; rank r holds min(p - r, m); the
    last rank differentiates each microbatch right after its forward (one loss state at a time)."""
    return m + (pp - 1), tuple(min(pp - r, m) for r in range(pp)), (1, 0)


def _interleaved_equal(pp: int, chunks: int, m: int, group: int | None) -> EqualStages | None:
    """Interleaved 1F1B in groups of N microbatches (N = p unless set): the bubble shrinks to (p - 1)/v
    (Narayanan et al.) whatever N the rule allows; rank r holds its warm-up forwards
    2(p - r - 1) + (v - 1)N, plus one, at most all m v chunks: a larger N holds more. In whole groups
    the last rank's forward of the loss stage is followed by its backward (one loss state at a
    time); a shorter last group runs its loss-stage forwards ahead of their backwards: simulated."""
    n = group or pp
    if m % n:
        return None
    return (m + (pp - 1) / chunks, tuple(min(2 * (pp - r - 1) + (chunks - 1) * n + 1, m * chunks) for r in range(pp)),
            (1, 0))


def _single_chunk(generate: Callable[[int, int], list[list[Action]]]
                  ) -> Callable[[int, int, int, int | None], list[list[Action]]]:
    return lambda pp, chunks, m, group: generate(pp, m)


REGISTRY: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", _single_chunk(generators.gpipe), _configured, _no_vpp("gpipe"), _one,
                 equal_stages=_gpipe_equal),
    ScheduleKind("1f1b", _single_chunk(generators.one_f_one_b), _configured, _no_vpp("1f1b"), _one,
                 equal_stages=_one_f_one_b_equal),
    ScheduleKind("interleaved", generators.interleaved, _configured, _interleaved_rule, _interleaved_vpps,
                 equal_stages=_interleaved_equal),
    ScheduleKind("zb-h1", _single_chunk(generators.zb_h1), _configured, _no_vpp("zb-h1"), _one),
    ScheduleKind("dualpipev", _single_chunk(generators.dualpipev), lambda vpp: 2, _dualpipev_rule, _v_vpps,
                 v_shape=True),
)}

def microbatch_problem(schedule: str, pp: int, vpp: int | None, num_microbatches: int,
                       group: int | None = None) -> str | None:
    """None when `schedule` can run `num_microbatches` on `pp` ranks with `vpp` chunks each (interleaved:
    in groups of `group`, None = PP), else the rule broken."""
    if schedule not in REGISTRY:
        return f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(REGISTRY)}"
    if pp < 1:
        return f"needs pipeline_model_parallel_size >= 1, got {pp}"
    if num_microbatches < 1:
        return f"needs at least 1 microbatch, got {num_microbatches}"
    return REGISTRY[schedule].rule(pp, vpp, num_microbatches, group)


GROUP_RULES = ("megatron", "rounds")
"""How a runtime groups an interleaved schedule's microbatches (`smallest_group`)."""


def smallest_group(pp: int, m: int, rule: str = "megatron") -> int | None:
    """The microbatch group a runtime interleaves m microbatches on pp ranks in, None where it cannot.
    megatron: the smallest Megatron-LM's rule allows (the last group may be shorter, but >= pp): a
    larger group holds more activations, and the bubble is the same. rounds: torch.distributed.pipelining's
    ScheduleInterleaved1F1B (torchtitan's): m // pp rounds of equal size, m a multiple of the rounds."""
    if rule == "rounds":
        rounds = m // pp
        return m // rounds if rounds and m % rounds == 0 else None
    return next((n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp), None)


def build_schedule(name: str, pp: int, microbatches: int, vpp: int | None = None, group: int | None = None) -> Schedule:
    """The lowered schedule `name` for pp ranks (interleaved: microbatches in groups of `group`, None = PP);
    UserError if its rule refuses."""
    problem = microbatch_problem(name, pp, vpp, microbatches, group)
    if problem:
        raise UserError(f"schedule {name} with pipeline_model_parallel_size={pp}, "
                        f"virtual_pipeline_model_parallel_size={vpp}, {microbatches} microbatches: {problem}")
    kind = REGISTRY[name]
    chunks = kind.chunks(vpp)
    ranks = kind.generate(pp, chunks, microbatches, group)
    compute = Schedule(name, tuple(tuple(a) for a in ranks), kind.placement(pp, chunks), microbatches)
    return lower(compute)
