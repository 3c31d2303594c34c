"""`fivefold convert SRC DST [key=value ...] [--megatron-flag VALUE ...] [--world-size N]`."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from fivefold.cli._lock import holding, refuse_if_held
from fivefold.cli._outputs import output_folder, removed_if_refused
from fivefold.config.load import load_config
from fivefold.config.schema import to_dict
from fivefold.config.validate import validate
from fivefold.errors import UserError

HELP = "reshard a checkpoint offline into another layout's files (streaming, bounded memory)"
ACCEPTS_EXTRA = True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "fivefold convert SRC DST [key=value ...] [--megatron-flag VALUE ...] [--world-size N]"
    p.description = (HELP + ". SRC: a checkpoint folder or root; DST: a new root. The model and run settings "
                     "are the checkpoint's; the words after DST change only the layout, parallel.* and "
                     "cluster.*, and the batch sizes a new DP size may need (e.g. --tensor-model-parallel-size 2 "
                     "--pipeline-model-parallel-size 2 --world-size 4): a word that changes anything else is "
                     "refused.")
    p.add_argument("src", help="checkpoint folder, or a root with `latest`")
    p.add_argument("dst", help="destination root (created; must not hold this step yet)")
    p.add_argument("--world-size", type=int, help="ranks of the destination layout (default: the checkpoint's)")


def run(args, extra) -> int:
    from fivefold.checkpoint.convert import convert  # torch: loaded by this command only (`cli.main` imports
    from fivefold.checkpoint.io import read_metadata  # every command to build its parser)

    refuse_if_held("DST", Path(args.dst))
    folder, meta = read_metadata(args.src, "SRC")
    if "config" not in meta:
        raise UserError(f"SRC {folder}: its metadata.json has no config (not written by fivefold train), so the "
                        "model to convert is unknown")
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint's config as the base the layout words change
        base = Path(tmp) / "config.yaml"
        base.write_text(yaml.safe_dump(meta["config"]))
        before = to_dict(load_config(str(base)).config)
        loaded = load_config(str(base), extra, world_size=args.world_size)
    _check_layout_only(before, to_dict(loaded.config))
    validate(loaded.config, loaded.dialect, world_flag="--world-size" if args.world_size else None)
    # DST is made before convert's own checks (a step already there, a missing RNG file, a model that does
    # not fit the checkpoint): taken away again on a refusal when this command made it
    with removed_if_refused(args.dst):
        dst = output_folder("DST", args.dst)
        with holding("DST", dst, "convert"):
            out = convert(folder, dst, loaded.config, log=lambda line: print(line, flush=True))
    print(f"wrote {out}")
    return 0


LAYOUT_SECTIONS = ("parallel", "cluster")
BATCH_FIELDS = ("micro_batch_size", "global_batch_size")
"""What the words after DST may change: the parallel layout, the world size, and the batch sizes a
new DP size may need (the global batch a multiple of micro-batch x DP: validate's fix names them)."""


def _check_layout_only(before: dict, after: dict) -> None:
    """UserError naming every setting the words change outside the layout (a learning rate, a data
    setting): `convert` would store it in the new checkpoint's config, not what its help says. A
    change of the model's shapes alone is left to `check_fits`, which says which tensors differ."""
    from fivefold.checkpoint.io import PARAMETER_FIELDS

    changed = [(section, k, v) for section, values in after.items() if section not in LAYOUT_SECTIONS
               for k, v in values.items() if before[section].get(k) != v
               and not (section == "training" and k in BATCH_FIELDS)]
    if changed and not all(section == "model" and k in PARAMETER_FIELDS for section, k, _ in changed):
        named = ", ".join(f"{section}.{k}={v}" for section, k, v in changed)
        raise UserError(f"convert: {named}: the words after DST change only the layout (parallel.*, cluster.*, "
                        "--world-size, the batch sizes); the model and run settings are the checkpoint's (give run "
                        "settings to `train --load` instead)")
