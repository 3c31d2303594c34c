"""Mixed precision as Megatron holds it (fivefold.config.precision): bf16 / fp16 parameters, fp32
main parameters and AdamW state, the gradient dtype, fp16 loss scaling with overflow steps skipped on
every rank, optimizer offload, and checkpoints that resume exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _tol import close
from _train_util import corpus, one_process_context, tiny_config
from fivefold.cli.train import prepare
from fivefold.config.schema import TrainingConfig, to_dict
from fivefold.config.validate import ConfigError, layout_of, validate
from fivefold.parallel.data.main_params import MainParams
from fivefold.config.precision import LossScaler, Precision
from fivefold.runtime.mesh import Mesh
from fivefold.train.context import RankContext
from fivefold.train.loop import build, train
from fivefold.train.step import train_step
from fivefold.config.schema import config_from_dict

STEPS = 4


# --- the policy, the scaler's rule, validation --------------------------------------------------------

@pytest.mark.parametrize("flags,param,grad", [
    ({}, torch.float32, torch.float32),
    ({"precision": "bf16"}, torch.bfloat16, torch.float32),
    ({"precision": "bf16", "grad_reduce_in_bf16": True}, torch.bfloat16, torch.bfloat16),
    ({"precision": "fp16"}, torch.float16, torch.float16),
    ({"precision": "fp16", "accumulate_allreduce_grads_in_fp32": True}, torch.float16, torch.float32),
])
def test_policy(flags, param, grad):
    p = Precision.of(TrainingConfig(**flags))
    assert (p.param_dtype, p.grad_dtype, p.has_main) == (param, grad, param != torch.float32)


def test_bytes_per_parameter_are_megatrons():
    bf16 = Precision.of(TrainingConfig(precision="bf16"))
    assert bf16.bytes_per_param() == 18 and bf16.bytes_per_param(4) == 6 + 12 / 4
    assert Precision.of(TrainingConfig()).bytes_per_param() == 16
    assert Precision.of(TrainingConfig(precision="bf16", grad_reduce_in_bf16=True)).bytes_per_param() == 16


def test_dynamic_loss_scale_follows_megatron():
    s = LossScaler(scale=2.0 ** 10, window=3, hysteresis=2)
    s.update(True)  # first overflow: hysteresis absorbs it
    assert s.scale == 2.0 ** 10
    s.update(True)  # second: halve
    assert s.scale == 2.0 ** 9
    for _ in range(3):  # a window of clean steps: double, hysteresis restored
        s.update(False)
    assert (s.scale, s.hysteresis_tracker, s.skipped) == (2.0 ** 10, 2, 2)
    floor = LossScaler(scale=2.0, min_scale=1.0, hysteresis=1)
    for _ in range(3):
        floor.update(True)
    assert floor.scale == 1.0
    static = LossScaler.of(TrainingConfig(precision="fp16", loss_scale=128.0))
    static.update(True)
    assert static.scale == 128.0 and static.skipped == 1


def test_offload_needs_the_precision_aware_optimizer(tmp_path):
    cfg = tiny_config(tmp_path, optimizer_cpu_offload=True)
    with pytest.raises(ConfigError, match="use_precision_aware_optimizer=True"):
        validate(cfg)
    cfg.training.use_precision_aware_optimizer, cfg.training.optimizer_offload_fraction = True, 1.5
    with pytest.raises(ConfigError, match="optimizer_offload_fraction=1.0"):
        validate(cfg)
    cfg = tiny_config(tmp_path, grad_reduce_in_bf16=True)
    with pytest.raises(ConfigError, match="precision=bf16"):
        validate(cfg)


def test_offload_places_the_first_share_on_the_host():
    tensors = [torch.zeros(n, dtype=torch.bfloat16) for n in (10, 30, 60)]
    mains = MainParams(tensors, Precision("bf16", "bf16", "fp32", offload_fraction=0.4))
    assert mains.offloaded == [True, True, False]  # 40 of 100 elements
    assert all(m.dtype == torch.float32 and m is not t for m, t in zip(mains.mains, tensors))
    fp32 = [torch.zeros(5), torch.zeros(5)]
    kept = MainParams(fp32, Precision("fp32", "fp32", "fp32"))
    assert all(m is t for m, t in zip(kept.mains, fp32))  # fp32, not offloaded: the parameters themselves


# --- training in every precision, across layouts -------------------------------------------------------

def _train_rank(rank: int, world: int, config: dict, out: str, data_dir: str) -> dict:
    cfg = config_from_dict(config)
    Path(out).mkdir(parents=True, exist_ok=True)
    result = train(cfg, RankContext(Mesh.build(layout_of(cfg)), Path(out)), Path(data_dir), progress=False)
    return {"losses": result.losses}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _cfg(data: Path, precision: str, *, world: int = 1, tp: int = 1, pp: int = 1, zero: bool = False, **training):
    cfg = tiny_config(data, world=world, steps=STEPS, mbs=1, clip_grad=0.5, precision=precision,
                      use_distributed_optimizer=zero, **training)
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size = tp, pp
    cfg.checkpoint.save_interval = 2
    return cfg


LAYOUTS = {"dp2-zero1": dict(world=2, zero=True), "tp2": dict(world=2, tp=2), "pp2": dict(world=2, pp=2),
           "tp2-dp2": dict(world=4, tp=2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, workers):
    root = tmp_path_factory.mktemp("precision")
    data = corpus(root / "corpus")
    data_dir = prepare(_cfg(data, "bf16"), root)
    out = {"root": root, "data": data, "data_dir": data_dir}
    for precision, extra in (("bf16", {}), ("fp16", {"initial_loss_scale": 2.0 ** 12})):
        ref = root / f"{precision}-ref"
        ref.mkdir()
        train(_cfg(data, precision, **extra), one_process_context(ref), data_dir, progress=False)
        for name, layout in LAYOUTS.items():
            if precision == "fp16" and name != "dp2-zero1":
                continue
            cfg = _cfg(data, precision, **layout, **extra)
            workers(cfg.cluster.world_size).run(_train_rank, to_dict(cfg), str(root / f"{precision}-{name}"),
                                                str(data_dir))
    return out


@pytest.mark.parametrize("precision,layout", [("bf16", n) for n in LAYOUTS] + [("fp16", "dp2-zero1")])
def test_16_bit_layouts_equal_the_one_process_run(runs, precision, layout):
    ref, got = _metrics(runs["root"] / f"{precision}-ref"), _metrics(runs["root"] / f"{precision}-{layout}")
    assert [r["step"] for r in got] == list(range(STEPS))
    # Tolerance: 16-bit parameters and activations; TP changes where activations are rounded (a
    # row-parallel partial product is rounded to bf16 before the all-reduce), ~2^-8 relative per
    # rounding, which the loss averages over tokens. DP / ZeRO-1 / PP reduce fp32 gradients and came
    # out bit-equal here. Measured worst over these layouts, 4 steps (AVX-512): losses 1.6e-5
    # relative (bf16 TP2), grad norms 2.0e-4 (bf16 TP2), 1.2e-4 (fp16 DP2); bounds 5e-4 (30x) and
    # 5e-3 (25x), loose for other SIMD widths' rounding. A gradient lost or counted twice moves the
    # norm by > 25%, a skipped main-parameter update the losses by > 1e-3.
    close([r["loss"] for r in got], [r["loss"] for r in ref], rtol=5e-4, site="precision.losses",
          case=f"{precision} {layout}")
    close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=5e-3, site="precision.grad_norm",
          case=f"{precision} {layout}")


def test_16_bit_losses_stay_close_to_fp32(runs, tmp_path):
    """bf16 is a rounding of the fp32 run, not another model: the first step's loss (same initial
    weights, rounded) agrees to bf16 resolution."""
    fp32 = tmp_path / "fp32"
    fp32.mkdir()
    train(_cfg(runs["data"], "fp32"), one_process_context(fp32), runs["data_dir"], progress=False)
    # bf16 rounding of weights and activations: measured 1.6e-5 relative at step 0; bound 5e-4 (30x).
    close(_metrics(runs["root"] / "bf16-ref")[0]["loss"], _metrics(fp32)[0]["loss"], rtol=5e-4,
          site="precision.bf16_vs_fp32")
    assert _metrics(runs["root"] / "bf16-ref")[0]["loss"] != _metrics(fp32)[0]["loss"]  # and it is bf16


def test_resume_is_exact_with_fp32_main_parameters(runs, tmp_path):
    """The fp32 main parameters are in the checkpoint: resuming a bf16 run at step 2 continues on
    exactly the uninterrupted run's losses (a resume from the bf16 parameters alone would not)."""
    saved = runs["root"] / "bf16-ref" / "checkpoints" / "step_00000002"
    assert {t.dtype for t in load_file(str(saved / "model-00000.safetensors")).values()} == {torch.bfloat16}
    optim = load_file(str(saved / "optim-00000.safetensors"))
    assert {t.dtype for k, t in optim.items() if k.endswith(".main")} == {torch.float32}
    cfg = _cfg(runs["data"], "bf16")
    cfg.checkpoint.load = str(saved)
    train(cfg, one_process_context(tmp_path), runs["data_dir"], progress=False)
    ref = _metrics(runs["root"] / "bf16-ref")
    assert [r["loss"] for r in _metrics(tmp_path)] == [r["loss"] for r in ref[2:]]


