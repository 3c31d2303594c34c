"""Stacked memory bars of the top layouts against the GPU's capacity (matplotlib, Agg backend)."""
from __future__ import annotations

from fivefold.planner.memory.kinds import RankMemory
from fivefold.planner.search.ranking import Candidate

GiB = 2**30


def plot_memory(cands: list[Candidate], capacity: float, path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cands) + 2), 5))
    bottoms = [0.0] * len(cands)
    for kind in RankMemory.KINDS:
        vals = [c.memory.as_dict()[kind] / GiB for c in cands]
        ax.bar(range(len(cands)), vals, bottom=bottoms, label=kind)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.axhline(capacity / GiB, color="black", linestyle="--", label="GPU capacity")
    ax.set_xticks(range(len(cands)), [c.label.replace(" ", "\n", 3) for c in cands], fontsize=7)
    ax.set_ylabel("GiB per GPU (worst pipeline rank)")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
