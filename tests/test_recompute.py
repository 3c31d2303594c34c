"""Activation recompute (Megatron semantics): which layers run twice, and the same losses and
gradients as without recompute, bit for bit (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch

from fivefold.config.schema import ModelConfig, TrainingConfig
from fivefold.config.schema import Config
from fivefold.config.validate import ConfigError, validate
from fivefold.model import Decoder
from fivefold.model import attention, block
from fivefold.model.recompute import Recompute

CFG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2)
LAYER_FORWARD, CORE_ATTENTION = block.DecoderLayer.forward, attention.core_attention


def _run(recompute: Recompute, monkeypatch) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int], int]:
    """(loss, grads, forward calls per layer, core-attention calls) of one forward + backward."""
    model = Decoder(CFG, seed=3)
    model.set_recompute(recompute)
    calls = [0] * CFG.num_layers
    index = {id(layer): i for i, layer in enumerate(model.layers.values())}

    def counted_layer(self, *args):  # (module forward hooks do not fire in checkpoint's recompute)
        calls[index[id(self)]] += 1
        return LAYER_FORWARD(self, *args)

    monkeypatch.setattr(block.DecoderLayer, "forward", counted_layer)
    core = [0]

    def counted(q, k, v, **kw):  # kw: context parallelism, softmax scale
        core[0] += 1
        return CORE_ATTENTION(q, k, v, **kw)

    monkeypatch.setattr(attention, "core_attention", counted)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (2, 64), generator=g)
    labels = torch.randint(0, CFG.vocab_size, (2, 64), generator=g)
    total, count = model.loss(ids, labels)
    (total / count).backward()
    return total.detach(), {n: p.grad for n, p in model.named_parameters()}, calls, core[0]


@pytest.mark.parametrize("recompute,layer_calls,core_calls", [
    (Recompute("full", "uniform", 1), [2, 2, 2, 2], 8),  # every layer its own span
    (Recompute("full", "uniform", 3), [2, 2, 2, 2], 8),  # spans [0, 3) and [3, 4)
    (Recompute("full", "block", 2), [2, 2, 1, 1], 6),  # the first two layers only
    (Recompute("full", "block", 0), [1, 1, 1, 1], 4),  # block with 0 layers: nothing recomputed
    (Recompute("selective"), [1, 1, 1, 1], 8),  # the core attention of every layer, not the layer
])
def test_recompute_repeats_forward_and_keeps_losses_and_grads_exact(recompute, layer_calls, core_calls, monkeypatch):
    ref_loss, ref_grads, ref_calls, ref_core = _run(Recompute(), monkeypatch)
    assert ref_calls == [1, 1, 1, 1] and ref_core == 4
    loss, grads, calls, core = _run(recompute, monkeypatch)
    assert calls == layer_calls and core == core_calls
    # Bit-exact: backward recomputes the same ops on the same inputs (deterministic CPU kernels) and
    # the autograd graph it builds is the one the plain forward builds.
    assert torch.equal(loss, ref_loss)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def test_no_recompute_under_no_grad(monkeypatch):
    model = Decoder(CFG, seed=3)
    model.set_recompute(Recompute("full", "uniform", 2))
    ids = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        ref = Decoder(CFG, seed=3)(ids)
        assert torch.equal(model(ids), ref)


@pytest.mark.parametrize("fields,needle", [
    (dict(recompute_granularity="full"), "needs recompute_method uniform or block"),
    (dict(recompute_granularity="full", recompute_method="uniform"), "needs recompute_num_layers"),
    (dict(recompute_granularity="selective", recompute_method="block", recompute_num_layers=1), "full recompute only"),
])
def test_megatron_refusals(fields, needle):
    # Refused by validation (one set of rules), before any rank starts.
    with pytest.raises(ConfigError, match=needle):
        validate(Config(training=TrainingConfig(**fields)), "megatron")


def test_from_training():
    t = TrainingConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert Recompute.from_training(t) == Recompute("full", "block", 1)
    assert Recompute.from_training(TrainingConfig()).spans(3) == [(0, 3, False)]