def test_fp16_resume_restores_the_loss_scaler(runs, tmp_path):
    """The scaler's state is in the checkpoint: an fp16 run resumed at step 2 continues with the same
    scale, skip count and losses as the uninterrupted run."""
    cfg = _cfg(runs["data"], "fp16", initial_loss_scale=2.0 ** 12)
    cfg.checkpoint.load = str(runs["root"] / "fp16-ref" / "checkpoints" / "step_00000002")
    train(cfg, one_process_context(tmp_path), runs["data_dir"], progress=False)
    keys = ("loss", "loss_scale", "skipped_steps")
    assert [[r[k] for k in keys] for r in _metrics(tmp_path)] == \
        [[r[k] for k in keys] for r in _metrics(runs["root"] / "fp16-ref")[2:]]


def test_fp16_metrics_carry_the_loss_scale(runs):
    got = _metrics(runs["root"] / "fp16-dp2-zero1")
    assert all(r["loss_scale"] == 2.0 ** 12 and r["skipped_steps"] == 0 for r in got)


# --- an injected fp16 overflow --------------------------------------------------------------------------

def _overflow_rank(rank: int, world: int, config: dict, data_dir: str) -> dict:
    from fivefold.train.loop import _loaders
    from fivefold.train.schedule import lr_at

    cfg = config_from_dict(config)
    ctx = RankContext(Mesh.build(layout_of(cfg)), Path(data_dir) / f"overflow-{rank}")
    parts = build(cfg, ctx)
    loader, _ = _loaders(cfg, ctx, Path(data_dir))
    first = next(parts.model.parameters())
    out = []
    for step in range(3):
        hook = None
        if step == 1 and rank == 1:  # one rank's gradient overflows at step 1
            hook = first.register_hook(lambda g: torch.full_like(g, float("inf")))
        before = [p.detach().clone() for p in parts.model.parameters()]
        r = train_step(parts, loader.step_batch(step), lr=lr_at(step, cfg.training), clip_grad=0.5, device=ctx.device)
        if hook is not None:
            hook.remove()
        moved = any(not torch.equal(a, p) for a, p in zip(before, parts.model.parameters()))
        out.append({"skipped": r.skipped, "moved": moved, "scale": parts.dp.scaler.scale, "loss": r.loss})
    return out


