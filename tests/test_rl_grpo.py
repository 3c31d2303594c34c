"""`fivefold rl`: the GRPO loop runs end to end on 4 ranks (actor TP2 x DP2, rollout and reference whole
on every rank) for 2 steps after a short warm-up, writes its metrics and plot, and the rollout copy
is the actor's model (train/rollout log-prob mismatch at fp32 noise). The demo's learning curve
(reward before and after, several seeds) is measured outside the suite: docs/rl.md."""
from __future__ import annotations

import json

import yaml

from fivefold.cli import main


def test_grpo_runs_on_four_ranks_with_the_rollout_in_another_layout(tmp_path):
    cfg = yaml.safe_load(open("examples/grpo.yaml"))
    cfg["cluster"]["world_size"] = 4
    cfg["grpo"].update(steps=2, warmup_steps=3, prompts_per_step=4, group_size=4, warmup_batch=8)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["rl", str(tmp_path / "grpo.yaml"), "--out", str(tmp_path / "out")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and (tmp_path / "out" / "rl.png").stat().st_size > 0
    for r in rows:
        assert 0 <= r["reward"] <= 1 and r["kl"] >= 0 and r["entropy"] > 0
        assert r["logprob_mismatch"] < 1e-5  # the same weights in TP2 and TP1: summation order only
        assert r["sync_bytes"] > 0


def test_unknown_grpo_keys_are_refused_before_any_rank_starts(tmp_path, capsys):
    cfg = yaml.safe_load(open("examples/grpo.yaml"))
    cfg["grpo"]["group_sise"] = 4
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["rl", str(tmp_path / "grpo.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "group_sise" in capsys.readouterr().err
