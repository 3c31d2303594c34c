"""Schedules as CSV, so a user can write one by hand: one line per rank, one action per cell.

Row r (in order, after comment lines starting with '#' and blank lines) is rank r's action list in
the IR's text form (`0F0,0F1,0BW0,...`, see fivefold.pipeline.ir). Empty cells are skipped. The
stage placement is read off the computations: stage s lives on the rank whose row computes it. The
microbatch count is one more than the largest microbatch named. Sends/receives may be written or
left out (then `lower` inserts them).
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from fivefold.errors import UserError
from fivefold.pipeline.ir import Schedule, parse_action


MAX_PASSES = 1 << 18
"""Stage-microbatches (a forward and a backward each) a schedule holds at most, a loaded one too
(`loads`: training's `pipeline_schedule_csv` and `fivefold schedule --load-csv`). `fivefold schedule`
builds, checks, simulates and draws about linearly in them: 131k took 27 s on the 2-core machine
(PP 128 x 1024 microbatches), 128k over PP 16000 27 s (a line per rank)."""


SHOWN = 10
"""Stages an error lists at most (a CSV naming stage 99999 alone misses 99999 of them)."""

WRITTEN = "# fivefold pipeline schedule "
"""How a schedule CSV this module writes begins (`dumps`): what `replaceable` looks for."""


def dumps(schedule: Schedule) -> str:
    out = io.StringIO()
    out.write(f"{WRITTEN}{schedule.name}: one row per rank\n")
    writer = csv.writer(out, lineterminator="\n")
    for acts in schedule.ranks:
        writer.writerow([str(a) for a in acts])
    return out.getvalue()


def loads(text: str, name: str = "csv", max_passes: int = MAX_PASSES) -> Schedule:
    """The schedule in `text`; UserError naming the row and cell of what cannot be read. Stages x
    microbatches (the microbatch count is set by the largest named) is at most `max_passes`: checked
    cell by cell as the rows are read, so `0F99999999999` is refused before anything is built for it."""
    rows = []
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    top_stage = top_mb = -1
    for lineno, row in enumerate(csv.reader(lines)):
        acts = []
        for cell in row:
            if cell.strip():
                try:
                    a = parse_action(cell)
                except ValueError as e:
                    raise UserError(f"schedule CSV row {lineno} (rank {lineno}): {e}") from None
                for p in a.pieces():
                    top_stage, top_mb = max(top_stage, p.stage), max(top_mb, p.mb)
                if (top_stage + 1) * (top_mb + 1) > max_passes:
                    raise UserError(
                        f"schedule CSV row {lineno} (rank {lineno}): {cell.strip()} makes it at least "
                        f"{top_stage + 1:,} stages x {top_mb + 1:,} microbatches = {(top_stage + 1) * (top_mb + 1):,} "
                        f"stage-microbatches; a schedule holds at most {max_passes:,}: "
                        "number stages and microbatches from 0, and give fewer")
                acts.append(a)
        rows.append(acts)
    if not rows:
        raise UserError("schedule CSV has no rows (one row of actions per rank)")
    owner: dict[int, int] = {}
    for r, acts in enumerate(rows):
        for a in acts:
            for p in a.pieces():
                if owner.setdefault(p.stage, r) != r:
                    raise UserError(f"schedule CSV: stage {p.stage} is computed on rank {owner[p.stage]} "
                                    f"and on rank {r}; a stage lives on one rank")
    if not owner:
        raise UserError("schedule CSV computes nothing: its rows need computations (such as 0F0,0BW0), "
                        "which set the stages, microbatches and where each stage lives")
    num_stages = max(owner) + 1
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        shown = ", ".join(map(str, missing[:SHOWN]))
        if len(missing) > SHOWN:
            shown += f", ... ({len(missing):,} in all)"
        raise UserError(f"schedule CSV: stages [{shown}] are never computed, so their rank is unknown "
                        f"(stages are numbered from 0 to the largest named, {num_stages - 1})")
    placement = tuple(owner[s] for s in range(num_stages))
    return Schedule(name, tuple(tuple(a) for a in rows), placement, top_mb + 1)


def replaceable(path: str | Path) -> bool:
    """Whether writing a schedule CSV to `path` loses nothing: no file is there, or one this module
    wrote (its first line `WRITTEN`), not a hand-written schedule or another file named by mistake."""
    path = Path(path)
    if not path.exists():
        return True
    try:
        with path.open(encoding="utf-8") as f:
            return path.is_file() and f.readline().startswith(WRITTEN)
    except (OSError, UnicodeDecodeError):
        return False


def save_csv(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(dumps(schedule))


def load_csv(path: str | Path, max_passes: int = MAX_PASSES) -> Schedule:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read schedule CSV {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"schedule CSV {path}: byte 0x{e.object[e.start]:02x} at offset {e.start} is not UTF-8 "
                        "(a schedule CSV is text: one row of actions per rank)") from None
    return loads(text, name=Path(path).stem, max_passes=max_passes)
