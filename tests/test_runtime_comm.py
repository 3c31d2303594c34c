"""Each differentiable collective, forward and backward, at group sizes 1, 2 and 4, against its
mathematical definition; the byte counter's numbers per the convention; the raw ops; p2p.

Every rank builds the inputs of every rank from seeds, so it can compute the expected result of the
whole group itself. Entries are small integers in float64: sums are exact in any order, so results
are compared bit for bit (torch.equal)."""
from __future__ import annotations

import pytest
import torch

from fivefold.runtime import comm, traffic
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout

SHAPE = (2, 8, 4)
"""Dims 1 and 2 are divisible by 1, 2 and 4 (the group sizes tested)."""


def _ints(seed: int, shape=SHAPE) -> torch.Tensor:
    return torch.randint(-5, 6, shape, generator=torch.Generator().manual_seed(seed)).double()


def _cat_chunks(xs, r, split_dim, cat_dim, n):
    return torch.cat([x.chunk(n, split_dim)[r] for x in xs], dim=cat_dim)


def _expected(op: str, xs: list, ws: list, r: int, dim: int, n: int):
    """(Y_r, dL/dX_r) for L = sum_q <Y_q, W_q>, from the definitions in fivefold.runtime.comm."""
    total_x, total_w = sum(xs), sum(ws)
    if op == "copy_to":
        return xs[r], total_w
    if op == "reduce_from":
        return total_x, ws[r]
    if op == "gather":
        return torch.cat(xs, dim), total_w.chunk(n, dim)[r]
    if op == "reduce_scatter":
        return total_x.chunk(n, dim)[r], torch.cat(ws, dim)
    if op == "split":  # X replicated (xs all equal): dL/dX = cat_q W_q
        return xs[r].chunk(n, dim)[r], torch.cat(ws, dim)
    if op == "gather_split":
        return torch.cat(xs, dim), ws[r].chunk(n, dim)[r]
    if op == "all_to_all":  # scatter along dim, gather along the last dim
        return _cat_chunks(xs, r, dim, -1, n), _cat_chunks(ws, r, -1, dim, n)
    raise ValueError(op)


def _bytes_expected(op: str, x_bytes: int, n: int) -> dict[tuple[str, str], int]:
    """{(kind, "fwd"|"bwd"): bytes} by the convention (call bytes: the full tensor)."""
    if n == 1:
        return {}
    return {
        "copy_to": {("all_reduce", "bwd"): x_bytes},
        "reduce_from": {("all_reduce", "fwd"): x_bytes},
        "gather": {("all_gather", "fwd"): n * x_bytes, ("reduce_scatter", "bwd"): n * x_bytes},
        "reduce_scatter": {("reduce_scatter", "fwd"): x_bytes, ("all_gather", "bwd"): x_bytes},
        "split": {("all_gather", "bwd"): x_bytes},
        "gather_split": {("all_gather", "fwd"): n * x_bytes},
        "all_to_all": {("all_to_all", "fwd"): x_bytes, ("all_to_all", "bwd"): x_bytes},
    }[op]


def _call(op: str, x, dim: int, group):
    if op in ("copy_to", "reduce_from"):
        return getattr(comm, op)(x, group, "t")
    if op == "all_to_all":
        return comm.all_to_all(x, dim, -1, group, "t")
    return getattr(comm, op)(x, dim, group, "t")


