"""Asynchronous checkpoints (Megatron's --async-save): the training loop goes on while a background
thread writes this rank's files.

`start` copies what the rank writes (parameters, optimizer ranges, RNG) to CPU memory, which costs a
copy of the rank's state and no disk time, and hands the copies to a thread that writes them into
the checkpoint's .tmp folder. `finish` (collective) waits for the thread, asks every rank whether its
files landed, and only if all did commits the checkpoint as a synchronous save does (rank 0 writes
metadata.json, renames .tmp-step_N to step_N, moves `latest`). Until then `latest` names the
previous checkpoint, so a run killed while the thread writes (mid-file) resumes from the previous
one. The loop calls `finish` before the next save and at the end; collectives stay on the main
thread (the background thread only writes files).
"""
from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from fivefold.checkpoint import io
from fivefold.errors import UserError


class AsyncSaver:
    """One checkpoint in flight at a time, written by a background thread."""

    def __init__(self, *, rank: int, barrier: Callable[[], None], all_ok: Callable[[bool], bool],
                 write: io.Write | None = None):
        """`barrier`: over every rank; `all_ok(mine)`: whether every rank's `mine` is True (a collective);
        `write`: the file writer (default io._save, looked up when writing: tests stand in another)."""
        self.rank, self.barrier, self.all_ok, self.write = rank, barrier, all_ok, write
        self._pending: tuple[threading.Thread, Path, int, dict, int] | None = None
        self._error: str | None = None

    def start(self, root: str | Path, step: int, *, extra: dict, keep: int = 2, **rank_files) -> Path | None:
        """Begin checkpoint `step` (collective); first finishes the one in flight, whose folder it
        returns (None if none). `rank_files`: as io.write_rank_files takes them (model, optimizer,
        writes_params, shard_of, optim_shards, writes_optim)."""
        previous = self.finish()
        root = Path(root)
        files: list[tuple[dict[str, torch.Tensor], Path]] = []

        def snapshot(tensors: dict[str, torch.Tensor], path: Path) -> None:
            files.append(({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}, path))

        io.write_rank_files(root, step, rank=self.rank, barrier=self.barrier, write=snapshot, **rank_files)
        self._error = None
        thread = threading.Thread(target=self._write_all, args=(files,), name=f"checkpoint-{step}")
        thread.start()
        self._pending = (thread, root, step, extra, keep)
        return previous

    def _write_all(self, files: list[tuple[dict[str, torch.Tensor], Path]]) -> None:
        try:
            write = self.write or io._save
            for tensors, path in files:
                write(tensors, path)
        except BaseException:  # noqa: BLE001 - reported by finish() on the main thread
            self._error = traceback.format_exc()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def finish(self) -> Path | None:
        """Wait for the checkpoint in flight and commit it (collective); its folder, or None when none
        was in flight. UserError on every rank when any rank failed to write (nothing is committed)."""
        if self._pending is None:
            return None
        thread, root, step, extra, keep = self._pending
        self._pending = None
        thread.join()
        if not self.all_ok(self._error is None):
            mine = f": on this rank\n{self._error}" if self._error else " on another rank"
            raise UserError(f"async save of step {step} under {root} failed{mine}\nthe previous checkpoint stays "
                            "`latest`; check the disk (space, permissions) or run without --async-save")
        return io.commit_checkpoint(root, step, rank=self.rank, barrier=self.barrier, extra=extra, keep=keep)
