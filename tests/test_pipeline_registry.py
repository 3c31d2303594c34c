"""The schedule registry (fivefold.pipeline.schedules): one entry makes a schedule known to the
generators, config validation, the layer split, the planner's layouts and search space and the CLIs."""
import dataclasses

import pytest

from fivefold.cli import main
from fivefold.config.load import load_config
from fivefold.config.validate import ConfigError, validate
from fivefold.pipeline import generators
from fivefold.pipeline.ir import Kind
from fivefold.pipeline.schedules import REGISTRY, build_schedule
from fivefold.pipeline.verify import verify
from fivefold.planner.layout import Plan
from fivefold.planner.search.space import SearchSpace, _pipelines


def _gpipe_lifo(pp: int, chunks: int, m: int, group: int | None):
    """GPipe whose backward passes run last microbatch first: a valid order that no built-in schedule has."""
    return [acts[:m] + acts[m:][::-1] for acts in generators.gpipe(pp, m)]


@pytest.fixture
def lifo(monkeypatch):
    kind = dataclasses.replace(REGISTRY["gpipe"], name="gpipe-lifo", generate=_gpipe_lifo)
    monkeypatch.setitem(REGISTRY, kind.name, kind)
    return kind


def test_one_entry_makes_a_schedule_known_everywhere(lifo, capsys):
    s = verify(build_schedule("gpipe-lifo", 3, 4))
    backward = [a.mb for a in s.ranks[0] if a.kind == Kind.BW]
    assert backward == [3, 2, 1, 0]

    cfg = load_config(None, ["pp=2", "num_layers=4", "global_batch_size=8", "pipeline_schedule=gpipe-lifo"],
                      world_size=4).config
    validate(cfg)
    plan = Plan(cfg)
    assert plan.schedule == "gpipe-lifo" and plan.vpp == 1 and plan.placement == (0, 1)
    assert [c for r in plan.rank_chunks for c in r] == [range(0, 2), range(2, 4)]

    assert list(_pipelines(4, 8, SearchSpace(schedules=("1f1b", "gpipe-lifo")))) == [(1, "1f1b"), (1, "gpipe-lifo")]
    assert main(["schedule", "--schedule", "gpipe-lifo", "--pp", "2", "--microbatches", "3"]) == 0
    assert "gpipe-lifo" in capsys.readouterr().out


def test_an_unregistered_schedule_is_refused_naming_the_registered_ones():
    cfg = load_config(None, ["pp=2", "num_layers=4", "global_batch_size=8", "pipeline_schedule=gpipe-lifo"],
                      world_size=4).config
    with pytest.raises(ConfigError, match="must be one of gpipe, 1f1b, interleaved, zb-h1, dualpipev"):
        validate(cfg)


@pytest.mark.parametrize("name,vpp,chunks,placement", [
    ("1f1b", None, 1, (0, 1)), ("interleaved", 2, 2, (0, 1, 0, 1)), ("dualpipev", None, 2, (0, 1, 1, 0))])
def test_entries_give_chunks_and_placement(name, vpp, chunks, placement):
    kind = REGISTRY[name]
    assert kind.chunks(vpp) == chunks and kind.placement(2, chunks) == placement
    assert build_schedule(name, 2, 4, vpp).placement == placement


@pytest.mark.parametrize("name", [n for n, k in REGISTRY.items() if k.equal_stages is not None])
def test_closed_forms_equal_the_simulator(name):
    """An entry's `equal_stages` closed form is what the planner reads instead of simulating: on every
    (pp, chunks, microbatches, microbatch group) of a grid that its rule accepts (the planner simulates
    at most 2pp microbatches, then extends linearly; the group: unset, and on up to 5 ranks and 5
    chunks PP + 1 and all microbatches, which interleaving alone reads), its makespan equals the
    simulator's, its peak in-flight chunks per rank are the simulator's exactly, with nothing
    B-done-W-pending, and so are the loss stage's microbatches held at the forwards and beside the
    backwards of its rank. A count the closed form leaves to the simulator is skipped."""
    from fivefold.pipeline.simulate import Costs, simulate
    from fivefold.planner.pipeline import _moments
    kind, tried, uneven = REGISTRY[name], 0, 0
    for pp in (1, 2, 3, 4, 5, 8, 12, 16):
        for vpp in (None, 2, 3, 4, 5, 8, 13):
            for m in range(1, 2 * pp + 1):
                for group in dict.fromkeys((None, pp + 1, m) if pp <= 5 and (vpp or 1) <= 5 else (None,)):
                    if kind.rule(pp, vpp, m, group):
                        continue
                    s = build_schedule(name, pp, m, vpp, group)
                    sim = simulate(s, Costs.per_rank(s, 1 / 3, 1 / 3, 1 / 3), timeline=False)
                    closed = kind.equal_stages(pp, kind.chunks(vpp), m, group)
                    if closed is None:  # simulated instead (an uneven last group)
                        uneven += 1
                        continue
                    makespan, held, final = closed
                    # the simulator sums thirds over up to ~400 actions per rank: equal to 1e-9 of a stage time
                    assert makespan == pytest.approx(sim.makespan, rel=0, abs=1e-9), (pp, vpp, m, group)
                    assert held == tuple(sim.peak_in_flight), (pp, vpp, m, group)
                    forward, backward = _moments(s.ranks[s.placement[-1]], s.num_stages - 1)
                    assert final == (max(f for *_, f in forward), max(f for *_, f in backward)), (pp, vpp, m, group)
                    assert all(a.kind not in (Kind.B, Kind.W) for r in s.ranks for a in r)  # BW whole: no pending W
                    tried += 1
    assert tried > 50 and uneven < tried
