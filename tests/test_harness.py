"""The multi-rank harness: results by rank, reused workers, failures with rank and traceback,
a hung case timing out and the pool restarting, leaving no temporary folder behind."""
from __future__ import annotations

import os
import time
from multiprocessing import util

import pytest
import torch
import torch.distributed as dist

from fivefold.testing.harness import GRACE_S, RankFailed, WorkersTimeout


def _sum_case(rank, world, i):
    t = torch.tensor([float(rank + i)])
    dist.all_reduce(t)
    return rank, world, t.item(), os.getpid(), torch.get_num_threads()


def test_twenty_cases_on_reused_workers(workers):
    pool = workers(4)
    pids = None
    for i in range(20):
        out = pool.run(_sum_case, i)
        assert [o[:3] for o in out] == [(r, 4, 6.0 + 4 * i) for r in range(4)]
        assert all(o[4] == 1 for o in out)  # one intra-op thread per rank
        pids = pids or [o[3] for o in out]
        assert [o[3] for o in out] == pids  # the same processes every time


def _fail_on_rank_2(rank, world):
    if rank == 2:
        raise ValueError("deliberate failure on rank two")
    return rank


def test_failure_names_rank_and_traceback(workers):
    pool = workers(4)
    with pytest.raises(RankFailed) as info:
        pool.run(_fail_on_rank_2)
    msg = str(info.value)
    assert "rank 2 failed in _fail_on_rank_2" in msg
    assert "ValueError: deliberate failure on rank two" in msg and "Traceback" in msg
    assert list(info.value.failures) == [2]
    assert pool.run(_sum_case, 0)[0][:3] == (0, 4, 6.0)  # the others had finished: pool still usable


def _hang_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def _tensor_and_temp_dir(rank, world):
    """A tensor sent back (its file descriptor handed over through a folder multiprocessing makes) and
    that folder."""
    return torch.ones(2), util.get_temp_dir()


def test_timeout_kills_and_restarts(workers):
    pool = workers(2)
    first = [o[3] for o in pool.run(_sum_case, 0)]
    folders = [d for _, d in pool.run(_tensor_and_temp_dir)]
    assert all(os.path.isdir(d) for d in folders)
    with pytest.raises(WorkersTimeout, match=r"ranks \[1\] never answered"):
        pool.run(_hang_on_rank_1, timeout=1.0)
    assert not any(os.path.exists(d) for d in folders)  # the killed workers' folders went with the pool
    out = pool.run(_sum_case, 1)
    assert [o[2] for o in out] == [3.0, 3.0]
    assert not set(first) & {o[3] for o in out}  # fresh processes


def _fail_before_collective(rank, world):
    if rank == 0:
        raise RuntimeError("rank zero gives up")
    dist.all_reduce(torch.ones(1))  # rank 1 waits here for rank 0, forever
    return rank


def test_failure_while_others_wait_in_a_collective(workers):
    pool = workers(2)
    pool.grace = 0.5
    try:
        with pytest.raises(RankFailed, match="rank 0 failed in _fail_before_collective"):
            pool.run(_fail_before_collective)
    finally:
        pool.grace = GRACE_S
    assert [o[2] for o in pool.run(_sum_case, 0)] == [1.0, 1.0]  # restarted after the kill
