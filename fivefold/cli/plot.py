"""`fivefold plot`: draw a run's pictures again from its metrics.jsonl (a run stopped before its end, an
older run, or one logged on another machine): the loss curve (an RL run's: rl.png, its reward, KL,
entropy and mismatch over the GRPO steps) and, when the run logged MoE loads per layer
(--moe-per-layer-logging), the heatmap of expert load over the steps."""
from __future__ import annotations

import argparse
from pathlib import Path

from fivefold.cli._outputs import output_folder
from fivefold.data.sources import json_lines
from fivefold.errors import UserError

HELP = "draw a run's loss curve (an RL run's rl.png) and MoE expert-load heatmap from its metrics.jsonl"

PICTURES = ("loss", "rl", "expert-load")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="a run's output folder (its metrics.jsonl) or a metrics.jsonl file")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="folder for loss.png / rl.png and expert_load.png (default: the run's folder)")
    p.add_argument("--what", default=None, metavar="LIST",
                   help=f"comma-separated pictures to draw, of {', '.join(PICTURES)} (default: loss for a "
                        "training run, rl for an RL run; expert-load where the run logged per-layer loads)")
    p.add_argument("--title", default="", help="title of the pictures")


def _metrics_file(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path}: no such file; give a run's --out folder or its metrics.jsonl")
    return path


DRAWN = ("loss", "eval_loss", "reward", "kl", "entropy", "logprob_mismatch")
"""The values a picture draws over the steps: a number, or null (a non-finite value, drawn as a gap)."""


def _rows(path: Path) -> list[dict]:
    rows = []
    for n, row in json_lines(path, cut_off_last=True):
        if not isinstance(row, dict) or "step" not in row or "loss" not in row:
            raise UserError(f"{path}:{n}: no step and loss: not a training run's metrics.jsonl (one JSON object "
                            "per logged step, as `fivefold train` writes it)")
        if not _is_number(row["step"]):
            raise UserError(f"{path}:{n}: step {row['step']!r} is not a number")
        for key in DRAWN:
            if key in row and row[key] is not None and not _is_number(row[key]):
                raise UserError(f"{path}:{n}: {key} {row[key]!r} is not a number (or null): the line was not "
                                "written by `fivefold train` / `rl`; fix or remove it")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: empty; a training run writes one line per logged step")
    return rows


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from fivefold.train.metrics import plot_loss_curve  # torch: loaded by this command only (`cli.convert`)
    from fivefold.rl.grpo import RL_KEYS, plot_rl
    from fivefold.train.moe_metrics import plot_expert_load

    what = None if args.what is None else [w.strip() for w in args.what.split(",") if w.strip()]
    if what is not None and (not what or any(w not in PICTURES for w in what)):
        raise UserError(f"--what {args.what!r}: choose from {', '.join(PICTURES)} (comma-separated)")
    path = _metrics_file(args.run)
    rows = _rows(path)
    curve, other = ("rl", "loss") if all(k in rows[0] for k in RL_KEYS) else ("loss", "rl")
    if what is None:
        what = [curve, "expert-load"]
    elif other in what:
        kind = "an RL (GRPO) run" if curve == "rl" else "a training run"
        raise UserError(f"--what {other}: {path} is {kind}'s metrics; its curve is --what {curve} ({curve}.png)")
    out = output_folder("--out", args.out or path.parent)
    if "loss" in what:
        print(f"wrote {plot_loss_curve(path, out / 'loss.png', title=args.title)}")
    if "rl" in what:
        print(f"wrote {plot_rl(rows, out / 'rl.png', title=args.title)}")
    if "expert-load" in what:
        png = plot_expert_load(rows, out / "expert_load.png", title=args.title)
        if png is not None:
            print(f"wrote {png}")
        else:
            why = (f"{path}: no per-layer MoE loads (moe_tokens_per_expert); train a MoE model with "
                   "--moe-per-layer-logging (logging.moe_per_layer_logging: true) to log them")
            if args.what is not None:  # asked for by name
                raise UserError(why)
            print(f"no expert_load.png: {why}")
    return 0
