"""Errors a user can fix: the CLI prints their message and exits 2, without a traceback."""
import contextlib
import os
from pathlib import Path


class UserError(Exception):
    """Bad input (a config, a flag, a data file, a checkpoint): the message says what and how to fix it."""


class NotImplementedYet(UserError):
    """A knob that is parsed but not built yet: refused, never silently ignored."""

    def __init__(self, what: str):
        super().__init__(f"{what}: not implemented yet")


class WriteFailed(UserError):
    """A file could not be written (a full disk, a read-only folder, a quota): a user can fix it."""


def write_failed(path, error: OSError, what: str = "") -> WriteFailed:
    """The error for an OSError writing `path` (`what`: what the file is, and what stays as it was)."""
    if isinstance(path, bytes):  # (TensorBoard's writer opens its files by bytes names)
        path = os.fsdecode(path)
    reason = error.strerror or f"{error} (a full disk?)"  # numpy's tofile: "N requested and M written"
    return WriteFailed(f"cannot write {path}{f' ({what})' if what else ''}: {reason}; free space on that disk (or make "
                       "the folder writable, or give another folder) and run again")


@contextlib.contextmanager
def writing_file(path, what: str = "", *, partial: bool = True):
    """Around the writes of the one file `path`: an OSError is `write_failed`, the partial file removed
    (`partial=False`: `path` is a folder a writer keeps its own files in, named when the error names none)."""
    try:
        yield
    except OSError as e:
        if partial:
            with contextlib.suppress(OSError):  # (a read-only folder holds no partial file to remove)
                Path(path).unlink(missing_ok=True)
        raise write_failed(e.filename or path, e, what) from None
