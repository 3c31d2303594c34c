"""`fivefold rl`: the GRPO loop runs end to end on 4 ranks (actor TP2 x DP2 and its frozen reference
in the same layout, the rollout copy whole on every rank) for 2 steps after a short warm-up, writes its
metrics and plot, and the rollout copy is the actor's model (train/rollout log-prob mismatch at fp32
noise); other actor layouts take the same steps. The demo's learning curve
(reward before and after, several seeds) is measured outside the suite: docs/rl.md."""
from __future__ import annotations

import json

import pytest
import yaml

from fivefold.cli import main

TOLERANCE = 1e-4
"""Relative (absolute below 1e-3) difference of a GRPO step's loss, KL, entropy and gradient norm
between actor layouts: measured worst 4.0e-6 over the two layouts and two steps of
`test_grpo_steps_are_the_same_in_every_actor_layout`; the bound leaves 25x for other SIMD
widths' fp32 sums through a warm-up and one RL step."""


def _grpo_rows(tmp_path, words: list[str]) -> list[dict]:
    """2 GRPO steps after 20 warm-up steps (enough for a non-zero reward) on 4 ranks of examples/grpo.yaml's model, the actor's layout
    given by `words`; the rows of metrics.jsonl."""
    cfg = yaml.safe_load(open("examples/grpo.yaml"))
    cfg["cluster"]["world_size"] = 4
    cfg["training"]["micro_batch_size"] = 4  # 2 micro-batches a step in TP2 x DP2, 4 in the PP2 layouts
    cfg["grpo"].update(steps=2, warmup_steps=20, prompts_per_step=4, group_size=4, warmup_batch=8)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["rl", str(tmp_path / "grpo.yaml"), "--out", str(tmp_path / "out"), *words]) == 0
    assert (tmp_path / "out" / "rl.png").stat().st_size > 0
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tp2_dp2(tmp_path_factory):
    return _grpo_rows(tmp_path_factory.mktemp("tp2_dp2"), [])


def test_grpo_runs_on_four_ranks_with_the_rollout_in_another_layout(tp2_dp2):
    rows = tp2_dp2
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["reward"] > 0 and rows[0]["grad_norm"] > 0  # a step with advantages to learn from
    for r in rows:
        assert 0 <= r["reward"] <= 1 and r["kl"] >= 0 and r["entropy"] > 0
        assert r["logprob_mismatch"] < 1e-5  # the same weights in TP2 and TP1: summation order only
        assert r["sync_bytes"] > 0


@pytest.mark.parametrize("words", [["tp=2", "sp=true", "pp=2"], ["tp=1", "cp=2", "pp=2"]])
def test_grpo_steps_are_the_same_in_every_actor_layout(words, tp2_dp2, tmp_path):
    """The actor (and its frozen reference) as TP2+SP x PP2 or CP2 x PP2 on the same 4 ranks takes the
    same steps as TP2 x DP2: the rollouts are the same (each rank samples its own prompts from its whole
    rollout copy), so the rewards are equal and the loss, KL, entropy and train/rollout mismatch agree
    to fp32 summation order. Before, SP crashed on a 7-token batch (not split over 2 TP ranks), PP
    crashed on its non-last stage's missing statistics, and CP trained each CP rank's halves of
    different sequences (the ranks of a replica held different rollouts; mismatch 0.26)."""
    rows = _grpo_rows(tmp_path, words)
    worst = 0.0
    for mine, ref in zip(rows, tp2_dp2, strict=True):
        assert mine["reward"] == ref["reward"] and mine["exact"] == ref["exact"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            worst = max(worst, abs(mine[key] - ref[key]) / max(abs(ref[key]), 1e-3))
        assert mine["logprob_mismatch"] < 1e-5  # as in TP2 x DP2
    print(f"worst relative difference from TP2 x DP2 over loss, KL, entropy, grad norm: {worst:.2e}")
    assert worst < TOLERANCE


def test_grpo_without_a_warm_up_runs_and_says_so(tmp_path, capfd):
    cfg = yaml.safe_load(open("examples/grpo.yaml"))
    cfg["cluster"]["world_size"] = 1
    cfg["parallel"]["tensor_model_parallel_size"] = 1
    cfg["grpo"].update(steps=1, warmup_steps=0, prompts_per_step=2, group_size=2)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["rl", str(tmp_path / "grpo.yaml"), "--out", str(tmp_path / "out")]) == 0
    out = capfd.readouterr().out  # (rank 0 writes to the terminal)
    assert "warm-up loss: none (grpo.warmup_steps=0)" in out and "(actor DP=1 TP=1 PP=1 CP=1 EP=1," in out


def test_unknown_grpo_keys_are_refused_before_any_rank_starts(tmp_path, capsys):
    cfg = yaml.safe_load(open("examples/grpo.yaml"))
    cfg["grpo"]["group_sise"] = 4
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["rl", str(tmp_path / "grpo.yaml"), "--out", str(tmp_path / "out")]) == 2
    assert "group_sise" in capsys.readouterr().err


def test_a_broken_rl_config_file_is_refused_with_a_message(tmp_path, capsys):
    """Invalid YAML or a file that is not UTF-8 ended `fivefold rl` in a traceback (it parsed the file
    itself); it now reads it as every config is read (`load.parse_yaml`). And the grpo: section given to
    another command names the command that reads it."""
    (tmp_path / "flow.yaml").write_text("grpo: {digits: 1\n  bad: [\n")
    (tmp_path / "bytes.yaml").write_bytes(b"\xff\xfegrpo:\n")
    for name, said in (("flow.yaml", "not valid YAML"), ("bytes.yaml", "not UTF-8")):
        assert main(["rl", str(tmp_path / name), "--out", str(tmp_path / "out")]) == 2
        assert said in capsys.readouterr().err and not (tmp_path / "out").exists()
    assert main(["validate", "examples/grpo.yaml"]) == 2
    assert "read by `fivefold rl`" in capsys.readouterr().err


