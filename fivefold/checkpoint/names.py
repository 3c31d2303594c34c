"""The whole model's parameter names, from the parts the ranks hold (a pipeline stage holds only its
layers): a checkpoint is "from another model" when it holds a tensor no rank of this model holds,
never because this rank's stage lacks it."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from fivefold.runtime import comm
from fivefold.runtime.mesh import Group


def gather_names(names: Iterable[str], group: Group) -> set[str]:
    """The union over `group`'s ranks of each rank's `names` (collective: every rank calls it)."""
    mine = torch.frombuffer(bytearray("\n".join(sorted(names)).encode()), dtype=torch.uint8)
    length = torch.tensor([mine.numel()], dtype=torch.int64)
    lengths = comm.all_gather(length, 0, group, tag="checkpoint-names")  # (ranks,)
    padded = torch.zeros(int(lengths.max()), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    every = comm.all_gather(padded, 0, group, tag="checkpoint-names").view(group.size, -1)  # (ranks, longest)
    out: set[str] = set()
    for row, n in zip(every, lengths.tolist()):
        text = bytes(row[:n].tolist()).decode()
        out.update(text.split("\n") if text else [])
    return out
