"""What the planner needs from a pipeline schedule, read from the schedule simulator itself
(`fivefold.pipeline.simulate`, the one the `schedule` command and the executor's tests use).

The simulator runs the schedule with equal stages (F = B = W = 1/3 of a rank's time per microbatch,
split equally over its model chunks). Beyond `SIMULATED` microbatches per rank the
schedules are in their steady state, where each further microbatch adds one stage time, so the
planner simulates min(m, cap) microbatches and extends linearly (exact, see the tests). The idle
time it finds, in units of a stage time, is the bubble B_u: (p - 1) for GPipe and 1F1B, (p - 1)/v
for interleaved, (p - 1)(F + B - W) for ZB-H1, ...

With unequal rank times t_r the step time is taken as m * max(t) + B_u * (sum(t) - max(t)) / (p - 1):
for GPipe, 1F1B and interleaved this is Narayanan et al.'s closed form (m - 1) max + sum, and
m max + (sum - max) / v; for ZB-H1 and DualPipeV it scales their equal-stage bubble the same way.
A forward-only model (`Engine.forward`) runs the schedule's forward-only version
(`fivefold.pipeline.forward.forward_only`: each rank's forwards in their order, the backwards dropped),
simulated alike with F = a rank's forward time (`forward_pipeline_time`): (p - 1) stage times of fill for
1F1B and GPipe. Peak in-flight activations are the simulator's; a schedule that held every microbatch it was given
(GPipe) holds all m. Where the registry entry has a closed form of the equal-stage simulation
(`ScheduleKind.equal_stages`: GPipe, 1F1B, interleaved; proven equal to the simulator over a grid in
tests/test_pipeline_registry.py), it is read instead of simulating: PP64 1F1B cost ~0.4 s of CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from fivefold.pipeline.forward import forward_only
from fivefold.pipeline.ir import Kind
from fivefold.pipeline.schedules import REGISTRY, build_schedule
from fivefold.pipeline.simulate import Costs, simulate

SIMULATED = 2
"""Microbatches per pipeline rank simulated before the steady state is extended linearly (2p is past
every schedule's warm-up: the tests compare with 8p)."""


Front = tuple[tuple[int, int, int], ...]
"""(held, pending, final) chunk counts, none exceeding another in all three."""


@dataclass(frozen=True)
class PipelineProfile:
    vpp: int
    """Model chunks per rank (1 without interleaving; 2 for DualPipeV's V)."""
    moments: tuple[tuple[Front, Front], ...]
    """Per pipeline rank: (at its forwards, in its backwards) the (held, pending, final) counts that
    occur together, each kind cut to the triples no other of it exceeds in all (`_moments`): the
    peaks need not coincide (DualPipeV's middle ranks hold most when little W is pending).
    Closed-form schedules: the peak held, nothing pending, their final-stage count."""

    @cached_property
    def inflight_chunks(self) -> tuple[int, ...]:
        """Per pipeline rank: peak number of (microbatch, model chunk) forward activations held."""
        return tuple(max(h for front in fronts for h, *_ in front) for fronts in self.moments)

    def inflight_microbatches(self, rank: int) -> float:
        """Peak held activations of `rank` in units of its whole stage's per-microbatch activations."""
        return self.inflight_chunks[rank] / self.vpp

    @cached_property
    def pending_weight_chunks(self) -> tuple[int, ...]:
        """Per pipeline rank: peak number of (microbatch, chunk) whose input gradient (B) is done and
        whose weight gradient (W) is not yet: zero-bubble schedules keep their graphs and the gradients
        recorded at each linear's output meanwhile. 0 where B and W run as one (BW), and for stage 0
        (its input is token ids: B has nothing to compute, W runs the whole backward)."""
        return tuple(max(p for _, p, _ in backward) for _, backward in self.moments)

    @cached_property
    def defers_weights(self) -> bool:
        """Some rank holds B-done-W-pending gradients at some moment (a zero-bubble schedule; pending
        grows only at a B, a backward moment)."""
        return any(self.pending_weight_chunks)

    @property
    def pending_weight_chunks_at_forward(self) -> tuple[int, ...]:
        """The same, peak over the moments a forward runs (when the last stage holds its logits)."""
        return tuple(max(p for _, p, _ in forward) for forward, _ in self.moments)


@lru_cache(maxsize=1024)
def _equal_stages(schedule: str, pp: int, vpp: int | None, m: int, group: int | None, fused: bool = False):
    """(makespan in stage times, chunks per rank, each rank's `PipelineProfile.moments`) of m microbatches
    with equal stages: the registry's closed form where it has one, else simulated on min(m, SIMULATED pp)
    (all m with a microbatch group) and extended linearly (each further microbatch one stage time; only
    GPipe's counts grow: it holds every microbatch and every loss state)."""
    kind, chunks = REGISTRY[schedule], REGISTRY[schedule].chunks(vpp)
    closed = kind.equal_stages(pp, chunks, m, group) \
        if kind.equal_stages is not None and kind.rule(pp, vpp, m, group) is None else None
    if closed is not None:
        (makespan, held, (at_forward, in_backward)), last = closed, kind.placement(pp, chunks)[-1]
        return makespan, (chunks,) * pp, tuple((((h, 0, at_forward if r == last else 0),),
                                                 ((h, 0, in_backward if r == last else 0),))
                                                for r, h in enumerate(held))
    m0 = m if group else min(m, SIMULATED * pp)  # a group's rule reads the whole count: simulated whole
    makespan, chunks, moments = _simulate(schedule, pp, vpp, m0, group, fused)
    if m > m0:  # only what holds every simulated microbatch grows (GPipe): the rest is steady state
        def grown(fronts: tuple[Front, Front], c: int) -> tuple[Front, Front]:
            every = max(f for *_, f in fronts[0]) == m0  # the rank held all loss states: so it holds m
            return tuple(tuple((m * c if h == m0 * c else h, p, f + (m - m0) * every) for h, p, f in front)
                         for front in fronts)
        moments = tuple(grown(fronts, c) for fronts, c in zip(moments, chunks))
    return makespan + (m - m0), chunks, moments


@lru_cache(maxsize=1024)
def _simulate(schedule: str, pp: int, vpp: int | None, m: int, group: int | None, fused: bool = False):
    """`_equal_stages` of the simulator itself (`fused`: every B the whole backward, W nothing)."""
    s = build_schedule(schedule, pp, m, vpp, group)
    r = simulate(s, Costs.per_rank(s, 1 / 3, 2 / 3 if fused else 1 / 3, 0.0 if fused else 1 / 3), timeline=False)
    return r.makespan, tuple(r.stages_per_rank), tuple(_moments(a, s.num_stages - 1, fused) for a in s.ranks)


def _moments(actions, final: int, fused: bool = False) -> tuple[Front, Front]:
    """One rank's (held, pending, final) counts at its forwards and in its backwards, in its order:
    held = (stage, microbatch) whose F has run and whose W (or BW) has not finished, the running one
    included (as the simulator counts in flight); pending = B pieces done - W pieces done on stages
    > 0, counted after the action (an F&B is its F, then its BW: B and W together leave pending as
    it was); final = microbatches of stage `final` (the loss) whose F has run and whose B (or BW) has
    not: each keeps its loss state until then (GPipe all m at the end of the forwards), the running
    F included, the microbatch a B / BW is differentiating not. `fused`: each B runs the whole
    backward (a BW), its W only drops the references (the stage input, a layer input)."""
    held = pending = loss_held = 0
    forward, backward = set(), set()
    for a in actions:
        kind = a.kind
        if kind is Kind.F or kind is Kind.FB:
            held += 1
            loss_held += a.stage == final
            forward.add((held, pending, loss_held))
            if kind is Kind.FB:
                loss_held -= a.b_stage == final
                backward.add((held, pending, loss_held))
                held -= 1
        elif fused and kind is Kind.W:
            continue
        elif kind in _BACKWARD:
            if a.stage > 0 and not fused:
                pending += (kind is Kind.B) - (kind is Kind.W)
            loss_held -= kind is not Kind.W and a.stage == final
            backward.add((held, pending, loss_held))
            held -= kind is not Kind.B or fused
    return _front(forward), _front(backward)


def _front(moments: set[tuple[int, int, int]]) -> Front:
    """The moments no other exceeds in every count."""
    return tuple(sorted(p for p in moments
                        if not any(q != p and all(a >= b for a, b in zip(q, p)) for q in moments)))


_BACKWARD = (Kind.B, Kind.W, Kind.BW)


@lru_cache(maxsize=1024)
def pipeline_profile(schedule: str, pp: int, vpp: int | None, m: int, group: int | None = None,
                     fused: bool = False) -> PipelineProfile:
    """`fused`: the runtime runs each split backward's B as the whole backward (full recompute)."""
    if schedule not in REGISTRY:
        raise ValueError(f"the planner has no model of schedule {schedule!r}; use one of {tuple(REGISTRY)}")
    _, chunks, moments = _equal_stages(schedule, pp, vpp, m, group, fused)
    return PipelineProfile(vpp=chunks[0], moments=moments)


def bubble_stage_times(schedule: str, pp: int, vpp: int | None, m: int, group: int | None = None,
                       fused: bool = False) -> float:
    """B_u: the idle time of m microbatches with equal stages, in units of one rank's microbatch time
    (`fused`: the runtime runs each split backward's B as the whole backward, as under full recompute)."""
    return _equal_stages(schedule, pp, vpp, m, group, fused)[0] - m


def pipeline_time(schedule: str, stage_times: list[float], vpp: int | None, m: int, group: int | None = None,
                  fused: bool = False) -> float:
    """Step time of the pipeline part, from each rank's time for one microbatch (forward + backward)."""
    pp, worst = len(stage_times), max(stage_times)
    if pp == 1:
        return m * worst
    return m * worst + bubble_stage_times(schedule, pp, vpp, m, group, fused) * (sum(stage_times) - worst) / (pp - 1)


@lru_cache(maxsize=4096)
def bubble_fraction(schedule: str, pp: int, vpp: int | None, m: int, group: int | None = None,
                    fused: bool = False) -> float:
    """Idle share of the pipeline time with equal stages."""
    t = pipeline_time(schedule, [1.0] * pp, vpp, m, group, fused)
    return 1.0 - m / t


@lru_cache(maxsize=1024)
def _forward_makespan(schedule: str, pp: int, vpp: int | None, m: int, group: int | None = None) -> float:
    """Makespan, in units of one rank's forward of a microbatch, of the schedule's forward-only version
    (`forward_only`, what Engine.forward runs) with equal stages: simulated on min(m, SIMULATED pp)
    microbatches (all m with a microbatch group) and extended by one stage time per further microbatch
    (the steady state: every rank busy; tests/test_planner_forward.py compares with the whole simulation)."""
    m0 = m if group else min(m, SIMULATED * pp)
    s = forward_only(build_schedule(schedule, pp, m0, vpp, group))
    return simulate(s, Costs.per_rank(s, 1.0, 0.0, 0.0), timeline=False).makespan + (m - m0)


def forward_pipeline_time(schedule: str, stage_times: list[float], vpp: int | None, m: int,
                          group: int | None = None) -> float:
    """Time of m microbatches through the forward-only pipeline, from each rank's forward time for one
    microbatch: m max(t) + the forward-only bubble (in stage times) x (sum(t) - max(t)) / (p - 1), as
    `pipeline_time` scales the training schedule's."""
    pp, worst = len(stage_times), max(stage_times)
    if pp == 1:
        return m * worst
    return m * worst + (_forward_makespan(schedule, pp, vpp, m, group) - m) * (sum(stage_times) - worst) / (pp - 1)


def forward_bubble_fraction(schedule: str, pp: int, vpp: int | None, m: int, group: int | None = None) -> float:
    """Idle share of the forward-only pipeline with equal stages."""
    return 1.0 - m / forward_pipeline_time(schedule, [1.0] * pp, vpp, m, group)
