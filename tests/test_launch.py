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
