"""Expert capacity and token dropping (fivefold.model.capacity): the kept assignments equal a plain
reference and Megatron-Core's own apply_router_token_dropping; a MoE layer with a capacity equals the
sum over kept assignments written out by hand, and padding expert inputs to capacity changes nothing;
layouts whose router calls see the one-process micro-batch's tokens (DP, EP, PP x EP) reproduce the
one-process run with drops, and a layout that splits them (TP2 + SP) does not, as docs/moe.md says."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _tol import close
from fivefold.config.schema import to_dict
from fivefold.capacity import expert_capacity
from fivefold.model.capacity import within_capacity
from fivefold.model.moe import MoE
from fivefold.parallel.expert.dispatch import swiglu_rows
import test_moe
from test_moe import _config, _one_thread, _train_rank

E, K = test_moe.E, test_moe.K


def _routing(n: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    skew = torch.linspace(0, 2, e)  # some experts popular: drops happen
    top = torch.topk(torch.randn(n, e, generator=g) + skew, k)
    return top.indices, torch.softmax(top.values, -1)


def _reference_keep(experts, weights, e: int, factor: float, policy: str, batch: int) -> torch.Tensor:
    """Per expert, its candidates ranked by the policy; the first `capacity` kept."""
    n, k = experts.shape
    cap = math.ceil(n * k / e * factor)
    keep = torch.zeros(n, k, dtype=torch.bool)
    s = n // batch
    for x in range(e):
        cands = [(t, j) for t in range(n) for j in range(k) if experts[t, j] == x]
        if policy == "probs":
            cands.sort(key=lambda tj: (-float(weights[tj]), tj[0]))
        else:  # Megatron's [s, b] order: position in the sequence first
            cands.sort(key=lambda tj: (tj[0] % s, tj[0] // s))
        for tj in cands[:cap] if cap < n else cands:
            keep[tj] = True
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5, 4.0])
def test_kept_assignments_equal_the_reference(policy, factor):
    for seed, (n, e, k, batch) in enumerate([(32, 4, 2, 2), (48, 8, 2, 3), (40, 8, 3, 1)]):
        experts, weights = _routing(n, e, k, seed)
        got = within_capacity(experts, weights, e, factor, policy, batch)
        assert torch.equal(got, _reference_keep(experts, weights, e, factor, policy, batch)), (seed, policy, factor)
        per_expert = torch.bincount(experts[got], minlength=e)
        assert int(per_expert.max()) <= max(expert_capacity(n, k, e, factor), 0)
    experts, weights = _routing(16, 4, 2, 9)
    assert bool(within_capacity(experts, weights, 4, 4.0, "probs", 1).all())  # capacity 16 >= n: no drop
    assert not bool(within_capacity(experts, weights, 4, 0.5, "probs", 1).all())


def test_probs_policy_equals_megatron_core():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core on CPU: "Transformer Engine and Apex are not installed"
        from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    for seed, factor in enumerate([0.5, 1.0, 1.25]):
        experts, weights = _routing(64, 8, 2, seed)
        probs = torch.zeros(64, 8).scatter(1, experts, weights)
        chosen = torch.zeros(64, 8, dtype=torch.bool).scatter(1, experts, True)
        _, final_map = apply_router_token_dropping(probs, chosen, router_topk=2, capacity_factor=factor,
                                                   drop_policy="probs")
        keep = within_capacity(experts, weights, 8, factor, "probs", 1)
        mine = torch.zeros(64, 8, dtype=torch.bool).scatter(1, experts, keep)
        assert torch.equal(mine, final_map), factor


def _layer(factor: float, pad: bool) -> MoE:
    cfg = test_moe._model()
    cfg.moe_shared_expert_intermediate_size = None
    cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity = factor, pad
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer


def test_layer_output_is_the_kept_assignments_sum_and_padding_changes_nothing():
    x = torch.randn(2, 16, test_moe.H, generator=torch.Generator().manual_seed(3), requires_grad=True)
    layer = _layer(0.75, pad=False)
    y = layer(x)
    routing = layer.router(x.detach().reshape(-1, x.shape[-1]), 2, None)
    keep = within_capacity(routing.experts, routing.weights, E, 0.75, "probs", 2)
    assert 0 < int((~keep).sum()) and layer.step_totals[1:3].tolist() == [int((~keep).sum()), keep.numel()]
    # the load metric counts the kept assignments only (tokens per expert after dropping)
    assert torch.equal(layer.step_totals[3:], torch.bincount(routing.experts[keep], minlength=E).double())
    want = torch.zeros(32, test_moe.H)
    flat = x.detach().reshape(32, -1)
    for t in range(32):
        for j in range(K):
            if keep[t, j]:
                expert = layer.experts[str(int(routing.experts[t, j]))]
                want[t] += routing.weights[t, j] * swiglu_rows(expert, flat[t:t + 1])[0]
    # Measured worst 2.4e-7 (of ~0.1; matmuls of one row vs many); bound 3e-6.
    close(y.detach().reshape(32, -1), want, rtol=0, atol=3e-6, site="capacity.layer")
    y.square().sum().backward()
    padded = _layer(0.75, pad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = padded(x2)
    y2.square().sum().backward()
    # The same rows through the same weights, with zero rows added: measured bit-equal here; bound 1e-6
    # (another CPU's GEMM may block a taller matrix differently).
    close(y2, y, rtol=0, atol=1e-6, site="capacity.padded_output")
    close(x2.grad, x.grad, rtol=0, atol=1e-6, site="capacity.padded_input_grad")
    for (name, p), q in zip(layer.named_parameters(), padded.parameters()):
        close(q.grad, p.grad, rtol=0, atol=1e-6, site="capacity.padded_param_grads", case=name)


def test_dropping_saves_no_copy_of_the_expert_outputs():
    """Putting the kept assignments' outputs back in place (zeros where dropped) keeps only their
    indices for backward, not the outputs (index_copy saved its source: one more (kept, h) tensor per
    MoE layer; the planner counts the combine's own (t k, h), fivefold.planner.memory.activations)."""
    from fivefold.parallel.expert.dispatch import moe_forward
    x = torch.randn(32, test_moe.H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    layer = _layer(0.75, pad=False)
    routing = layer.router(x.detach(), 2, None)
    keep = within_capacity(routing.experts, routing.weights, E, 0.75, "probs", 2)
    experts = [layer.experts[str(e)] for e in range(E)]

    def saved_bytes(keep):
        storages = {}
        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            moe_forward(x, routing.experts, routing.weights, experts, E, None, None, keep=keep)
        return sum(storages.values())

    kept = int(keep.sum())
    all_kept = saved_bytes(torch.ones_like(keep))
    # every assignment kept: the same rows as without dropping, plus the kept assignments' int64
    # indices (measured: exactly those, t k * 8 bytes; index_copy added the rows, t k * h * 4)
    assert all_kept - saved_bytes(None) <= keep.numel() * 8, (all_kept, saved_bytes(None))
    assert kept < keep.numel() and saved_bytes(keep) < all_kept


CAPACITY = dict(moe_expert_capacity_factor=1.0)
# name -> (world, parallel, whether the router calls see the one-process micro-batch's tokens)
LAYOUTS = {
    "dp2": (2, {}, True),
    "ep2": (2, dict(expert_model_parallel_size=2), True),
    "ep2-pad": (2, dict(expert_model_parallel_size=2), True),
    "pp2-ep2": (4, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2), True),
    "tp2sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), False),
}


def _capacity_config(data, world: int = 1, parallel: dict | None = None, pad: bool = False):
    cfg = _config(data, world, parallel)
    cfg.model.moe_expert_capacity_factor = 1.0
    cfg.model.moe_pad_expert_input_to_capacity = pad
    return cfg


@pytest.fixture(scope="module")
def capacity_runs(tmp_path_factory, workers):
    from _train_util import corpus, one_process_context
    from fivefold.cli.train import prepare
    from fivefold.train.loop import train

    root = tmp_path_factory.mktemp("capacity")
    data = corpus(root / "corpus")
    ref_cfg = _capacity_config(data)
    data_dir = prepare(ref_cfg, root)
    (root / "ref").mkdir()
    with _one_thread():
        train(ref_cfg, one_process_context(root / "ref"), data_dir, progress=False)
    out = {"ref": _metrics(root / "ref")}
    for name, (world, parallel, _) in LAYOUTS.items():
        cfg = _capacity_config(data, world, parallel, pad=name.endswith("pad"))
        workers(world).run(_train_rank, to_dict(cfg), str(root / name), str(data_dir))
        out[name] = _metrics(root / name)
    return out


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_with_the_same_competition_reproduce_one_process(capacity_runs, name):
    """The same tokens compete: the same drops (fraction logged per step, equal exactly) and losses
    within the dropless layouts' bound (measured worst 1.3e-8 relative; bound 1e-5). TP2 + SP routes
    each half of a sequence on its own rank with half the capacity: other assignments drop (first step
    33.8% against 32.4%) and its losses differ by more than that bound (measured 1.6e-4 relative)."""
    ref = capacity_runs["ref"]
    got = capacity_runs[name]
    _, _, same = LAYOUTS[name]
    assert all(0 < r["moe_dropped_fraction"] < 0.5 for r in ref)
    losses = [r["loss"] for r in got]
    if same:
        assert [r["moe_dropped_fraction"] for r in got] == [r["moe_dropped_fraction"] for r in ref]
        for field in ("moe_tokens_per_expert", "moe_dropped_fraction_per_layer"):  # counted after dropping
            assert [r[field] for r in got] == [r[field] for r in ref], field
        close(losses, [r["loss"] for r in ref], rtol=1e-5, site="capacity.layout_losses", case=name)
    else:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, [r["loss"] for r in ref]))
        assert [r["moe_dropped_fraction"] for r in got] != [r["moe_dropped_fraction"] for r in ref]
        assert worst > 1e-5, worst  # the bound the agreeing layouts meet would fail