def test_an_fp16_overflow_skips_the_step_on_every_rank(runs, workers):
    cfg = _cfg(runs["data"], "fp16", world=2, zero=True, initial_loss_scale=2.0 ** 12, hysteresis=1)
    for rank, steps in enumerate(workers(2).run(_overflow_rank, to_dict(cfg), str(runs["data_dir"]))):
        assert [s["skipped"] for s in steps] == [False, True, False], f"rank {rank}"
        assert [s["moved"] for s in steps] == [True, False, True], f"rank {rank}"
        assert [s["scale"] for s in steps] == [2.0 ** 12, 2.0 ** 11, 2.0 ** 11]  # hysteresis 1: halved at once
        assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


# --- optimizer offload: the same updates ----------------------------------------------------------------

def test_offload_gives_identical_updates(runs, workers, tmp_path):
    """Half the optimizer offloaded (fp32 main copies stepped where the host is) trains exactly as the
    plain ZeRO-1 run: AdamW is elementwise, so where a main parameter lives changes no number."""
    base = _cfg(runs["data"], "fp32", world=2, zero=True)
    off = _cfg(runs["data"], "fp32", world=2, zero=True, optimizer_cpu_offload=True,
               use_precision_aware_optimizer=True, optimizer_offload_fraction=0.5)
    for name, cfg in (("base", base), ("off", off)):
        workers(2).run(_train_rank, to_dict(cfg), str(tmp_path / name), str(runs["data_dir"]))
    assert [r["loss"] for r in _metrics(tmp_path / "off")] == [r["loss"] for r in _metrics(tmp_path / "base")]


