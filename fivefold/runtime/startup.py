"""A launched rank's first act, before it imports torch (which takes minutes on a loaded node with a
large software stack): it stamps FOLDER/starting-R (host, pid, time) and registers its Python stack
dump on SIGUSR1 into FOLDER/rank-R.stack. From then on the launcher's watchdog (fivefold.watchdog)
knows the rank runs Python, and can have its stack at any point of its life (during its imports too:
the stack then shows which module it is importing). Pure Python, no torch.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import time
from pathlib import Path

STACK_SIGNAL = signal.SIGUSR1
_stack_file = None
"""The open file faulthandler writes into (it must stay open while registered)."""


def stamp_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"starting-{rank}"


def stack_path(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"rank-{rank}.stack"


def begin(folder: str | Path, rank: int) -> None:
    """Register this process's stack dump into rank `rank`'s stack file, then stamp its start. A folder
    that cannot be written (a full disk) leaves both undone: the rank runs, and its start-up is then
    watched as a rank's of which nothing is known."""
    global _stack_file
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        _stack_file = open(stack_path(folder, rank), "w")  # noqa: SIM115 - open as long as registered
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True)
        stamp_path(folder, rank).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                        "at": time.time()}))
    except OSError:
        pass


def stacks_to_file() -> bool:
    """Whether `begin` registered the stack dump (fivefold.runtime.heartbeat then leaves it as it is)."""
    return _stack_file is not None


def read_stamp(folder: str | Path, rank: int) -> dict | None:
    """Rank `rank`'s start stamp ({"host", "pid", "at"}), or None when it has written none (yet)."""
    try:
        return json.loads(stamp_path(folder, rank).read_text())
    except (OSError, ValueError):
        return None


def clear(folder: str | Path) -> None:
    """Remove the stamps and stack files an earlier run left in `folder`."""
    for pattern in ("starting-*", "rank-*.stack"):
        for old in Path(folder).glob(pattern):
            old.unlink(missing_ok=True)
