"""Deterministic initialisation: any subset of the model starts from the one-process model's weights."""
from __future__ import annotations

import pytest
import torch

from fivefold.config.schema import ModelConfig
from fivefold.errors import NotImplementedYet, UserError
from fivefold.model import Decoder
from fivefold.model.init import initial_value

CFG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=200)


@pytest.mark.parametrize("tie", [False, True])
def test_pipeline_stages_hold_exactly_the_full_models_weights(tie):
    cfg = ModelConfig(**{**vars(CFG), "tie_word_embeddings": tie})
    full = dict(Decoder(cfg, seed=5).state_dict())
    first = Decoder(cfg, layers=[0, 1], head=False, seed=5)
    last = Decoder(cfg, layers=[2, 3], embedding=False, seed=5)
    assert set(first.state_dict()) | set(last.state_dict()) == set(full)
    for stage in (first, last):
        for name, p in stage.state_dict().items():
            assert torch.equal(p, full[name]), name  # same (seed, name) -> same generator draws: bit-exact
    if tie:  # the last stage's own copy of the tied output layer starts equal to the embedding
        assert torch.equal(last.head.weight, full["embedding.weight"])


def test_seed_and_name_both_change_the_draw_and_padding_rows_are_zero():
    a, b = Decoder(CFG, seed=0), Decoder(CFG, seed=1)
    assert not torch.equal(a.layers["0"].attn.q_proj.weight, b.layers["0"].attn.q_proj.weight)
    assert not torch.equal(a.layers["0"].attn.q_proj.weight[:32], a.layers["1"].attn.q_proj.weight[:32])
    assert a.embedding.weight.shape == (256, 64)  # 200 padded to a multiple of 128
    assert torch.equal(a.embedding.weight[200:], torch.zeros(56, 64))
    assert torch.equal(a.head.weight[200:], torch.zeros(56, 64))
    assert torch.equal(a.layers["3"].mlp_norm.weight, torch.ones(64))
    # The real rows do not depend on the padding (so a TP-padded vocabulary starts the same).
    wide = initial_value("embedding.weight", (512, 64), seed=0, std=0.02, vocab_size=200)
    assert torch.equal(wide[:256], a.embedding.weight)


def test_padding_does_not_change_the_loss():
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    narrow = Decoder(ModelConfig(**{**vars(CFG), "make_vocab_size_divisible_by": 8}), seed=2)
    wide = Decoder(CFG, seed=2)
    assert narrow.head.weight.shape[0] == 200 and wide.head.weight.shape[0] == 256
    with torch.no_grad():
        # Same weights on the real rows; the only difference is the width of the output matmul,
        # whose per-element sums are identical, and masked padded columns add exp(-inf) = 0 to the
        # softmax sums: bit-exact (measured under every CPU kernel setting).
        assert torch.equal(narrow.loss(ids, ids)[0], wide.loss(ids, ids)[0])


def test_bad_requests_are_refused():
    with pytest.raises(UserError, match=r"layers=\[3, 2\]"):
        Decoder(CFG, layers=[3, 2])
    with pytest.raises(UserError, match=r"layers=\[4\]"):
        Decoder(CFG, layers=[4])
    with pytest.raises(NotImplementedYet, match="sinkhorn"):
        Decoder(ModelConfig(num_experts=4, moe_router_load_balancing_type="sinkhorn"))