# --- model-state bytes per parameter: the formula in docs/precision.md ----------------------------------

def _state_bytes_rank(rank: int, world: int, config: dict, data_dir: str) -> dict:
    from fivefold.train.loop import _loaders
    from fivefold.train.schedule import lr_at

    cfg = config_from_dict(config)
    ctx = RankContext(Mesh.build(layout_of(cfg)), Path(data_dir) / f"state-{rank}")
    parts = build(cfg, ctx)
    loader, _ = _loaders(cfg, ctx, Path(data_dir))
    train_step(parts, loader.step_batch(0), lr=lr_at(0, cfg.training), clip_grad=0.5, device=ctx.device)
    storages: dict[int, int] = {}  # every distinct storage once (views of one buffer share it)

    def count(t):
        if t is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in parts.model.parameters():
        count(p)
        count(p.main_grad)
    for d in parts.dp.domains:
        for m in d.main():
            count(m)
        for b in d.reducer.buckets:
            count(b.grad_shard)  # ZeRO-2: the 1/d accumulators (ZeRO-1: a range of the buffer)
            count(getattr(b, "param_shard", None))  # ZeRO-3: the parameters' chunk (the full buffer freed)
    for s in parts.dp.state.values():
        for k, v in s.items():
            if k != "step":
                count(v)
    n = sum(p.numel() for p in parts.model.parameters())
    return {"bytes": sum(storages.values()), "params": n}


@pytest.mark.parametrize("precision,extra,world,zero", [
    ("bf16", {}, 1, False), ("bf16", {"grad_reduce_in_bf16": True}, 1, False), ("bf16", {}, 2, True),
    ("fp16", {"initial_loss_scale": 4096.0}, 2, True), ("fp32", {}, 2, True),
    ("fp32", {"data_parallel_sharding_strategy": "optim_grads"}, 2, False),
    ("bf16", {"data_parallel_sharding_strategy": "optim_grads"}, 2, False),
    ("fp32", {"data_parallel_sharding_strategy": "optim_grads_params"}, 2, False),
    ("bf16", {"data_parallel_sharding_strategy": "optim_grads_params"}, 2, False)])
