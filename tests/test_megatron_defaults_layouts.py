"""Megatron's default GPT (no --swiglu, no --normalization: GeLU MLP, LayerNorm, linear biases, tied
embeddings, learned absolute positions, dropout 0.1) trains the same in every layout as in one
process, dropout included: its masks are a function of (seed, step, sample, layer, site, global
position, feature), not of the rank (fivefold.model.dropout)."""
from __future__ import annotations

import json

import pytest

from _tol import close
from _train_util import corpus, one_process_context
from fivefold.cli.train import prepare
from fivefold.config.schema import to_dict
from fivefold.train.loop import train
import test_zero

LAYOUTS = {  # under CP, attention dropout gathers the whole sequence's keys and values
    "tp2sp-dp2": (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2-dp2": (4, {"pipeline_model_parallel_size": 2}),
    "cp2-tp2sp": (4, {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}),
}


def _config(data, world: int, attention_dropout: float = 0.1, hidden_dropout: float = 0.1):
    cfg = test_zero._config(data, dp=world)  # MQA (one KV head, replicated under TP2), tied embeddings
    cfg.training.train_iters, cfg.training.seq_length = 3, 32  # suite budget
    m = cfg.model
    m.activation, m.normalization, m.add_bias_linear = "gelu", "LayerNorm", True
    m.position_embedding_type, m.max_position_embeddings = "learned_absolute", cfg.training.seq_length
    m.attention_dropout, m.hidden_dropout = attention_dropout, hidden_dropout
    return cfg


def _run(cfg, out, data_dir, workers, world, parallel):
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    workers(world).run(test_zero._train_rank, to_dict(cfg), str(out), str(data_dir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, workers):
    root = tmp_path_factory.mktemp("megatron_defaults")
    data = corpus(root / "corpus")
    data_dir = prepare(_config(data, 1), root)
    for name, kw in (("ref", {}), ("ref-hidden", {"attention_dropout": 0.0}), ("ref-nodrop", {"attention_dropout": 0.0, "hidden_dropout": 0.0})):
        (root / name).mkdir()
        train(_config(data, 1, **kw), one_process_context(root / name), data_dir, progress=False)
    for name, (world, parallel) in LAYOUTS.items():
        _run(_config(data, world), root / name, data_dir, workers, world, parallel)
    return root


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_dropout_changes_the_run(runs):
    """The masks are drawn at all: each dropout moves the gradient norms 100x past the layout bound
    (measured: attention dropout 2.6e-3, hidden dropout 8e-2 relative at step 1)."""
    norms = {n: [r["grad_norm"] for r in _metrics(runs / n)] for n in ("ref", "ref-hidden", "ref-nodrop")}
    for a, b in (("ref", "ref-hidden"), ("ref-hidden", "ref-nodrop")):
        assert max(abs(x - y) / y for x, y in zip(norms[a], norms[b])) > 1e-3, (a, b)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_default_model_layouts_equal_one_process(runs, name):
    ref = _metrics(runs / "ref")
    got = _metrics(runs / name)
    # TP / SP / CP / PP / DP reorder fp32 sums (test_zero2's bound for these layouts, 1e-5 relative):
    # measured worst 2.5e-8 (losses, tp2sp-dp2), 2.5e-8 (grad norms, pp2-dp2) relative, 400x under;
    # a mask that depended on the rank would change ~10% of the elements and move the norms by > 1e-3.
    close([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5, site="megatron_defaults.losses", case=name)
    close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5,
          site="megatron_defaults.grad_norm", case=name)
