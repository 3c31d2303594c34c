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


WRITTEN = "# fivefold pipeline schedule "
"""How a schedule CSV this module writes begins (`dumps`): what `replaceable` looks for."""


def dumps(schedule: Schedule) -> str:
    out = io.StringIO()
    out.write(f"{WRITTEN}{schedule.name}: one row per rank\n")
    writer = csv.writer(out, lineterminator="\n")
    for acts in schedule.ranks:
        writer.writerow([str(a) for a in acts])
    return out.getvalue()


def loads(text: str, name: str = "csv") -> Schedule:
    rows = []
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for lineno, row in enumerate(csv.reader(lines)):
        acts = []
        for cell in row:
            if cell.strip():
                try:
                    acts.append(parse_action(cell))
                except ValueError as e:
                    raise UserError(f"schedule CSV row {lineno} (rank {lineno}): {e}") from None
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
    num_stages = max(owner) + 1
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise UserError(f"schedule CSV: stages {missing} are never computed, so their rank is unknown")
    mbs = [p.mb for acts in rows for a in acts for p in a.pieces()]
    placement = tuple(owner[s] for s in range(num_stages))
    return Schedule(name, tuple(tuple(a) for a in rows), placement, max(mbs) + 1)


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


def load_csv(path: str | Path) -> Schedule:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"cannot read schedule CSV {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"schedule CSV {path}: byte 0x{e.object[e.start]:02x} at offset {e.start} is not UTF-8 "
                        "(a schedule CSV is text: one row of actions per rank)") from None
    return loads(text, name=Path(path).stem)