def test_model_state_bytes_follow_the_formula(runs, workers, precision, extra, world, zero):
    """Parameters + gradient buffers + main parameters + AdamW moments held per rank after a step:
    Precision.state_bytes (docs/precision.md), e.g. bf16 replicated 2 + 4 + 12 = 18 bytes per
    parameter, ZeRO-1 over d ranks 2 + 4 + 12/d (Megatron's 6 + 12/d), ZeRO-2 2 + 16/d (the full
    gradient buffers are freed between steps), ZeRO-3 18/d (the full parameters too)."""
    cfg = _cfg(runs["data"], precision, world=world, zero=zero, **extra)
    per_param = Precision.of(cfg.training).bytes_per_param(world, cfg.training.sharding_strategy)
    for r in workers(world).run(_state_bytes_rank, to_dict(cfg), str(runs["data_dir"])):
        # exact but for ZeRO-1's padding of each bucket to a multiple of d (< d elements per bucket)
        assert 0 <= r["bytes"] - per_param * r["params"] <= 16 * world, (r, per_param)


PRECISION_AWARE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                   "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
                   "--train-iters", "1", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--mock-data",
                   "--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                   "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
"""A Megatron command line with bf16 AdamW moments (the planner counts them, the runtime refuses them)."""


def test_precision_aware_optimizer_dtypes_are_parsed_checked_counted_and_refused():
    """Megatron's --exp-avg-dtype / --exp-avg-sq-dtype / --main-params-dtype / --fp8-param-gather: parsed
    to their fields, refused without --use-precision-aware-optimizer (the fix named), counted by the
    planner (bf16 moments: 4 + 2 + 2 bytes of optimizer state; fp8 primary weights: 1 byte), refused by
    the runtime."""
    from dataclasses import replace

    from fivefold.config.load import load_config
    from fivefold.errors import NotImplementedYet, UserError
    from fivefold.config.supported import check_supported

    without = [w for w in PRECISION_AWARE if w != "--use-precision-aware-optimizer"]
    with pytest.raises(UserError, match=r"training\.exp_avg_dtype='bf16'.*use-precision-aware-optimizer"):
        validate(load_config(None, without, world_size=2).config)
    cfg = load_config(None, PRECISION_AWARE, world_size=2).config
    validate(cfg)
    t = cfg.training
    assert (t.exp_avg_dtype, t.exp_avg_sq_dtype, t.main_params_dtype) == ("bf16", "bf16", "fp32")
    assert Precision.of(t).state_bytes(4, "optim") == (2, 4, (4 + 2 + 2) / 4)
    assert Precision.of(replace(t, main_params_dtype="fp16", exp_avg_sq_dtype="fp8")).state_bytes(4, "optim") == (
        2, 4, (2 + 2 + 1) / 4)
    assert Precision.of(TrainingConfig(precision="bf16")).state_bytes(4, "optim") == (2, 4, 12 / 4)  # today's
    with pytest.raises(NotImplementedYet, match="exp_avg_dtype.*not implemented yet"):
        check_supported(cfg)
    t.fp8_param_gather = True
    assert Precision.of(t, "fp8").state_bytes(1, "optim")[0] == 1 and Precision.of(t).state_bytes(1, "optim")[0] == 2
    with pytest.raises(UserError, match="fp8 primary weights need fp8"):
        validate(cfg)
    with pytest.raises(UserError, match=r"exp_avg_dtype='fp4'.*one of fp32, bf16, fp16, fp8"):
        validate(load_config(None, PRECISION_AWARE + ["--exp-avg-dtype", "fp4"], world_size=2).config)


def test_train_refuses_precision_aware_dtypes_before_any_rank_starts(tmp_path, capsys):
    """`fivefold train` on the command line above exits 2 with "not implemented yet": the runtime keeps
    fp32 AdamW state, so it never trains something other than the config says."""
    from fivefold.cli import main

    args = tmp_path / "args.txt"
    args.write_text(" ".join(PRECISION_AWARE))
    assert main(["train", str(args), "--nproc", "2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "training.exp_avg_dtype='bf16'" in err and "not implemented yet" in err
    assert not (tmp_path / "out").exists()  # nothing started, nothing written
