"""Shared helpers for the training tests: a tiny config, one-process runs, launched runs."""
from __future__ import annotations

import json
from pathlib import Path

from fivefold.config.schema import ClusterConfig, Config, DataConfig, ModelConfig, TrainingConfig, to_dict
from fivefold.train.context import RankContext


def corpus(folder: Path, n_docs: int = 30) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (folder / f"doc{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 7))
    return folder


def tiny_config(data: Path, *, world: int = 1, gbs: int = 8, mbs: int = 1, steps: int = 4, seq: int = 32, **training) -> Config:
    return Config(cluster=ClusterConfig(world_size=world),
                  model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4),
                  training=TrainingConfig(seq_length=seq, global_batch_size=gbs, micro_batch_size=mbs,
                                          train_iters=steps, lr=3e-3, lr_warmup_iters=0, **training),
                  data=DataConfig(path=str(data), eval_fraction=0.1))


def one_process_context(out: Path) -> RankContext:
    return RankContext.single(out)


def train_one_process(config: Config, root: Path):
    """Prepare `config`'s data under `root` and train it in this process (root/"one"), with one intra-op
    thread as every worker rank has; returns (the train result, the prepared data folder)."""
    import torch

    from fivefold.cli.train import prepare
    from fivefold.train.loop import train

    data_dir = prepare(config, root)
    (root / "one").mkdir()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(config, one_process_context(root / "one"), data_dir, progress=False), data_dir
    finally:
        torch.set_num_threads(before)


def write_spec(config: Config, out: Path, data_dir: Path) -> Path:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    spec = out / "run.json"
    spec.write_text(json.dumps({"config": to_dict(config), "out": str(out), "data_dir": str(data_dir)}))
    return spec


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def megatron_scheduler(max_lr, min_lr, init_lr, warmup_steps, decay_steps, style):
    """megatron-core's OptimizerParamScheduler (the reference for fivefold.train.schedule), in Megatron's units
    (samples for both warm-up and decay), its weight decay constant."""
    import types
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    return OptimizerParamScheduler(types.SimpleNamespace(param_groups=[{}]), init_lr=init_lr, max_lr=max_lr, min_lr=min_lr,
                                   lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=style,
                                   start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant")
