"""`fivefold train examples/pp.yaml --trace-schedule` end to end: PP=2 x DP=2 on 4 launched ranks."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_pp_example_trains_and_traces(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fivefold", "train", "examples/pp.yaml", "--out", str(out),
                        "--trace-schedule", "training.train_iters=4", "training.eval_interval=4",
                        "--pipeline-schedule", "zb-h1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and rows[-1]["loss"] < rows[0]["loss"]
    assert "eval_loss" in rows[-1]
    trace = (out / "schedule_trace.txt").read_text()
    assert "measured schedule zb-h1" in trace and "bubble" in trace
    assert (out / "schedule_trace.png").stat().st_size > 0
