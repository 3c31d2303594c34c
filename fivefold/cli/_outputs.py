"""Files a command writes beside its printout (a picture, a schedule table): the name checked before
the work starts, the folder made when written, an error writing it said in one line (exit 2)."""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from fivefold.errors import UserError

PICTURE_SUFFIXES = (".png", ".pdf", ".svg")


def picture_file(text: str) -> str:
    """argparse type: a picture to draw, named for its format (.png, or .pdf / .svg)."""
    if Path(text).suffix.lower() not in PICTURE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text}: name the picture FILE.png (or .pdf, .svg)")
    return text


@contextlib.contextmanager
def writing(flag: str, path: str):
    """Make `path`'s folder, then write it in the block; an OS error (a read-only folder, a file where
    the folder should be) ends the command with `flag`, the path and the reason."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        yield path
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None
