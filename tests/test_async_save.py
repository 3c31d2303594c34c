"""--async-save: the loop goes on while a background thread writes; the checkpoints and the losses
are a synchronous run's; a kill while the thread writes a file leaves the previous checkpoint as
`latest`, loadable, resuming on the uninterrupted losses."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import pytest

from _train_util import corpus, one_process_context, tiny_config
from fivefold.checkpoint import io
from fivefold.checkpoint.layout import resolve
from fivefold.cli.train import prepare
from fivefold.config.schema import to_dict
from fivefold.runtime import heartbeat
from fivefold.train.loop import train
from test_moe import _one_thread


@pytest.fixture(autouse=True)
def one_thread():
    with _one_thread():  # as every worker rank: default threads ran these runs 15x slower on 2 shared cores (measured)
        yield


def _cfg(tmp_path, **ckpt):
    cfg = tiny_config(corpus(tmp_path / "corpus"), steps=4)
    cfg.checkpoint.save_interval = 2
    for k, v in ckpt.items():
        setattr(cfg.checkpoint, k, v)
    return cfg


def test_async_save_overlaps_the_next_steps_and_equals_sync(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    data_dir = prepare(cfg, tmp_path)
    (tmp_path / "sync").mkdir()
    sync = train(cfg, one_process_context(tmp_path / "sync"), data_dir, progress=False)
    step3 = threading.Event()
    seen = []
    real_at_step, real_save = heartbeat.at_step, io._save

    def at_step(step):
        if step == 3:
            step3.set()
        real_at_step(step)

    def slow_save(tensors, path):  # step 2's files wait until the loop has started step 3
        if "step_00000002" in str(path):
            seen.append(step3.wait(timeout=60))
        real_save(tensors, path)
    monkeypatch.setattr(heartbeat, "at_step", at_step)
    monkeypatch.setattr(io, "_save", slow_save)
    cfg.checkpoint.async_save = True
    (tmp_path / "async").mkdir()
    result = train(cfg, one_process_context(tmp_path / "async"), data_dir, progress=False)
    assert seen and all(seen)  # the loop ran step 3 while step 2's files were being written
    assert result.losses == sync.losses
    assert result.checkpoint == tmp_path / "async" / "checkpoints" / "step_00000004"
    for step in ("step_00000002", "step_00000004"):
        for f in sorted((tmp_path / "sync" / "checkpoints" / step).glob("*.safetensors")):
            if not f.name.startswith("rng"):
                assert (tmp_path / "async" / "checkpoints" / step / f.name).read_bytes() == f.read_bytes()


KILLED_RUN = """
import os, signal, sys
import torch
torch.set_num_threads(1)
from pathlib import Path
from safetensors.torch import save
from fivefold.checkpoint import io
from fivefold.train.context import RankContext
from fivefold.train.loop import train
from fivefold.train.worker import config_from_dict
import json

def half_then_die(tensors, path):
    if "step_00000004" in str(path) and path.name.startswith("model"):
        data = save({k: v.contiguous() for k, v in tensors.items()})
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)  # the writer thread kills the run mid-file
    real(tensors, path)

real = io._save
io._save = half_then_die
spec = json.loads(Path(sys.argv[1]).read_text())
train(config_from_dict(spec["config"]), RankContext.single(Path(spec["out"])), Path(spec["data"]), progress=False)
"""


def test_kill_mid_file_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path):
    cfg = _cfg(tmp_path, async_save=True)
    data_dir = prepare(cfg, tmp_path)
    (tmp_path / "killed").mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"config": to_dict(cfg), "out": str(tmp_path / "killed"), "data": str(data_dir)}))
    run = subprocess.run([sys.executable, "-c", KILLED_RUN, str(spec)], capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    root = tmp_path / "killed" / "checkpoints"
    partial = root / ".tmp-step_00000004" / "model-00000.safetensors"
    assert partial.is_file() and partial.stat().st_size > 0  # killed mid-file
    assert (root / "latest").read_text() == "step_00000002" and resolve(root) == root / "step_00000002"
    cfg.checkpoint.async_save = False
    cfg.checkpoint.load = str(root)
    (tmp_path / "resumed").mkdir()
    resumed = train(cfg, one_process_context(tmp_path / "resumed"), data_dir, progress=False)
    cfg.checkpoint.load = None
    (tmp_path / "full").mkdir()
    full = train(cfg, one_process_context(tmp_path / "full"), data_dir, progress=False)
    assert resumed.losses == {s: full.losses[s] for s in (2, 3)}  # bit-exact: same layout
