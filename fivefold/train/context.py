"""Where a rank stands in a run: its ranks, groups and device, passed explicitly to the loop."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.topology import Layout


def layout_text(layout: Layout) -> str:
    """'DP=4 TP=1 PP=1 CP=1 EP=1': the sizes a user sets, DP first (the one this runtime varies)."""
    return f"DP={layout.dp} TP={layout.tp} PP={layout.pp} CP={layout.cp} EP={layout.ep}"


@dataclass
class RankContext:
    rank: int
    world_size: int
    layout: Layout
    dp_rank: int
    dp_size: int
    dp_group: object
    """The group gradients are summed over: DP x CP (None = a single rank)."""
    model_parallel_group: object
    """The group the gradient norm's partial sums are added over: TP x PP (None = a single rank)."""
    world_group: object
    device: torch.device
    out_dir: Path

    @property
    def is_main(self) -> bool:
        return self.rank == 0
