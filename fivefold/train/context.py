"""Where a rank stands in a run: its mesh (layout + groups) and device, passed explicitly to the loop."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.runtime.mesh import Group, Mesh
from fivefold.topology import Layout


def layout_text(layout: Layout) -> str:
    """'DP=4 TP=1 PP=1 CP=1 EP=1': the sizes a user sets, DP first (the one this runtime varies)."""
    return f"DP={layout.dp} TP={layout.tp} PP={layout.pp} CP={layout.cp} EP={layout.ep}"


@dataclass
class RankContext:
    mesh: Mesh
    out_dir: Path

    @classmethod
    def single(cls, out_dir: Path, device: torch.device = torch.device("cpu")) -> RankContext:
        """A one-rank run in this process (no process group needed)."""
        return cls(Mesh.build(Layout(), device=device), out_dir)

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world.size

    @property
    def layout(self) -> Layout:
        return self.mesh.layout

    @property
    def device(self) -> torch.device:
        return self.mesh.device

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (CP ranks of one DP index read the same samples)."""
        return self.mesh.dp.rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp.size

    @property
    def dp_group(self) -> Group:
        """The group gradients and loss sums are added over: DP x CP."""
        return self.mesh.dp_cp

    @property
    def model_parallel_group(self) -> Group:
        """The group the gradient norm's partial sums are added over: TP x PP."""
        return self.mesh.group("model-parallel")

    @property
    def world_group(self) -> Group:
        return self.mesh.world

    @property
    def is_main(self) -> bool:
        return self.rank == 0
