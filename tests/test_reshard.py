"""Checkpoints from one layout into another: a run saved at step 2 in one layout continues in another
on the uninterrupted one-process run's losses (steps 3-4). "Another model" is decided by the model's
config and each rank's parameter shapes, never by which parameters a pipeline stage holds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _tol import close
from _train_util import corpus, one_process_context
from fivefold.cli.train import prepare
from fivefold.config.schema import to_dict
from fivefold.errors import UserError
from fivefold.train.loop import train
import test_moe
import test_zero

SAVED = {  # name: (world, parallel, training): layouts saved at step 2
    "tp2dp2-zero1": (4, {"tensor_model_parallel_size": 2}, {"zero": True}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                  "pipeline_schedule": "interleaved"}, {}),
    "cp2-tp2sp": (4, {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}, {}),
    "tp2dp2-bf16": (4, {"tensor_model_parallel_size": 2}, {"precision": "bf16", "zero": True}),
}
LOADED = {  # (saved, into): (world, parallel, training)
    ("tp2dp2-zero1", "pp2"): (2, {"pipeline_model_parallel_size": 2}, {}),  # the reported TP2 x DP2 -> PP2 case
    ("tp2dp2-zero1", "pp2dp2-zero2"): (4, {"pipeline_model_parallel_size": 2},
                                       {"data_parallel_sharding_strategy": "optim_grads"}),
    ("tp2dp2-zero1", "cp2dp2-zero3"): (4, {"context_parallel_size": 2},
                                       {"data_parallel_sharding_strategy": "optim_grads_params"}),
    ("pp2-vpp2", "tp2sp-dp2"): (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True}, {}),
    ("pp2-vpp2", "pp2-uneven"): (2, {"pipeline_model_parallel_size": 2, "pipeline_layers_per_stage": [3, 1]}, {}),
    ("cp2-tp2sp", "pp2-zbh1"): (2, {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1"}, {}),
    ("cp2-tp2sp", "tp4-zero1"): (4, {"tensor_model_parallel_size": 4}, {"zero": True}),  # vocab padded 256 -> 512
    ("pp2-vpp2", "cp2-a2a"): (2, {"context_parallel_size": 2, "cp_comm_type": "a2a"}, {}),
    ("tp2dp2-zero1", "one-process"): (1, {}, {}),
    ("tp2dp2-bf16", "pp2-fp32"): (2, {"pipeline_model_parallel_size": 2}, {}),  # precision changes too
}
MOE_SAVED = {"moe-ep2dp2": (4, {"expert_model_parallel_size": 2})}
MOE_LOADED = {  # (saved, into): (world, parallel)
    ("moe-ep2dp2", "moe-tp2-ep2-etp1"): (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                              "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}),
    ("moe-ep2dp2", "moe-pp2-ep2"): (4, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
    ("moe-ep2dp2", "moe-ep4"): (4, {"expert_model_parallel_size": 4}),
}


def _config(data: Path, world: int, parallel: dict, training: dict):
    cfg = test_zero._config(data, dp=world, **training)
    cfg.model.num_layers = 4  # PP2 x VPP2: a layer per virtual stage; uneven 3 + 1
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, workers):
    root = tmp_path_factory.mktemp("reshard")
    data = corpus(root / "corpus")
    ref = _config(data, 1, {}, {})
    data_dir = prepare(ref, root)
    (root / "ref").mkdir()
    with test_moe._one_thread():  # as every worker rank runs
        train(ref, one_process_context(root / "ref"), data_dir, progress=False)
    for name, (world, parallel, training) in SAVED.items():
        cfg = _config(data, world, parallel, training)
        cfg.checkpoint.save_interval = 2
        cfg.training.train_iters = 2  # the reference's first two steps, on its learning-rate schedule:
        cfg.training.lr_decay_iters = ref.training.train_iters
        cfg.checkpoint.async_save = name == "pp2-vpp2"  # written by background threads, committed at the end
        workers(world).run(test_zero._train_rank, to_dict(cfg), str(root / name), str(data_dir))
    moe_ref = test_moe._config(data)
    (root / "moe-ref").mkdir()
    with test_moe._one_thread():
        train(moe_ref, one_process_context(root / "moe-ref"), data_dir, progress=False)
    for name, (world, parallel) in MOE_SAVED.items():
        cfg = test_moe._config(data, world, parallel)
        cfg.checkpoint.save_interval = 2
        cfg.training.train_iters = 2
        cfg.training.lr_decay_iters = moe_ref.training.train_iters
        workers(world).run(test_moe._train_rank, to_dict(cfg), str(root / name), str(data_dir))
    return root


@pytest.mark.parametrize("pair", list(LOADED), ids=lambda p: f"{p[0]}->{p[1]}")
def test_a_checkpoint_continues_in_another_layout(runs, workers, pair):
    saved, into = pair
    world, parallel, training = LOADED[pair]
    cfg = _config(runs / "corpus", world, parallel, training)
    cfg.checkpoint.load = str(runs / saved / "checkpoints" / "step_00000002")
    out = runs / f"{saved}--{into}"
    workers(world).run(test_zero._train_rank, to_dict(cfg), str(out), str(runs / "data"))
    got, ref = _losses(out), _losses(runs / "ref")
    assert len(got) == 2  # steps 3 and 4
    # Tolerance: two layouts' reordered fp32 sums (TP, SP, CP, PP, ZeRO; test_zero, test_cp, test_zero2)
    # over 2 + 2 steps, the AdamW state carried through the checkpoint. Measured worst over these
    # pairs 8.9e-8 relative (cp2-tp2sp -> tp4-zero1, AVX-512); bound 1e-5, the layouts' own bound in
    # test_zero2 (112x).
    if saved.endswith("bf16"):  # two bf16 steps before the checkpoint: bf16 rounding, not layout noise
        # measured 1.3e-4 relative (the fp32 main parameters and moments continue in fp32); bound 4e-3 (30x)
        close(got, ref[2:], rtol=4e-3, site="reshard.bf16_to_fp32", case=f"{saved}->{into}")
        return
    close(got, ref[2:], rtol=1e-5, site="reshard.losses", case=f"{saved}->{into}")


@pytest.mark.parametrize("pair", list(MOE_LOADED), ids=lambda p: f"{p[0]}->{p[1]}")
def test_a_moe_checkpoint_continues_in_another_layout(runs, workers, pair):
    """Routed experts saved by EP rank continue under another EP / ETP / TP / PP split."""
    saved, into = pair
    world, parallel = MOE_LOADED[pair]
    cfg = test_moe._config(runs / "corpus", world, parallel)
    cfg.checkpoint.load = str(runs / saved / "checkpoints" / "step_00000002")
    out = runs / f"{saved}--{into}"
    workers(world).run(test_moe._train_rank, to_dict(cfg), str(out), str(runs / "data"))
    got, ref = _losses(out), _losses(runs / "moe-ref")
    assert len(got) == len(ref) - 2 >= 1  # the steps after the checkpoint
    # EP / ETP / TP reorder the expert sums (test_moe's bound, 1e-5, docs/tolerances.md); measured
    # worst over these pairs 1.3e-8 relative (-> TP2+SP x EP2 ETP1, AVX-512; 750x).
    close(got, ref[2:], rtol=1e-5, site="reshard.moe_losses", case=f"{saved}->{into}")


def test_another_model_is_named_by_its_config(runs):
    """A stage of a PP run names the model fields that differ, not parameters other stages hold."""
    cfg = _config(runs / "corpus", 1, {}, {})
    cfg.model.hidden_size = 96
    cfg.checkpoint.load = str(runs / "tp2dp2-zero1" / "checkpoints" / "step_00000002")
    with pytest.raises(UserError, match=r"model\.hidden_size is 64 in the checkpoint, 96 here"):
        train(cfg, one_process_context(runs / "other-model"), runs / "data", progress=False)


def test_foreign_and_damaged_checkpoints_are_refused_with_the_way_through(runs, tmp_path):
    from fivefold.checkpoint.io import load_checkpoint
    from fivefold.model.decoder import Decoder

    model = Decoder(_config(runs / "corpus", 1, {}, {}).model)
    megatron = tmp_path / "megatron"  # a torch_dist save root
    (megatron / "iter_0000100").mkdir(parents=True)
    (megatron / "latest_checkpointed_iteration.txt").write_text("100")
    (megatron / "iter_0000100" / ".metadata").write_bytes(b"\x80\x04pickle")
    (megatron / "iter_0000100" / "__0_0.distcp").write_bytes(b"")
    pickled = tmp_path / "hf-bin"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    for folder, says in ((megatron, "metadata is pickled.*--load-hf"), (pickled, "pickles.*safe_serialization")):
        with pytest.raises(UserError, match=says):
            load_checkpoint(folder, model=model, optimizer=None, rank=0, world_size=1)
    import shutil
    damaged = tmp_path / "damaged"
    shutil.copytree(runs / "tp2dp2-zero1" / "checkpoints" / "step_00000002", damaged)
    data = (damaged / "model-00000.safetensors").read_bytes()
    (damaged / "model-00000.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="model-00000.safetensors is truncated or damaged"):
        load_checkpoint(damaged, model=model, optimizer=None, rank=0, world_size=1)
    (damaged / "model-00000.safetensors").unlink()
    with pytest.raises(UserError, match="model-00000.safetensors is missing"):
        load_checkpoint(damaged, model=model, optimizer=None, rank=0, world_size=1)
