"""Megatron's --step-batch-size-schedule: which batch each step runs, the samples it reads, the
learning rate (megatron-core's scheduler advanced by each step's batch), and its refusals."""
from __future__ import annotations


import pytest

from _tol import close
from _train_util import megatron_scheduler
from fivefold.config.load import load_config
from fivefold.config.validate import ConfigError, validate
from fivefold.errors import UserError
from fivefold.config.batch_sizes import BatchSizes, parse_schedule
from fivefold.train.schedule import lr_at

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--lr", "1.0", "--min-lr", "0.1", "--lr-decay-style", "cosine"]


def _megatron_batch(schedule: list[tuple[int, int]], consumed: int) -> int:
    """Megatron's StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples, restated."""
    return max((t, b) for t, b in schedule if consumed >= t)[1]


def test_thresholds_are_tokens_and_steps_follow_the_consumed_samples():
    """"0:16 2.4K:32" with 64-token samples: 2400 tokens = 37 samples; steps 0-2 take 16 (48 consumed
    reaches 37), the rest 32 — the batch changes at the first step whose consumed samples reach it."""
    assert parse_schedule("0:16 2.4K:32, 10k:48", 64) == [(0, 16), (37, 32), (156, 48)]
    sizes = BatchSizes(tuple(parse_schedule("0:16 2.4K:32 10K:48", 64)), 12)
    consumed = 0
    for s in range(12):
        assert (sizes.start(s), sizes.size(s)) == (consumed, _megatron_batch(list(sizes.entries), consumed))
        consumed += sizes.size(s)
    assert [sizes.size(s) for s in range(7)] == [16, 16, 16, 32, 32, 32, 32] and sizes.size(7) == 48
    assert sizes.steps_for_samples(100) == 5  # Megatron: steps until >= 100 samples (16+16+16+32+32)


@pytest.mark.parametrize("text, says", [("16", "not THRESHOLD:BATCH"), ("1K:16", "first entry's threshold must be 0"),
                                        ("0:16 0:32", "increase strictly"), ("0:x", "not a number"),
                                        ("0:0", ">= 1")])
def test_bad_schedules_are_refused_naming_the_problem(text, says):
    with pytest.raises(UserError, match=says):
        parse_schedule(text, 64)


def test_with_a_global_batch_too_it_is_refused_as_megatron_does():
    with pytest.raises(UserError, match="drop --global-batch-size"):
        load_config(None, BASE + ["--step-batch-size-schedule", "0:8 1K:16", "--global-batch-size", "16"])


def test_every_batch_must_split_into_microbatches_of_every_dp_rank():
    cfg = load_config(None, BASE + ["--step-batch-size-schedule", "0:8 1K:12"], world_size=4).config
    with pytest.raises(ConfigError, match="its batch 12"):
        validate(cfg)


def test_learning_rate_is_megatrons_scheduler_stepped_by_each_batch():
    """Megatron's scheduler counts samples: each step adds its batch; an iteration span is that many
    global batches of micro batch x DP (Megatron's default global batch: the schedule replaces it)."""
    cfg = load_config(None, BASE + ["--step-batch-size-schedule", "0:8 1K:16", "--train-iters", "40",
                                    "--lr-decay-iters", "60", "--lr-warmup-iters", "2"], world_size=4).config
    validate(cfg)
    t = cfg.training
    assert t.global_batch_size == 8  # micro batch 2 x DP 4
    sizes = BatchSizes.of(t)
    sched = megatron_scheduler(1.0, 0.1, 0.0, 2 * 8, 60 * 8, "cosine")
    assert {sizes.size(s) for s in range(40)} == {8, 16}
    for s in range(40):
        sched.num_steps = sizes.start(s)  # the warm-up included
        close(lr_at(s, t), sched.get_lr({}), rtol=1e-12, site="lr_schedule.megatron", case=f"step-schedule {s}")
