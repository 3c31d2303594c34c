"""One rank of a `train` or `rl` job, as the launcher (fivefold.launch) starts it:
`python -m fivefold.cli.rank OUT/run.json`. The spec names the job; the rank runs it with
fivefold.train.worker.run_rank (the training loop, or the RL job's function).

Its first act, before it imports torch, is fivefold.runtime.startup.begin: the launcher's watchdog
then sees a rank that is still starting (not a hang, up to the start-up bound) and can have its stack."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    from fivefold.runtime import startup

    startup.begin(Path(spec["out"]) / "logs", int(os.environ.get("RANK", 0)))
    from fivefold.config.schema import config_from_dict
    from fivefold.train.worker import run_rank

    job = None
    if spec.get("job") == "rl":
        from fivefold.rl.cli_job import grpo_job

        job = grpo_job(spec["grpo"], Path(spec["out"]))
    return run_rank(config_from_dict(spec["config"]), Path(spec["out"]), Path(spec["data_dir"]), job)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
