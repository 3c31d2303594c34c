"""cluster: where the ranks run (nodes, ranks per node, the device), a section of fivefold.config.schema.Config."""
from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cuda", "cpu")
"""cluster.device: where the ranks run (fivefold.runtime.mesh.resolve_device)."""


@dataclass(kw_only=True)
class ClusterConfig:
    num_nodes: int = 1
    """Number of nodes. Default 1."""
    gpus_per_node: int = 8
    """Accelerators (or CPU ranks) per node. Default 8, as RLinf assumes."""
    world_size: int | None = None
    """Total ranks; default num_nodes * gpus_per_node when not given."""
    device: str = "auto"
    """Where the ranks run: cuda (NCCL, one GPU per rank on each node), cpu (gloo, one thread per rank),
    or auto: cuda where every rank on the node has a GPU of its own, else cpu with a notice (a 4-rank
    example on a 1-GPU machine runs on its CPU). Default auto."""

    @property
    def resolved_world_size(self) -> int:
        return self.world_size if self.world_size is not None else self.num_nodes * self.gpus_per_node
