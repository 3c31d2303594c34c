"""Drawing a simulated schedule: a text timeline for the terminal and a PNG (matplotlib, Agg).

Text: one row per rank, time flows right at `cols_per_unit` characters per unit of cost; each
computation is a block `[F3..]` as wide as its duration (label = kind + microbatch, lower-case for
a rank's second and later stages), idle time is blank. PNG: ranks as rows, blocks coloured by kind
(shaded darker for a rank's later stages), microbatch numbers on the blocks, bubble in the title.
"""
from __future__ import annotations

from fivefold.errors import writing_file
from fivefold.pipeline.ir import Action, Kind, Schedule
from fivefold.pipeline.simulate import SimResult

COLOURS = {Kind.F: "#4C72B0", Kind.B: "#55A868", Kind.W: "#C44E52", Kind.BW: "#8172B2", Kind.FB: "#CCB974"}


def _label(a: Action, schedule: Schedule) -> str:
    """`F3`; `f3` for a later chunk of its rank; F&B as `F4|1` (forward mb | backward mb)."""
    if a.kind is Kind.FB:
        return f"F{a.mb}|{a.b_mb}"
    text = f"{a.kind.value}{a.mb}"
    first = schedule.stages_of(schedule.placement[a.stage])[0]
    return text if a.stage == first else text.lower()


def summary(schedule: Schedule, result: SimResult) -> str:
    lines = [f"schedule {schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
             f"{schedule.num_microbatches} microbatches, makespan {result.makespan:g}"]
    bubble, idle, in_flight = result.bubble, result.idle, result.peak_in_flight_microbatches  # (lists: once)
    for r in range(schedule.num_ranks):
        lines.append(f"  rank {r}: stages {schedule.stages_of(r)}, bubble {bubble[r]:.1%} "
                     f"(idle {idle[r]:g}), peak in flight {result.peak_in_flight[r]} "
                     f"stage-microbatches = {in_flight[r]:g} microbatches")
    return "\n".join(lines)


def text_timeline(schedule: Schedule, result: SimResult, width: int = 160) -> str:
    """The timeline as text, scaled so the makespan fits in about `width` characters."""
    span = result.makespan
    shortest = min((iv.end - iv.start for iv in result.timeline if iv.end > iv.start), default=span)
    # characters the makespan takes: the shortest block gets 4 ... unless that overflows `width`. Times
    # are placed as shares of the makespan, so costs of 1e-320 or 1e300 draw as costs of 1 do (only
    # their ratios matter), where width / makespan or 4 / shortest would overflow.
    cols = min(4 * (span / shortest), width) if span > 0 else 0.0
    rows, by_rank = [], [[] for _ in range(schedule.num_ranks)]
    for iv in result.timeline:
        by_rank[iv.rank].append(iv)
    for r in range(schedule.num_ranks):
        line = [" "] * (int(round(cols)) + 1)
        for iv in by_rank[r]:
            a, b = (int(round(t / span * cols)) for t in (iv.start, iv.end)) if span > 0 else (0, 0)
            if b <= a:
                continue
            label = _label(iv.action, schedule)
            if b - a >= len(label) + 2:
                block = ("[" + label).ljust(b - a - 1, ".") + "]"
            else:  # too narrow for brackets: the label alone, microbatch digits kept first
                block = (label if len(label) <= b - a else label[1:]).ljust(b - a, ".")[: b - a]
            line[a:b] = list(block)
        rows.append(f"rank {r:<2} |" + "".join(line).rstrip())
    return "\n".join(rows)


def draw_png(schedule: Schedule, result: SimResult, path: str) -> None:
    """Write the timeline to `path` as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    n = schedule.num_ranks
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, len(result.timeline) / n * 0.45)), 0.6 * n + 1.6))
    for iv in result.timeline:
        a = iv.action
        chunk = schedule.stages_of(schedule.placement[a.stage]).index(a.stage)
        rgb = tuple(c * (1 - 0.35 * min(chunk, 2) / 2) for c in to_rgb(COLOURS[a.kind]))
        y = n - 1 - iv.rank
        ax.barh(y, iv.end - iv.start, left=iv.start, height=0.8, color=rgb, edgecolor="black", linewidth=0.5)
        ax.text((iv.start + iv.end) / 2, y, f"{a.mb}|{a.b_mb}" if a.kind is Kind.FB else str(a.mb),
                ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(n), [f"rank {r}" for r in reversed(range(n))])
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (cost units)")
    worst = max(result.bubble) if result.bubble else 0.0
    ax.set_title(f"{schedule.name}: {n} ranks, {schedule.num_microbatches} microbatches - "
                 f"bubble {worst:.1%} (worst rank), makespan {result.makespan:g}")
    kinds = sorted({iv.action.kind for iv in result.timeline}, key=list(COLOURS).index)
    ax.legend(handles=[Patch(color=COLOURS[k], label=k.value) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout()
    try:
        with writing_file(path, "the pipeline timeline picture"):
            fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
