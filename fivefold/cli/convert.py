"""`fivefold convert SRC DST [key=value ...] [--megatron-flag VALUE ...] [--world-size N]`."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from fivefold.cli._outputs import output_folder
from fivefold.config.load import load_config
from fivefold.config.validate import validate

HELP = "reshard a checkpoint offline into another layout's files (streaming, bounded memory)"
ACCEPTS_EXTRA = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "fivefold convert SRC DST [key=value ...] [--megatron-flag VALUE ...] [--world-size N]"
    p.description = (HELP + ". SRC: a checkpoint folder or root; DST: a new root. The model and run settings "
                     "are the checkpoint's; the words after DST change the layout (e.g. "
                     "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --world-size 4).")
    p.add_argument("src", help="checkpoint folder, or a root with `latest`")
    p.add_argument("dst", help="destination root (created; must not hold this step yet)")
    p.add_argument("--world-size", type=int, help="ranks of the destination layout (default: the checkpoint's)")


def run(args, extra) -> int:
    from fivefold.checkpoint.convert import convert  # torch: loaded by this command only (`cli.main` imports
    from fivefold.checkpoint.io import read_metadata  # every command to build its parser)

    folder, meta = read_metadata(args.src, "SRC")
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint's config as the base the layout words change
        base = Path(tmp) / "config.yaml"
        base.write_text(yaml.safe_dump(meta["config"]))
        loaded = load_config(str(base), extra, world_size=args.world_size)
    validate(loaded.config, loaded.dialect, world_flag="--world-size" if args.world_size else None)
    out = convert(folder, output_folder("DST", args.dst), loaded.config, log=lambda line: print(line, flush=True))
    print(f"wrote {out}")
    return 0
