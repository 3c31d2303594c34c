"""The launcher: a rank killed mid-run ends the job quickly, names the rank, leaves no process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _train_util import corpus, tiny_config, write_spec
from fivefold.cli.train import prepare

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_killed_rank_ends_the_job_naming_it(tmp_path):
    cfg = tiny_config(corpus(tmp_path / "corpus"), world=2, steps=100000)
    out = tmp_path / "out"
    spec = write_spec(cfg, out, prepare(cfg, out))
    code = f"import sys; from fivefold.launch import launch; sys.exit(launch(2, [{str(spec)!r}], __import__('pathlib').Path({str(out / 'logs')!r})))"
    job = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.1)
    pids = json.loads((out / "logs" / "ranks.json").read_text())["pids"]
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    _, err = job.communicate(timeout=30)
    assert time.monotonic() - killed_at < 30
    assert job.returncode != 0
    assert "rank 1 was killed by SIGKILL" in err
    assert not any(_alive(p) for p in pids)


def test_ctrl_c_is_the_launchers_from_the_ranks_start_to_their_training(tmp_path):
    """A terminal's Ctrl-C reaches every process of its group: a rank still importing torch printed its
    KeyboardInterrupt traceback before the launcher's "interrupted". The ranks now ignore SIGINT (sent
    here to them alone while they start: they start and train) and the launcher stops them: Ctrl-C to
    the whole group mid-training ends the job at once with its one line, no traceback, no rank left."""
    out = tmp_path / "out"
    words = ["model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2", "training.seq_length=16",
             "training.global_batch_size=2", "training.micro_batch_size=1", "training.train_iters=100000",
             f"data.path={corpus(tmp_path / 'corpus')}"]
    job = subprocess.Popen([sys.executable, "-m", "fivefold", "train", *words, "--out", str(out), "--nproc", "2"],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # its own process group, as a terminal's job
    try:
        ranks, deadline = out / "logs" / "ranks.json", time.monotonic() + 60
        while not ranks.exists():
            assert job.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.01)
        pids = json.loads(ranks.read_text())["pids"]
        for pid in pids:  # while they import torch
            os.kill(pid, signal.SIGINT)
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert job.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.1)
        pressed = time.monotonic()
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert time.monotonic() - pressed < 30
    assert job.returncode == 130 and err.endswith("interrupted\n"), err  # (after rank 0's progress bar)
    assert "Traceback" not in err + (out / "logs" / "rank-1.log").read_text()
    assert not any(_alive(p) for p in pids)
