"""Asynchronous checkpoint saves (--async-save): the same checkpoints as synchronous saves, training
goes on while the writer runs, and a job killed while its writer is mid-file keeps the previous
checkpoint as `latest`, loadable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _train_util import corpus, one_process_context, tiny_config
from fivefold.checkpoint.io import load_checkpoint, read_metadata
from fivefold.cli.train import prepare
from fivefold.config.load import load_config
from fivefold.config.schema import to_dict
from fivefold.model.decoder import Decoder
from fivefold.train.loop import train

ROOT = Path(__file__).resolve().parent.parent


def _config(tmp_path, **checkpoint):
    cfg = tiny_config(corpus(tmp_path / "corpus"), steps=4)
    cfg.checkpoint.save_interval = 1
    for k, v in checkpoint.items():
        setattr(cfg.checkpoint, k, v)
    return cfg


def test_async_checkpoints_equal_sync_ones(tmp_path):
    assert load_config(None, ["--async-save"]).config.checkpoint.async_save  # Megatron's flag
    runs = {}
    for name, async_save in (("sync", False), ("async", True)):
        cfg = _config(tmp_path, async_save=async_save)
        data_dir = prepare(cfg, tmp_path)
        (tmp_path / name).mkdir()
        runs[name] = train(cfg, one_process_context(tmp_path / name), data_dir, progress=False)
    assert runs["async"].losses == runs["sync"].losses
    for step in (3, 4):  # the two kept; each committed with its metadata
        a, s = (tmp_path / n / "checkpoints" / f"step_{step:08d}" for n in ("async", "sync"))
        for file in ("model-00000.safetensors", "optim-00000.safetensors"):
            got, want = load_file(str(a / file)), load_file(str(s / file))
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert read_metadata(a)[1]["params"] == read_metadata(s)[1]["params"]
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text() == "step_00000004"


_KILLED_RUN = r"""
import json, sys, time
from pathlib import Path
from safetensors.torch import save
import fivefold.checkpoint.async_save as async_save
from fivefold.config.schema import config_from_dict
from fivefold.train.context import RankContext
from fivefold.train.loop import train

spec = json.loads(sys.argv[1])
real = async_save._save
def stuck_mid_file(tensors, path):  # the writer of checkpoint 2 dies half way through its model file
    if path.parent.name == ".tmp-step_00000002" and path.name.startswith("model-"):
        data = save({k: v.contiguous() for k, v in tensors.items()})
        path.write_bytes(data[: len(data) // 2])
        Path(spec["marker"]).touch()
        time.sleep(600)
    real(tensors, path)
async_save._save = stuck_mid_file
train(config_from_dict(spec["config"]), RankContext.single(Path(spec["out"])), Path(spec["data"]), progress=False)
"""


def test_a_kill_while_the_writer_is_mid_file_leaves_the_previous_checkpoint(tmp_path):
    cfg = _config(tmp_path, async_save=True)
    data_dir = prepare(cfg, tmp_path)
    out, marker = tmp_path / "run", tmp_path / "writer-stuck"
    out.mkdir()
    spec = {"config": to_dict(cfg), "out": str(out), "data": str(data_dir), "marker": str(marker)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, json.dumps(spec)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "no writer started"
    # training goes on while the writer is stuck: step 3 (index 2) runs and is logged, then its save
    # waits for the writer
    while len((out / "metrics.jsonl").read_text().splitlines()) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step_00000001"
    assert (root / ".tmp-step_00000002").is_dir() and not (root / "step_00000002").exists()
    model = Decoder(cfg.model)
    meta = load_checkpoint(root, model=model, optimizer=None, rank=0, world_size=1)
    assert meta["step"] == 1


def test_a_writer_that_fails_on_one_rank_stops_every_rank_before_the_commit(tmp_path):
    """Every rank agrees before committing: a failed writer anywhere means no rank commits."""
    from fivefold.checkpoint.async_save import AsyncSaver
    from fivefold.errors import UserError

    agreed = iter([True, False])  # staging went well everywhere; then another rank's writer failed
    saver = AsyncSaver(0, lambda: None, all_ok=lambda ok: next(agreed))
    model = Decoder(tiny_config(tmp_path).model)
    saver.save(tmp_path / "ckpt", 1, model=model, optimizer=torch.optim.AdamW(model.parameters()),
               writes_params=True, extra={})
    with pytest.raises(UserError, match="another rank's writer failed"):
        saver.finish()
    assert not (tmp_path / "ckpt" / "latest").exists() and not (tmp_path / "ckpt" / "step_00000001").exists()
