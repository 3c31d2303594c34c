"""scripts/trace_launches.py on a small made-up profiler trace: the last step's launches, syncs,
optimizer time, and the launches between attention calls (a backward's few attention kernels in a row
count as one call)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "trace_launches.py"


def _trace(path: Path) -> None:
    events, ts, corr = [], 0.0, 0

    def launch(kernel: str) -> None:
        nonlocal ts, corr
        ts, corr = ts + 1, corr + 1
        events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 0.5,
                       "args": {"correlation": corr}})
        events.append({"cat": "kernel", "name": kernel, "ts": ts + 0.2, "dur": 0.1, "args": {"correlation": corr}})

    events.append({"cat": "user_annotation", "name": "train_step 0", "ts": -100.0, "dur": 50.0})  # an earlier step (times in us)
    events.append({"cat": "user_annotation", "name": "train_step 1", "ts": 0.0, "dur": 1000.0})
    for _ in range(3):
        launch("gemm")
    for layer in range(2):  # forward: attention, then 4 (layer 0) or 6 other kernels
        launch("cudnn_sdpa_flash_fprop")
        for _ in range(4 + 2 * layer):
            launch("elementwise")
    for _ in range(2):  # backward: three attention kernels in a row, then 5 others
        for name in ("sdpa_dot_do_o", "sdpa_flash_bprop", "sdpa_convert"):
            launch(name)
        for _ in range(5):
            launch("elementwise")
    events.append({"cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "ts": ts + 1, "dur": 200.0})
    events.append({"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": ts + 2, "dur": 1.0, "args": {}})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_launches_by_layer(tmp_path):
    _trace(tmp_path / "t.json.gz")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "t.json.gz")], capture_output=True, text=True,
                         check=True).stdout
    assert "train_step 1: 1.0 ms, optimizer 0.2 ms; 31 kernel launches, 1 stream syncs" in out, out
    assert "first attention call: 3;" in out and ": F5 F7 B8 B8\n" in out, out
    assert " 20  elementwise" in out, out


def test_not_a_trace_is_refused_with_the_fix(tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "x.json")], capture_output=True, text=True)
    assert r.returncode == 1 and "is not a profiler trace" in r.stderr and "--profile" in r.stderr and \
        "Traceback" not in r.stderr, r.stderr
