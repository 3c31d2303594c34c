"""Asynchronous checkpoint saves (Megatron's --async-save, `checkpoint.async_save`).

At a save point every rank copies what it writes (parameter shards, AdamW state, RNG) to host memory
and returns to training; a background thread writes those copies into the checkpoint's temporary
folder. The checkpoint is committed — metadata written, folder renamed, `latest` pointed at it, by
rank 0 after a barrier — at the next save point or at the end of training, once every rank's writer
has finished. Until then `latest` names the previous checkpoint, so a job killed while a writer runs
(mid-file) leaves the previous checkpoint as `latest`, loadable; the half-written temporary folder is
replaced by the next save. The writer thread makes no collective call: only the commit does, from
the training thread, where every rank calls it at the same step.
"""
from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from fivefold.checkpoint.io import PeerFailed, _latest_note, _save, _tmp_dir, commit_checkpoint, save_checkpoint
from fivefold.errors import write_failed


class AsyncSaver:
    """One rank's pending checkpoint: `save(...)` (as save_checkpoint's arguments) stages and starts
    the writer; `finish()` waits for it and commits (collective; a no-op with nothing pending)."""

    def __init__(self, rank: int, barrier: Callable[[], None], all_ok: Callable[[bool], bool] = lambda ok: ok):
        """`all_ok(ok)`: whether every rank's writer succeeded (a collective over the world)."""
        self.rank, self.barrier, self.all_ok = rank, barrier, all_ok
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self._commit: dict | None = None

    def save(self, root: str | Path, step: int, *, extra: dict, keep: int = 2, **kw) -> Path:
        """Commit the previous checkpoint, then stage this one and write it in the background;
        returns the folder it will have once committed."""
        self.finish()
        files: list[tuple[dict[str, torch.Tensor], Path]] = []
        final = save_checkpoint(root, step, rank=self.rank, barrier=self.barrier, extra=extra, keep=keep,
                                defer=lambda tensors, path: files.append((tensors, path)), all_ok=self.all_ok, **kw)
        self._commit = {"root": root, "step": step, "extra": extra, "keep": keep}
        self._writer = threading.Thread(target=self._write, args=(files,), name=f"checkpoint-writer-{step}",
                                        daemon=True)
        self._writer.start()
        return final

    def _write(self, files) -> None:
        try:
            for tensors, path in files:
                _save(tensors, path)
        except BaseException as e:  # noqa: BLE001 (re-raised on the training thread by finish())
            self._error = e

    def finish(self) -> Path | None:
        """Wait for the writer and commit its checkpoint (every rank calls it at the same point)."""
        if self._writer is None:
            return None
        self._writer.join()
        self._writer, pending = None, self._commit
        error, self._error = self._error, None
        root, step = Path(pending["root"]), pending["step"]
        if isinstance(error, OSError):  # a full disk, a read-only folder: a message, not a traceback
            error = write_failed(error.filename or _tmp_dir(root, step), error, f"checkpoint {step}; "
                                 f"{_latest_note(root)}")
        if not self.all_ok(error is None):  # every rank stops here, none commits a partial checkpoint
            if self.rank == 0:  # every writer has ended: the partial folder goes
                shutil.rmtree(_tmp_dir(root, step), ignore_errors=True)
            raise error or PeerFailed(f"checkpoint {step}: another rank's writer failed (its log says why); "
                                      "the previous checkpoint stays latest")
        return commit_checkpoint(root, step, rank=self.rank, barrier=self.barrier, extra=pending["extra"],
                                 keep=pending["keep"], all_ok=self.all_ok)
