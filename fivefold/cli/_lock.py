"""One run per output folder: `train`, `rl`, `convert` and `export` hold an exclusive lock on what
they write for as long as they run, so a second command into the same folder is refused before any
rank starts, naming the running one.

The lock is an OS file lock (flock) on a file `.fivefold.lock`: the kernel releases it when its
process ends, however it ends (kill -9 included), so a lock left by a killed run is no lock, and the
next run takes it over; the file's text (host, pid, command, start time) only names the holder in
the refusal. The file is removed on release; a run that opened it just before checks, once
locked, that the path is still its file (else it locks again: the file was removed under it).
Under torchrun the rank-0 process holds it. flock is local to a machine: on a network file system
a run on another node is not seen (Linux NFS maps it to a byte-range lock, which is).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from fivefold.errors import UserError

LOCK_NAME = ".fivefold.lock"


def lock_file(folder: Path) -> Path:
    """The lock of an output folder: a file inside it."""
    return Path(folder) / LOCK_NAME


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another fivefold command (it has not said which yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return f"`fivefold {info.get('command', '?')}` (host {info.get('host', '?')}, pid {info.get('pid', '?')}, since {since})"


def _refusal(flag: str, folder: Path, path: Path) -> UserError:
    return UserError(f"{flag} {folder}: in use by a running {_holder(path)}; wait for it to end, stop it, or give "
                     f"another {flag} (one run writes into a folder at a time)")


def refuse_if_held(flag: str, folder: Path, path: Path | None = None) -> None:
    """UserError when a running command holds `folder`'s lock; makes nothing (a check before a command
    has made its folders)."""
    path = path or lock_file(folder)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file (no folder yet, or none running): nothing holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(flag, folder, path) from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def holding(flag: str, folder: Path, command: str, path: Path | None = None):
    """Hold `folder`'s exclusive lock (its folder must exist) for the block; UserError naming the
    running holder when another command holds it."""
    path = path or lock_file(folder)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"{flag} {folder}: cannot make its lock file {path} ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _refusal(flag, folder, path) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # removed by the holder that just ended: lock the file that is there now
    try:
        info = {"command": command, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                "argv": sys.argv[1:]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds without its note (the refusal then names no holder)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)
