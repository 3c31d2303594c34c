"""Sent activations are freed as soon as the send completes, at a point that cannot deadlock.

Pure part: send_waits.send_policy on every built-in schedule (the rendezvous run completes, and the
earliest policy is the one chosen). Executor part: one middle rank of PP4 1F1B run alone, its peers
replaced by a fake p2p whose sends behave like gloo's (`is_completed()` False until `wait()`, the
buffer read at `wait()`); live tensor bytes are counted by the benchmark's dispatch mode.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.pp_schedules import PeakTensorBytes
from fivefold.pipeline.executor import PipelineExecutor
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.ir import Kind
from fivefold.pipeline.send_waits import POLICIES, SendPolicy, completes, send_policy
from fivefold.pipeline.simulate import Costs, simulate

SIZES = [(name, pp, m) for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")
         for pp in (2, 3, 4, 8) for m in (2 * pp, 3 * pp, 4 * pp)]


@pytest.mark.parametrize("name,pp,m", SIZES)
def test_policy_completes_and_is_the_earliest(name, pp, m):
    s = build_schedule(name, pp, m, vpp=2 if name == "interleaved" else None)
    policy = send_policy(s)
    assert policy.forward is not None and completes(s, policy)
    assert not any(completes(s, p) for p in POLICIES[:POLICIES.index(policy)])
    if name in ("gpipe", "1f1b", "zb-h1"):
        assert policy == SendPolicy(0, 0)  # every send waited before the rank's next computation


def test_waiting_before_the_next_computation_deadlocks_interleaved():
    # PP2 VPP2: rank 0 sends 2B0 and would wait for it before 0F3, rank 1 sends 3B1 and would wait
    # before 1F2; each receive comes after the other's wait. The lag-1 policy runs through.
    s = build_schedule("interleaved", 2, 4, vpp=2)
    assert not completes(s, SendPolicy(0, 0))
    assert send_policy(s) == SendPolicy(1, 1)


class _GlooLikeWork:
    """A send that completes only in wait(), where it reads the buffer (gloo's rendezvous)."""

    def __init__(self, tensor: torch.Tensor | None, delivered: list):
        self.tensor, self.delivered, self.done = tensor, delivered, tensor is None

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:
            self.delivered.append(tuple(self.tensor.shape))  # (1,) if the storage was freed before
            self.tensor, self.done = None, True


class _Scale(nn.Module):
    """y = x * g: saves x only (g's gradient is h floats), so a microbatch in flight holds one (b, s, h)."""

    def __init__(self, h: int):
        super().__init__()
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, h))

    def forward(self, x):
        return x * self.g


def test_middle_rank_holds_no_more_than_its_in_flight_activations():
    pp, m, rank, b, s, h = 4, 8, 1, 1, 64, 64
    schedule = build_schedule("1f1b", pp, m)
    act_bytes = b * s * h * 4
    in_flight = simulate(schedule, Costs.uniform(pp, 1.0, 1.0, 1.0)).peak_in_flight[rank]
    delivered, at_forward = [], []
    gen = torch.Generator().manual_seed(0)

    def send_recv(sends, recvs, tag):
        for buf, _ in recvs:
            buf.copy_(torch.randn(buf.shape, generator=gen))
        return [_GlooLikeWork(t, delivered) for t, _ in sends] + [_GlooLikeWork(None, delivered) for _ in recvs]

    stage = _Scale(h)
    stage.register_forward_pre_hook(lambda mod, args: at_forward.append(mode.live))
    ex = PipelineExecutor(schedule, {rank: stage}, rank, peer_rank=lambda r: r, send_recv=send_recv, hidden_size=h)
    ids = [torch.zeros(b, s, dtype=torch.long)] * m
    with PeakTensorBytes() as mode:
        ex.run(ids)
    sends = sum(a.kind in (Kind.SEND_F, Kind.SEND_B) for a in schedule.ranks[rank])
    assert len(delivered) == sends and all(shape == (b, s, h) for shape in delivered)
    # When a forward starts, the rank holds the inputs of the microbatches in flight (this one
    # included) and nothing it has sent; slack: g's gradient and the one-element freed outputs.
    slack = 4 * h + 4 * m
    assert max(at_forward) <= in_flight * act_bytes + slack, (max(at_forward) / act_bytes, in_flight)
    assert stage.g.grad is not None and torch.isfinite(stage.g.grad).all()