def _differentiable_case(rank, world, op: str, n: int, dim: int):
    mesh = Mesh.build(Layout(tp=n, dp=world // n))
    g = mesh.tp
    assert g.size == n
    xs = [_ints(0 if op == "split" else 100 + q) for q in g.ranks]
    ws_shape = _expected(op, xs, xs, 0, dim, n)[0].shape
    ws = [_ints(200 + q, ws_shape) for q in g.ranks]
    y_exp, dx_exp = _expected(op, xs, ws, g.rank, dim, n)

    traffic.reset()
    x = xs[g.rank].clone().requires_grad_()
    y = _call(op, x, dim, g)
    assert torch.equal(y, y_exp), f"{op} forward on group rank {g.rank}"
    fwd = {k: traffic.bytes(kind=k) for k in traffic.KINDS}
    (y * ws[g.rank]).sum().backward()
    assert torch.equal(x.grad, dx_exp), f"{op} backward on group rank {g.rank}"
    bwd = {k: traffic.bytes(kind=k) - fwd[k] for k in traffic.KINDS}

    got = {(k, phase): b for phase, d in (("fwd", fwd), ("bwd", bwd)) for k, b in d.items() if b}
    assert got == _bytes_expected(op, x.nbytes, n)
    assert traffic.bytes(tag="t") == traffic.bytes() and traffic.bytes(group="tp") == traffic.bytes()
    bwd_kinds = {k for (k, phase) in got if phase == "bwd"}
    assert [(e.kind, e.phase) for e in traffic.events] == [(k, p) for k in bwd_kinds for p in ("start", "end")]
    return True


OPS = ["copy_to", "reduce_from", "gather", "reduce_scatter", "split", "gather_split", "all_to_all"]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("op", OPS)
def test_differentiable_collective(workers, op, n):
    assert workers(4).run(_differentiable_case, op, n, 1) == [True] * 4


@pytest.mark.parametrize("op,dim", [("gather", 0), ("gather", -1), ("reduce_scatter", 2), ("split", 0),
                                    ("all_to_all", 0)])
def test_other_dims(workers, op, dim):
    # dim 0 of SHAPE is 2: divisible by the group size 2 used here.
    assert workers(4).run(_differentiable_case, op, 2, dim) == [True] * 4


def _raw_case(rank, world):
    mesh = Mesh.build(Layout(tp=2, dp=2))
    tp, world_g = mesh.tp, mesh.world
    traffic.reset()
    out = {}
    # all_reduce_ with sum / max / min over tp = {0,1} / {2,3}
    for op, f in (("sum", sum), ("max", max), ("min", min)):
        t = torch.tensor([float(rank)])
        comm.all_reduce_(t, tp, "r", op=op)
        out[op] = t.item()
        assert t.item() == f(float(q) for q in tp.ranks)
    # async all-reduce: result after wait, events start then end
    t = torch.full((3,), float(rank))
    work = comm.all_reduce_async(t, world_g, "dp-grad")
    work.wait()
    assert torch.equal(t, torch.full((3,), 6.0))
    assert [(e.kind, e.tag, e.phase) for e in traffic.events] == [("all_reduce", "dp-grad", "start"),
                                                                   ("all_reduce", "dp-grad", "end")]
    # async all_gather / reduce_scatter along dim 1
    x = _ints(rank, (2, 4))
    y, w = comm.all_gather(x, 1, world_g, "r", async_op=True)
    w.wait()
    assert torch.equal(y, torch.cat([_ints(q, (2, 4)) for q in range(world)], 1))
    z, w = comm.reduce_scatter(x, 1, world_g, "r", async_op=True)
    w.wait()
    assert torch.equal(z, sum(_ints(q, (2, 4)) for q in range(world))[:, rank:rank + 1])
    # all_to_all_single, even: row j of rank q goes to rank j
    x = torch.arange(4.0) + 10 * rank
    assert torch.equal(comm.all_to_all_single(x, world_g, "ep"), torch.arange(4.0) * 10 + rank)
    # uneven: rank q sends q+1 rows (value q) to every rank... of width 2
    x = torch.full(((rank + 1) * world, 2), float(rank))
    got = comm.all_to_all_single(x, world_g, "ep", in_splits=[rank + 1] * world,
                                 out_splits=[q + 1 for q in range(world)])
    assert torch.equal(got, torch.cat([torch.full((q + 1, 2), float(q)) for q in range(world)]))
    # broadcast from global rank 3 in the tp group {2, 3}; rank 0 from 0 in {0, 1}
    src = tp.global_rank(1) if rank >= 2 else tp.global_rank(0)
    t = torch.tensor([float(rank)])
    comm.broadcast_(t, src, tp, "r")
    assert t.item() == src
    comm.barrier(world_g)
    b = 8  # bytes of one float64
    assert traffic.table() == sorted([
        ("all_reduce", "r", "tp", 3, 3 * 4),
        ("all_reduce", "dp-grad", "world", 1, 3 * 4),
        ("all_gather", "r", "world", 1, 2 * 4 * world * b),
        ("reduce_scatter", "r", "world", 1, 2 * 4 * b),
        ("all_to_all", "ep", "world", 2, 4 * 4 + (rank + 1) * world * 2 * 4),
        ("broadcast", "r", "tp", 1, 4),
    ])
    return True


def test_raw_ops(workers):
    assert workers(4).run(_raw_case) == [True] * 4


def _ring_case(rank, world):
    traffic.reset()
    send = torch.full((5,), float(rank))
    recv = torch.empty(5)
    works = comm.send_recv([(send, (rank + 1) % world)], [(recv, (rank - 1) % world)], tag="pp")
    for w in works:
        w.wait()
    assert torch.equal(recv, torch.full((5,), float((rank - 1) % world)))
    assert traffic.bytes(kind="send", tag="pp") == 20 and traffic.bytes(kind="recv", tag="pp") == 20
    assert traffic.calls(kind="send") == 1 and traffic.calls(group="p2p") == 2
    return True


def test_send_recv_ring(workers):
    assert workers(4).run(_ring_case) == [True] * 4


def test_group_of_one_is_identity_without_processes():
    mesh = Mesh.build(Layout())  # no process group initialised: a one-rank world
    traffic.reset()
    x = torch.ones(2, 4, requires_grad=True)
    assert comm.gather(x, 1, mesh.tp, "t") is x and comm.copy_to(x, mesh.dp, "t") is x
    y = x.detach()
    assert comm.all_reduce_(y, mesh.world, "t") is y and torch.equal(y, torch.ones(2, 4))
    comm.all_reduce_async(x.detach(), mesh.dp_cp, "t").wait()
    assert traffic.table() == [] and list(traffic.events) == []


def test_event_log_is_bounded():
    """Training never resets the log: it keeps the latest MAX_EVENTS, so memory does not grow per step."""
    traffic.reset()
    for i in range(traffic.MAX_EVENTS + 3):
        traffic.event("all_reduce", f"t{i}", "start")
    assert len(traffic.events) == traffic.MAX_EVENTS
    assert traffic.events[0].tag == "t3" and traffic.events[-1].tag == f"t{traffic.MAX_EVENTS + 2}"
    traffic.reset()
