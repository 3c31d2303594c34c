"""Session fixtures shared by the multi-rank tests."""
from __future__ import annotations

import pytest

from fivefold.testing.harness import Workers


@pytest.fixture(scope="session")
def workers():
    """get(n) -> a Workers(n) pool started on first use and reused for the whole session.
    Usage:  def test_x(workers): out = workers(4).run(_case, arg)"""
    pools: dict[int, Workers] = {}

    def get(n: int) -> Workers:
        if not 1 <= n <= 8:
            raise ValueError(f"workers(n) takes 1..8 ranks, not {n}")
        if n not in pools:
            pools[n] = Workers(n)
        return pools[n]

    yield get
    for pool in pools.values():
        pool.close()
