"""`fivefold check CHECKPOINT`: verify every byte of a checkpoint against the checksums its save
recorded (fivefold.checkpoint.checksum), e.g. after copying it; exit 2 naming the first damaged file."""
from __future__ import annotations

import argparse

HELP = "verify a checkpoint's files against their checksums (after a copy, before a long run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a step_* folder, or a checkpoints root (its latest)")


def run(args, extra: list[str]) -> int:
    from fivefold.checkpoint.checksum import verify_checkpoint
    from fivefold.checkpoint.io import read_metadata

    folder, meta = read_metadata(args.checkpoint, "CHECKPOINT")
    verified = verify_checkpoint(folder, meta)
    if verified is None:
        print(f"note: checkpoint {folder} was saved without checksums (by an earlier fivefold): its metadata is "
              "well-formed; its tensor data cannot be verified (a load reads it unverified)")
        return 0
    files, nbytes = verified
    print(f"checkpoint {folder}: ok (metadata.json and {files} files, {nbytes / 2**20:.1f} MiB, every byte matches its crc32)")
    return 0
