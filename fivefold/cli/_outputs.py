"""Where a command writes: a run's or a checkpoint's folder made before the work starts, a file beside
the printout (a picture, a schedule table) named for its format; an error making or writing either is
one line (exit 2), never a traceback."""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
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


def check_output_folder(flag: str, path) -> None:
    """What `output_folder` refuses, checked without making anything: a command checks every folder it
    writes before it makes the first, so that a refused command leaves none behind."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{flag} {folder}: a file is there, not a folder (remove it, or give another path)")
    above = next(p for p in (folder, *folder.parents) if p.exists())
    if not above.is_dir():
        raise UserError(f"{flag} {folder}: cannot make the folder ({above} is a file, not a folder)")
    if not os.access(above, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {folder}: the folder is not writable" if above == folder
                        else f"{flag} {folder}: cannot make the folder ({above} is not writable)")


def output_folder(flag: str, path) -> Path:
    """Make the folder a command writes into (with its parents) before any work or rank starts; a path
    that cannot be a writable folder (a file in its way, no permission) ends the command with `flag`,
    the path and the reason."""
    folder = Path(path)
    check_output_folder(flag, folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {folder}: cannot make the folder ({e.strerror or e})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {folder}: the folder is not writable")
    return folder


@contextlib.contextmanager
def removed_if_refused(*paths):
    """The folders of `paths` that do not exist yet (and the missing ones above them) are taken away
    again, with whatever the block wrote into them, when the block raises (a refusal, Ctrl-C): a
    refused command leaves no folder of its own behind. A folder that was there before stays as it is."""
    made = []
    for path in paths:
        missing = [p for p in (Path(path), *Path(path).parents) if not p.exists() and not p.is_symlink()]
        if missing:
            made.append(missing[-1])  # the topmost: everything under it is this command's
    try:
        yield
    except BaseException:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
