"""Where a command writes: a run's or a checkpoint's folder made before the work starts, a file beside
the printout (a picture, a schedule table) named for its format; an error making or writing either is
one line (exit 2), never a traceback."""
from __future__ import annotations

import argparse
import contextlib
import os
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


def output_folder(flag: str, path) -> Path:
    """Make the folder a command writes into (with its parents) before any work or rank starts; a path
    that cannot be a writable folder (a file in its way, no permission) ends the command with `flag`,
    the path and the reason."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder}: a file is there, not a folder (remove it, or give another path)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {folder}: cannot make the folder ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {folder}: the folder is not writable")
    return folder
