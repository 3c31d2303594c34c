"""Pure parts of training: LR schedule, the supported-knobs refusal, FLOPs formula, clipping, bf16."""
from __future__ import annotations

import json
import math

import pytest
import torch

from _tol import close
from _train_util import corpus, megatron_scheduler, one_process_context, tiny_config
from fivefold.cli.train import prepare
from fivefold.config.schema import Config, ModelConfig, TrainingConfig
from fivefold.errors import NotImplementedYet
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout
from fivefold.train.loop import train
from fivefold.train.metrics import flops_per_token, matmul_params
from fivefold.parallel.optimizer import clip_grad_norm
from fivefold.train.schedule import lr_at
from fivefold.config.supported import check_supported, unsupported


def test_warmup_then_cosine_to_min_lr():
    t = TrainingConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=4, train_iters=14)
    assert [lr_at(s, t) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]  # Megatron's: step 0 at lr_warmup_init
    # Python floats (no torch kernel): the same formula up to the order of the float64 operations
    close(lr_at(9, t), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rtol=1e-12, site="lr_schedule.cosine")
    assert lr_at(14, t) == 0.1  # the end of the decay is min_lr itself
    t.lr_decay_style = "constant"
    assert lr_at(13, t) == 1.0


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [
    {"lr_warmup_fraction": 0.01},  # 0.1 of a step: the first step ran at 10x lr when the warm-up counted (x + 1) / W
    {"lr_warmup_fraction": 0.0}, {"lr_warmup_iters": 0}, {"lr_warmup_iters": 1}, {"lr_warmup_iters": 3},
    {"lr_warmup_fraction": 0.35, "lr_warmup_init": 1e-4},
    {"train_samples": 80, "lr_warmup_samples": 3}, {"train_samples": 80, "lr_warmup_fraction": 0.05},
    {"train_samples": 80, "lr_warmup_samples": 0, "lr_decay_samples": 60}])
def test_learning_rate_is_megatrons_scheduler_at_every_step(warmup, style):
    """Every step's learning rate is megatron-core's OptimizerParamScheduler's, which counts samples (an
    iteration is global_batch_size of them) and is stepped after each optimizer step: step s runs at the
    rate for the units consumed before it. Fractional, zero and tiny warm-ups included: the first step runs
    at lr_warmup_init and no step exceeds lr."""
    batch = 8
    t = TrainingConfig(lr=1e-3, min_lr=1e-5, lr_decay_style=style, global_batch_size=batch,
                       **({"train_iters": 10} if "train_samples" not in warmup else {}), **warmup)
    samples = t.train_samples is not None
    decay = (t.lr_decay_samples or t.train_samples) if samples else (t.lr_decay_iters or t.train_iters) * batch
    w = (t.lr_warmup_fraction * decay if t.lr_warmup_fraction is not None
         else (t.lr_warmup_samples if samples else t.lr_warmup_iters * batch))
    sched = megatron_scheduler(t.lr, t.min_lr, t.lr_warmup_init, w, decay, style)
    steps = t.train_samples // batch if samples else t.train_iters
    for s in range(steps + 2):
        sched.num_steps = s * batch
        # the same float64 formula, in iterations here and samples there: x / W and (x - W) / (D - W) are the
        # same ratios (a batch of 8 scales both by a power of two, exactly), and IEEE float64 rounds them alike
        # on every x86-64 CPU: bit-equal (measured over every case here)
        assert lr_at(s, t) == sched.get_lr({}), (warmup, style, s)
        assert lr_at(s, t) <= t.lr
    if w > 0:
        assert lr_at(0, t) == t.lr_warmup_init


def test_unsupported_knobs_are_refused_together():
    cfg = Config()
    check_supported(cfg)  # the defaults run
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel = 2, True  # TP and SP run
    check_supported(cfg)
    cfg.parallel.pipeline_model_parallel_size = 2  # PP runs, and together with TP and SP
    check_supported(cfg)
    cfg.parallel.context_parallel_size = 2  # CP runs, with all of them
    check_supported(cfg)
    cfg.model.multi_latent_attention, cfg.model.normalization = True, "LayerNorm"  # MLA and LayerNorm run
    check_supported(cfg.__class__(model=cfg.model))
    cfg.training.recompute_granularity, cfg.training.recompute_modules = "selective", ["core_attn"]
    check_supported(cfg)  # Megatron's default module: the selective recompute the runtime runs
    cfg.training.precision, cfg.training.optimizer = "fp8", "sgd"
    cfg.training.recompute_modules = ["core_attn", "moe"]  # the planner models it; the runtime does not run it
    assert len(unsupported(cfg)) == 3
    with pytest.raises(NotImplementedYet, match=r"runtime trains fp32, bf16, fp16.*adamw.*modules other than "
                                                r"core_attn.*not implemented yet"):
        check_supported(cfg)


