"""One rank of a `train` or `rl` job, as the launcher (fivefold.launch) starts it:
`python -m fivefold.cli.rank OUT/run.json`. The spec names the job; the rank runs it with
fivefold.train.worker.run_rank (the training loop, or the RL job's function)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fivefold.config.schema import config_from_dict
from fivefold.train.worker import run_rank


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    job = None
    if spec.get("job") == "rl":
        from fivefold.rl.cli_job import grpo_job

        job = grpo_job(spec["grpo"], Path(spec["out"]))
    return run_rank(config_from_dict(spec["config"]), Path(spec["out"]), Path(spec["data_dir"]), job)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