def test_step_totals_count_a_forward_once_under_full_recompute():
    """The aux loss, drop and per-expert counts are summed per forward; the recompute of a checkpointed
    span during backward runs the forward again and must not count twice."""
    from fivefold.model import Decoder
    from fivefold.model.moe import layer_totals, reset_step_totals
    from fivefold.model.recompute import Recompute

    cfg = test_moe._model()
    cfg.moe_expert_capacity_factor = 1.0
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    totals = []
    for recompute in (Recompute(), Recompute("full", "uniform", 1)):
        torch.manual_seed(0)
        model = Decoder(cfg)
        model.set_recompute(recompute)
        reset_step_totals(model)
        model.loss(ids, ids)[0].backward()
        totals.append(layer_totals(model, cfg.num_layers, E))  # (layers, 3 + E)
    moe_rows = totals[0][cfg.moe_first_k_dense_layers:]
    assert torch.equal(totals[0][:cfg.moe_first_k_dense_layers], torch.zeros_like(totals[0][:1]))  # dense layers
    assert bool((moe_rows[:, 0] > 0).all()) and bool((moe_rows[:, 2] == 2 * 32 * K).all())
    assert torch.equal(moe_rows[:, 3:].sum(1), moe_rows[:, 2] - moe_rows[:, 1])  # every kept assignment, once
    assert torch.equal(totals[0], totals[1])