def test_flops_formula_by_hand():
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256)
    per_layer = 4 * 64 * 64 + 3 * 64 * 128  # q, k, v, o + SwiGLU gate, up, down
    assert matmul_params(m) == 2 * per_layer + 256 * 64
    assert flops_per_token(m, 32) == 6 * matmul_params(m) + 6 * 2 * 4 * 16 * 32  # causal: s/2 keys on average
    moe = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                      num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=32)
    expert_layer = 4 * 64 * 64 + 64 * 8 + 2 * 3 * 64 * 32  # attention, router, the top-2 experts
    assert flops_per_token(moe, 32) == 6 * (2 * expert_layer + 256 * 64) + 6 * 2 * 4 * 16 * 32


def test_clip_by_global_norm():
    p = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    p[0].grad, p[1].grad = torch.tensor([3.0, 0, 0]), torch.tensor([0, 4.0, 0, 0])
    assert clip_grad_norm(p, 1.0, Mesh.build(Layout()).group("model-parallel")) == 5.0  # sqrt(9 + 16): exact in fp32
    # scaled by 1 / (5 + 1e-6): 1 - 2e-7 by design (measured 1.8e-7 relative); bound 2e-6, 11x
    close(float(torch.cat([q.grad for q in p]).norm()), 1.0, rtol=2e-6, site="clip.clipped_norm")


def test_bf16_trains(tmp_path):
    cfg = tiny_config(corpus(tmp_path / "c"), steps=6, precision="bf16")
    out = tmp_path / "o"
    out.mkdir()
    losses = list(train(cfg, one_process_context(out), prepare(cfg, out), progress=False).losses.values())
    assert losses[-1] < 0.9 * losses[0]


def test_log_interval_writes_every_nth_step_the_last_and_eval_steps(tmp_path):
    """logging.log_interval (Megatron --log-interval): a metrics line (and the all-rank peak-memory
    gather it carries) every N steps, plus the last step and every evaluation step."""
    cfg = tiny_config(corpus(tmp_path / "c"), steps=7, eval_interval=5)
    cfg.logging.log_interval = 3
    out = tmp_path / "o"
    out.mkdir()
    result = train(cfg, one_process_context(out), prepare(cfg, out), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 5, 6]  # steps 3 and 6 (1-based), eval at 5, last at 7
    assert [r["step"] for r in rows if "eval_loss" in r] == [4, 6]
    assert all(len(r["peak_memory_mib"]) == 1 for r in rows)
    assert sorted(result.losses) == list(range(7))  # every step is still trained and returned
    assert len(result.peak_memory) == 1 and result.peak_memory[0] > 0


@pytest.mark.parametrize("style", ["cosine", "linear"])
@pytest.mark.parametrize("samples", [False, True])
def test_decay_equals_megatrons_scheduler(style, samples):
    """After the warm-up, the LR of every step is megatron-core's OptimizerParamScheduler's (iterations,
    or samples: --train-samples / --lr-decay-samples / --lr-warmup-samples / --lr-warmup-fraction)."""
    import types
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from fivefold.config.load import load_config

    if samples:
        words = ["--train-samples", "960", "--lr-decay-samples", "800", "--lr-warmup-fraction", "0.1",
                 "--global-batch-size", "16", "--micro-batch-size", "2"]
    else:
        words = ["--train-iters", "60", "--lr-decay-iters", "50", "--lr-warmup-iters", "5"]
    from fivefold.config.validate import validate

    cfg = load_config(None, words + ["--lr", "1.0", "--min-lr", "0.1", "--lr-decay-style", style]).config
    validate(cfg)
    t = cfg.training
    unit = t.global_batch_size if samples else 1
    decay = t.lr_decay_samples if samples else t.lr_decay_iters
    warmup = int(t.lr_warmup_fraction * decay) if samples else t.lr_warmup_iters
    assert t.train_iters == 60  # with samples: 960 // 16 per step
    sched = OptimizerParamScheduler(types.SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=1.0, min_lr=0.1,
                                    lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=style,
                                    start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant")
    for s in range(t.train_iters):
        sched.num_steps = s * unit
        if s * unit >= warmup:  # Python floats: the same formula, another operation order
            close(lr_at(s, t), sched.get_lr({}), rtol=1e-12, site="lr_schedule.megatron", case=f"{style} {s}")


def test_warmup_starts_from_lr_warmup_init():
    """Megatron's --lr-warmup-init: the warm-up rises from it, step s at s / W of the way."""
    from fivefold.config.schema import TrainingConfig

    t = TrainingConfig(lr=1.0, lr_warmup_init=0.1, lr_warmup_iters=5, train_iters=20)
    assert [round(lr_at(s, t), 12) for s in range(6)] == [0.1, 0.28, 0.46, 0.64, 0.82, 1.0]