def test_grpo_values_are_checked_before_the_ranks_start(tmp_path, capsys):
    """`grpo.digits: -1` was a numpy traceback on every rank, and a prompt count the ranks do not
    divide or a task longer than the sequence stopped the ranks; each is now named at once, with
    `grpo.KEY=VALUE` words overriding the section as `fivefold train` takes its overrides (they
    were refused as unrecognized)."""
    out = tmp_path / "out"
    assert main(["rl", "examples/grpo.yaml", "--out", str(out), "grpo.group_size=1", "grpo.digits=6",
                 "grpo.prompts_per_step=30", "grpo.warmup_batch=3", "grpo.seed=-1"]) == 2
    err = capsys.readouterr().err
    for said in ("grpo.prompts_per_step=30: must be a multiple of the 8 ranks", "grpo.group_size=1: must be >= 2",
                 "grpo.warmup_batch=3: must be a multiple of the 4 actor data-parallel replicas",
                 "grpo.seed=-1: must be >= 0", "training.seq_length=16: the task of 6-digit sums needs 22 tokens"):
        assert said in err, said
    assert not out.exists()  # no rank started, no folder made for a run that cannot start
    assert main(["rl", "examples/grpo.yaml", "--out", str(out), "grpo.lr=fast"]) == 2
    assert "grpo.lr='fast': must be a number" in capsys.readouterr().err
    assert main(["rl", "examples/grpo.yaml", "--out", str(out), "grpo.digits=3", "training.seq_length=12"]) == 2
    assert "training.seq_length=12: the task of 3-digit sums needs 13 tokens" in capsys.readouterr().err  # both read


def test_a_step_that_cannot_fit_in_memory_is_refused_before_the_ranks_start(tmp_path, monkeypatch, capsys):
    """grpo.prompts_per_step=10**8 started the ranks, which were killed for memory (SIGKILL) in the first
    step: refused before any rank starts, with a prompt count whose step estimate takes at most half of
    the machine's memory; the shipped example starts."""
    import re

    from fivefold.cli import rl
    from fivefold.config.load import load_config
    from fivefold.rl.grpo import GRPOConfig

    started = []
    monkeypatch.setattr("fivefold.launch.launch", lambda *a, **kw: started.append(a) or 0)
    monkeypatch.setattr(rl, "available_memory", lambda: 16 * 2**30)
    out = tmp_path / "out"
    assert main(["rl", "examples/grpo.yaml", "--out", str(out), "grpo.prompts_per_step=100000000"]) == 2
    err = capsys.readouterr().err
    assert "grpo.prompts_per_step=100000000 x grpo.group_size=8: the 800000000 answers of a step need at least" in err
    assert "more than the 16.0 GiB available on this machine; try grpo.prompts_per_step=" in err
    assert not out.exists() and not started
    suggested = int(re.search(r"try grpo.prompts_per_step=(\d+)", err).group(1))
    raw = yaml.safe_load(open("examples/grpo.yaml"))
    g = GRPOConfig.of({**raw.pop("grpo"), "prompts_per_step": suggested})
    (tmp_path / "actor.yaml").write_text(yaml.safe_dump(raw))
    actor = load_config(str(tmp_path / "actor.yaml")).config
    assert suggested % 8 == 0 and 8 * 2**30 * 0.99 < g.step_bytes(actor, 8) <= 8 * 2**30  # half of the 16 GiB
    assert main(["rl", "examples/grpo.yaml", "--out", str(out)]) == 0 and len(started) == 1


@pytest.mark.parametrize("words, said", [
    (["training.lr=5"], "`fivefold rl` does not read training.lr (GRPO's learning rates are constant: grpo.lr"),
    (["training.train_iters=5"], "does not read training.train_iters (grpo.steps"),
    (["--load", "runs/x/checkpoints"], "checkpoint.load in `fivefold rl`"),
    (["data.path=/nonexistent", "checkpoint.save_interval=1"], "checkpoint.save_interval, data.path in `fivefold rl`"),
    (["--bf16"], "training.precision=bf16 (the rollout copy is fp32) in `fivefold rl`"),
    (["pp=2", "vpp=2", "model.num_layers=4"], "parallel.virtual_pipeline_model_parallel_size=2 in `fivefold rl` (its "
                                               "engine runs a pipeline schedule for any number of micro-batches"),
    (["model.num_moe_experts=4"], "`fivefold rl` of a model with MoE (its rollout copy generates with one dense"),
])
def test_settings_the_rl_job_does_not_read_are_refused(words, said, tmp_path, capsys):
    """The run went ahead as if they were not there (the same warm-up loss as without them; --bf16 was
    a traceback in the weight sync; a MoE model started the ranks, which then refused to generate with
    it; VPP was refused naming a global_batch_size fix that rl then refused): refused before any rank starts, naming the grpo.* key to give or what is not built."""
    out = tmp_path / "out"
    assert main(["rl", "examples/grpo.yaml", "--out", str(out), *words]) == 2
    assert said in capsys.readouterr().err
    assert not out.exists()
