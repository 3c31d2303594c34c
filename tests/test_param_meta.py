"""Parameter metadata (fivefold.parallel.param_meta) in one process: created with the parameter,
surviving what replaces tensors (to_empty, .to, ZeRO-1's flat buffer and main parameters), read by
the gradient path; and parallelize refusing a model built for another TP layout. Multi-rank
behaviour is covered by every layout test (test_tp_model, test_zero, test_moe, ...)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fivefold.config.schema import Config, ModelConfig, ParallelConfig, TrainingConfig
from fivefold.model import Decoder
from fivefold.parallel.data.data_parallel import DataParallel
from fivefold.parallel.param_meta import PLAIN, GradDomain, Shard, metas_of, named_metas
from fivefold.train.parallelize import parallelize
from fivefold.parallel.tensor.layers import ColumnParallelLinear, TPMode
from fivefold.runtime.mesh import Group, Mesh
from fivefold.topology import Layout

MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=200,
                  ffn_hidden_size=64, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                  moe_first_k_dense_layers=1)


def _tp_rank1_of_2() -> Group:
    """Rank 1 of a 2-rank TP group, without a process group: enough to build layers (no collective)."""
    return Group("tp", (0, 1), None, me=1)


def test_shard_survives_to_empty_and_to():
    with torch.device("meta"):
        col = ColumnParallelLinear(16, 48, group=_tp_rank1_of_2())
    want = Shard((48, 16), 0, 24, 24, "tp")
    assert named_metas(col)["weight"].shard == want
    col.to_empty(device="cpu")  # replaces the Parameter: the metadata is on the module
    col.to(torch.float64)
    assert named_metas(col)["weight"].shard == want
    assert metas_of(col)[id(col.weight)].shard == want


def test_decoder_marks_experts_vocabulary_and_sequence_sharded_norms():
    model = Decoder(MOE, mesh=SimpleNamespace(tp=_tp_rank1_of_2(), ep=Mesh.build(Layout()).ep,
                                              etp=Mesh.build(Layout()).etp, group=Mesh.build(Layout()).group),
                    sequence_parallel=True)
    metas = named_metas(model)
    experts = {n for n, m in metas.items() if m.domain is GradDomain.EXPERT}
    assert experts == {n for n in metas if ".mlp.experts." in n} and experts
    assert metas["embedding.weight"].vocab_rows == 200 and metas["embedding.weight"].shard.start == 128
    assert all(metas[n].tp_grad_sum for n in metas if n.endswith("norm.weight") or ".router." in n)
    assert metas["layers.0.attn.q_proj.weight"].shard is not None
    assert not metas["layers.0.attn.q_proj.weight"].tp_grad_sum
    # owns_grad: split parameters on every TP rank, a replicated one on TP rank 0 only, experts everywhere
    assert metas["layers.0.attn.q_proj.weight"].owns_grad(1) and not metas["final_norm.weight"].owns_grad(1)
    assert metas["layers.1.mlp.experts.0.up_proj.weight"].owns_grad(1)


def test_zero1_main_params_are_held_as_their_parameters():
    cfg = Config(model=MOE, training=TrainingConfig(use_distributed_optimizer=True))
    model = Decoder(MOE)
    dp = DataParallel(model, Mesh.build(Layout()), cfg.training)
    by_param = metas_of(model)
    pieces = [pc for d in dp.domains for pc in d.zero.pieces]
    assert len(pieces) == len(list(model.parameters()))  # one rank: every parameter is one whole piece
    for pc in pieces:
        assert dp.metas[id(pc.tensor)] is by_param[id(pc.param)]
        assert pc.tensor.data_ptr() == pc.param.data_ptr()  # the main parameter aliases the model's
    assert [d.kind for d in dp.domains] == [GradDomain.DENSE, GradDomain.EXPERT]


def test_plain_parameters_get_the_default():
    assert named_metas(torch.nn.Linear(2, 3)) == {"weight": PLAIN, "bias": PLAIN}


def test_parallelize_refuses_a_model_built_for_another_tp_layout():
    cfg = Config(model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=200),
                 parallel=ParallelConfig(sequence_parallel=False))
    built_tp2 = Decoder(cfg.model, mesh=SimpleNamespace(tp=_tp_rank1_of_2()))
    assert built_tp2.mode is TPMode.ALL_REDUCE
    with pytest.raises(ValueError, match="built for TP ranks"):
        parallelize(built_tp2, Mesh.build(Layout()), cfg)
