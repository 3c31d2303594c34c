"""The MoE router's options (fivefold.model.router), each against a reference written from its formula
token by token, and DeepSeek-V3's router in transformers with the same weights and bias: score
functions (softmax, sigmoid, sqrtsoftplus), top-k scaling, router dtype, group-limited routing, the
expert bias (choice only, never the weights; its update from the step's load; recompute counted
once), forced load balancing; the bias balances a skewed router; and DP2 / TP2+SP / EP2 / CP2 / PP2
runs apply the one-process bias updates, with the bias saved in checkpoints (converted with them) so
a resume is exact."""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from _tol import close
from _train_util import corpus, one_process_context
from test_moe import (_config, _metrics, _one_thread, _train_rank, check_load_metrics, group_limited_margin,
                      router_margins)
from fivefold.checkpoint import io as ckpt
from fivefold.checkpoint.layout import step_dir
from fivefold.cli.train import prepare
from fivefold.config.schema import ModelConfig, to_dict
from fivefold.model import Decoder
from fivefold.model.recompute import maybe_checkpoint
from fivefold.model.router import Router, count_load, load_balancing_loss, route, update_expert_bias
from fivefold.train.loop import train

E, K, H = 16, 4, 32


def _cfg(**router) -> ModelConfig:
    return ModelConfig(hidden_size=H, num_attention_heads=4, num_experts=E, moe_router_topk=K, **router)


def _logits(n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, E, generator=torch.Generator().manual_seed(seed))


def _score(z: float, function: str, row: list[float]) -> float:
    if function == "softmax":
        return math.exp(z) / sum(math.exp(v) for v in row)
    if function == "sigmoid":
        return 1 / (1 + math.exp(-z))
    return math.sqrt(math.log1p(math.exp(z)))  # sqrtsoftplus


def _reference(row: list[float], cfg: ModelConfig, bias: list[float] | None = None) -> tuple[list[int], list[float]]:
    """One token's experts (best first) and weights, from the formulas of docs/moe.md, in float64."""
    f, k = cfg.moe_router_score_function, cfg.moe_router_topk
    p = [_score(z, f, row) for z in row]
    if f == "softmax":
        choice = p if cfg.moe_router_pre_softmax else row
    else:
        choice = [s + (bias[e] if bias else 0.0) for e, s in enumerate(p)]
    allowed = range(E)
    if cfg.moe_router_group_topk:
        size = E // cfg.moe_router_num_groups
        groups = [sorted(choice[g * size:(g + 1) * size], reverse=True) for g in range(cfg.moe_router_num_groups)]
        score = [sum(g[: k // cfg.moe_router_group_topk]) for g in groups]
        best = sorted(range(len(groups)), key=lambda g: -score[g])[: cfg.moe_router_group_topk]
        allowed = [e for e in range(E) if e // size in best]
    experts = sorted(allowed, key=lambda e: -choice[e])[:k]
    w = [p[e] for e in experts]
    if not cfg.moe_router_pre_softmax and k > 1:
        w = [v / sum(w) for v in w]
    return experts, [v * (cfg.moe_router_topk_scaling_factor or 1.0) for v in w]


CASES = {
    "softmax": dict(),
    "softmax-pre": dict(moe_router_pre_softmax=True),
    "sigmoid-scaled": dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
    "sqrtsoftplus": dict(moe_router_score_function="sqrtsoftplus"),
    "sqrtsoftplus-pre": dict(moe_router_score_function="sqrtsoftplus", moe_router_pre_softmax=True),
    "softmax-groups": dict(moe_router_num_groups=4, moe_router_group_topk=2),
    "sigmoid-groups-bias": dict(moe_router_score_function="sigmoid", moe_router_num_groups=8, moe_router_group_topk=4,
                                moe_router_enable_expert_bias=True),
    "sqrtsoftplus-groups-bias": dict(moe_router_score_function="sqrtsoftplus", moe_router_num_groups=4,
                                     moe_router_group_topk=1, moe_router_enable_expert_bias=True),
}


@pytest.mark.parametrize("case", CASES)
def test_routing_equals_the_formula_token_by_token(case):
    cfg = _cfg(**CASES[case])
    logits = _logits(seed=len(case))
    bias = torch.linspace(-0.15, 0.15, E).roll(5) if cfg.moe_router_enable_expert_bias else None
    experts, weights, _ = route(logits.double(), cfg, bias)
    for t, row in enumerate(logits.double().tolist()):
        want_e, want_w = _reference(row, cfg, bias.double().tolist() if bias is not None else None)
        assert experts[t].tolist() == want_e, (case, t)
        # float64 both sides, the same few ops in another order: ~1e-16; 1e-12 leaves 1e4 of room and
        # is 1e9 below a wrong formula's difference (a score or a normalisation off by >= 1e-3).
        close(weights[t], want_w, rtol=1e-12, site="router.weights_formula", case=f"{case} token {t}")


def test_group_limited_routing_never_leaves_the_chosen_groups():
    """Every chosen expert lies in one of the token's group_topk best groups (scored as the formula
    says), while plain top-k would have left them for most tokens: the limit is real."""
    cfg = _cfg(moe_router_score_function="sigmoid", moe_router_num_groups=8, moe_router_group_topk=2)
    logits = _logits(n=512, seed=7)
    experts, _, _ = route(logits, cfg)
    scores = torch.sigmoid(logits).view(-1, 8, 2)  # (n, G, E/G)
    best = scores.topk(K // 2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # (n, 2)
    assert bool((experts // 2).unsqueeze(-1).eq(best.unsqueeze(1)).any(-1).all())
    plain = logits.topk(K, dim=-1).indices
    left = (plain // 2).unsqueeze(-1).ne(best.unsqueeze(1)).all(-1).any(-1)  # a plain pick outside the groups
    assert left.float().mean() > 0.5


def test_expert_bias_changes_the_choice_not_the_weights():
    cfg = _cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    logits = _logits()
    bias = torch.zeros(E)
    bias[3] = 10.0  # larger than any score difference: every token takes expert 3 first
    experts, weights, aux = route(logits, cfg, bias)
    assert bool((experts[:, 0] == 3).all())
    s = torch.sigmoid(logits).gather(1, experts)
    torch.testing.assert_close(weights, s / s.sum(-1, keepdim=True), rtol=0, atol=0)  # the same ops: bit-equal
    torch.testing.assert_close(aux, torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True), rtol=0, atol=0)


def test_aux_loss_counts_the_plain_top_k_as_megatron():
    """With the bias (or groups) the aux loss still counts the top-k of the normalised scores q, not
    the biased choice (Megatron's compute_routing_scores_for_aux_loss)."""
    cfg = _cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.1)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
        router.expert_bias[3] = 10.0
    x = torch.randn(32, H, generator=torch.Generator().manual_seed(2))
    got = router(x, 1, None).loss
    q = torch.sigmoid(x @ router.weight.T)
    q = q / q.sum(-1, keepdim=True)
    f = torch.zeros(E).index_add_(0, q.topk(K).indices.reshape(-1), torch.ones(32 * K)) / (K * 32)
    close(got, 0.1 * E * (f * q.mean(0)).sum(), rtol=1e-6, site="router.aux_loss_plain_topk")
    biased = load_balancing_loss(q, route(x @ router.weight.T, cfg, router.expert_bias)[0], cfg, None, 1)
    assert abs(float((biased - got).detach())) > 1e-3  # counting the biased choice instead is visibly different


@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers_deepseek_v3(norm):
    """DeepseekV3TopkRouter (sigmoid, e_score_correction_bias, n_group / topk_group, top-2 per group
    = our k // group_topk with k=4, group_topk=2, routed_scaling_factor) with our weight and bias;
    norm_topk_prob=False is our moe_router_pre_softmax with sigmoid scores."""
    cfg = _cfg(moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
               moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True, moe_router_pre_softmax=not norm)
    ours = Router(cfg)
    theirs = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=4,
                                                   topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=norm))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ours.weight.normal_(0, 0.3, generator=g)
        ours.expert_bias.uniform_(-0.1, 0.1, generator=g)
        theirs.weight.copy_(ours.weight)
        theirs.e_score_correction_bias.copy_(ours.expert_bias)
    x = torch.randn(256, H, generator=g)
    mine = ours(x, 1, None)
    _, their_w, their_e = theirs(x)
    order = their_e.sort(-1)  # HF's top-k is unsorted: compare per expert
    assert torch.equal(mine.experts.sort(-1).values, order.values)
    # Same fp32 ops in another order (HF sums the top-2 of a group by topk, divides in place): measured
    # 2.1e-7 relative (AVX-512 and AVX2 natively), 2.7e-7 under ATEN_CPU_CAPABILITY=default on AVX2
    # bound 3e-6 (11x).
    close(mine.weights.gather(1, mine.experts.sort(-1).indices), their_w.gather(1, order.indices), rtol=3e-6,
          site="router.hf_deepseek_v3", case=f"norm_topk_prob={norm}")


def test_router_dtype():
    """fp64: the linear and the weights in float64 (the float64 formula to 1e-15); fp32 with bf16
    parameters: the linear on fp32 copies (not rounded to bf16 first); unset: the weights back in the
    parameters' dtype, as the experts' sum takes them."""
    cfg = _cfg(moe_router_score_function="sigmoid")
    router = Router(replace(cfg, moe_router_dtype="fp64"))
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
    x = torch.randn(16, H, generator=torch.Generator().manual_seed(5))
    r64 = router(x, 1, None)
    assert r64.weights.dtype == torch.float64
    want = torch.tensor([_reference(row, cfg)[1] for row in (x.double() @ router.weight.double().T).tolist()],
                        dtype=torch.float64)
    close(r64.weights, want, rtol=1e-15, atol=1e-15, site="router.fp64")
    router = router.to(torch.bfloat16)
    xb = x.bfloat16()
    for dtype, weights_dtype in (("fp32", torch.float32), (None, torch.bfloat16)):
        router.cfg = replace(cfg, moe_router_dtype=dtype)
        r = router(xb, 1, None)
        assert r.weights.dtype == weights_dtype
        if dtype == "fp32":
            logits = xb.float() @ router.weight.float().T
            want = torch.sigmoid(logits).gather(1, r.experts)
            torch.testing.assert_close(r.weights, want / want.sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_force_load_balancing_routes_by_random_logits_and_passes_the_gradient():
    cfg = _cfg(moe_router_force_load_balancing=True, moe_router_pre_softmax=True)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0] = 1.0  # without forcing, every token would pick expert 0
    x = torch.rand(4096, H, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(11)
    r = router(x, 1, None)
    torch.manual_seed(11)
    drawn = torch.randn(4096, E)
    assert torch.equal(r.experts, drawn.softmax(-1).topk(K).indices)
    load = torch.bincount(r.experts.reshape(-1), minlength=E).double()
    # k/E of 4096 tokens = 1024 per expert; a binomial's 4 sigma is ~120
    assert float((load - 1024).abs().max()) < 130
    r.weights.sum().backward()
    s = drawn.softmax(-1)
    dz = s * (torch.zeros(4096, E).scatter_(1, r.experts, 1.0) - s.gather(1, r.experts).sum(-1, keepdim=True))
    # Straight through: dL/dW = (dL/dz)^T x with dL/dz of the drawn logits. fp32 sums over 4096 tokens in
    # another order: measured 4.9e-7 of |W.grad| ~ 1; bound 1e-5. Zero (no pass-through) or the softmax of
    # the real logits' gradient is off by ~1.
    close(router.weight.grad, dz.T @ x, rtol=1e-5, atol=1e-5, site="router.force_balance_grad")


def _route_and_count(router: Router, x: torch.Tensor) -> torch.Tensor:
    """As MoE.forward: route, then count the assignments kept (here all, no capacity) for the bias."""
    routing = router(x, 1, None)
    count_load(router, routing.experts)
    return routing.weights


def test_expert_bias_update_from_the_load_counted_once():
    """Two training micro-batches (one through activation recompute) count each routed token once;
    eval and no-grad forwards count nothing; the update is rate * sign(mean - load) per expert."""
    cfg = _cfg(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
               moe_router_bias_update_rate=0.01)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(8))
    xs = [torch.randn(24, H, generator=torch.Generator().manual_seed(9 + i), requires_grad=True) for i in range(2)]
    hits = torch.zeros(E, dtype=torch.int64)
    forward = partial(_route_and_count, router)
    for i, x in enumerate(xs):
        r = maybe_checkpoint(forward, i == 1, x)
        r.sum().backward()  # the checkpointed one reruns the router here
        hits += torch.bincount(route(x.detach() @ router.weight.detach().T, cfg, router.expert_bias)[0].reshape(-1),
                               minlength=E)
    with torch.no_grad():
        forward(xs[0])
    router.eval()
    forward(xs[0])
    router.train()
    assert torch.equal(router.tokens_per_expert, hits) and int(hits.sum()) == 2 * 24 * K
    update_expert_bias([router], None)
    want = 0.01 * torch.sign(hits.double().mean() - hits.double())
    torch.testing.assert_close(router.expert_bias, want.float(), rtol=0, atol=0)
    assert int(router.tokens_per_expert.abs().sum()) == 0


def test_expert_bias_stays_fp32_and_zero_after_meta_build():
    cfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=64, num_experts=E,
                      moe_router_topk=K, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    model = Decoder(cfg)  # built on the meta device, then materialised: buffers are set explicitly
    buffers = dict(model.named_buffers())
    assert sorted(buffers) == [f"layers.{i}.mlp.router.{b}" for i in (0, 1)
                               for b in ("expert_bias", "tokens_per_expert")]
    assert all(int(b.abs().sum()) == 0 for b in buffers.values())
    model.get_submodule("layers.0.mlp.router").expert_bias.fill_(1e-3)
    model.to(torch.bfloat16)
    bias = model.get_submodule("layers.0.mlp.router").expert_bias
    assert bias.dtype == torch.float32 and float(bias[0]) == pytest.approx(1e-3, rel=1e-7)  # not rounded via bf16


def test_expert_bias_balances_a_skewed_router():
    """Aux-loss-free balancing alone (the router's weights frozen): 50 steps of 4 micro-batches x 256
    tokens with DeepSeek-V3's rate 1e-3 take the busiest expert's load from 1.97x the mean to 1.24x
    (measured)."""
    cfg = ModelConfig(hidden_size=H, num_attention_heads=4, num_experts=8, moe_router_topk=2,
                      moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router = Router(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.normal_(0, 0.05, generator=g)
        router.weight[:, 0] += torch.linspace(0.3, -0.3, 8)  # feature 0 (mean 1 below) favours the low experts
    x = torch.randn(4, 256, H, generator=g)
    x[..., 0] += 1.0
    imbalance = []
    for _ in range(50):
        for mb in x:
            _route_and_count(router, mb)
        load = router.tokens_per_expert.double()
        imbalance.append(float(load.max() / load.mean()))
        update_expert_bias([router], None)
    assert imbalance[0] > 1.9 and imbalance[-1] < 1.3
    assert float(router.expert_bias.abs().max()) <= 50 * 1e-3 + 1e-6


# --- layouts: the same bias updates and losses as one process; the bias in checkpoints -----------------

ROUTER = dict(moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
              moe_router_topk_scaling_factor=2.0, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2)
"""test_moe's model (4 experts, top-2, aux and z losses) routed as DeepSeek-V3 (2 groups, 1 chosen);
rate 1e-2 so that the bias moves routing within the run."""
STEPS = 4
LAYOUTS = {"dp2": {}, "tp2sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "ep2": dict(expert_model_parallel_size=2), "cp2": dict(context_parallel_size=2),
           "pp2": dict(pipeline_model_parallel_size=2)}


def _router_config(data, world: int = 1, parallel: dict | None = None):
    cfg = _config(data, world, parallel)
    for k, v in ROUTER.items():
        setattr(cfg.model, k, v)
    cfg.training.train_iters = STEPS
    return cfg


def _biases(folder) -> dict[str, torch.Tensor]:
    """The expert biases of a checkpoint, loaded into the one-process model."""
    model = Decoder(_router_config(".").model)
    ckpt.load_checkpoint(folder, model=model, optimizer=None, rank=0, world_size=1)
    return {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}


@pytest.fixture(scope="module")
def biased_runs(tmp_path_factory, workers):
    root = tmp_path_factory.mktemp("router")
    data = corpus(root / "corpus")
    ref_cfg = _router_config(data)
    ref_cfg.checkpoint.save_interval = 2  # step_2 for the resume test, step_4 at the end
    data_dir = prepare(ref_cfg, root)
    (root / "ref").mkdir()
    with router_margins(group_limited_margin) as margins, _one_thread():
        ref = train(ref_cfg, one_process_context(root / "ref"), data_dir, progress=False)
    out = {"root": root, "data": data, "data_dir": data_dir, "ref": ref, "margin": min(margins)}
    for name, parallel in LAYOUTS.items():
        out[name] = workers(2).run(_train_rank, to_dict(_router_config(data, 2, parallel)), str(root / name),
                                   str(data_dir))
    return out


def test_biased_routing_margins_are_far_above_fp32_noise(biased_runs):
    # Every group choice of the reference run (2 groups of 2 experts, top-2: the chosen group's both)
    # wins by more than 3e-6, 50x the fp32 noise on sigmoid scores ~0.5 (~6e-8): measured 6.2e-6 (this
    # machine, the tests' runs without a warm-up). The layouts below then route alike, so their loads,
    # hence biases, are equal.
    assert biased_runs["margin"] > 3e-6, biased_runs["margin"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_applies_the_one_process_bias_updates(biased_runs, name):
    root, ref = biased_runs["root"], biased_runs["ref"]
    want = _biases(root / "ref" / "checkpoints")
    assert sum(int((b != 0).sum()) for b in want.values()) >= 8  # measured 8 of 12 entries off zero after 4 steps
    # The loads are integers summed over the whole step on TP x CP x DP: the same on every layout, so
    # the same sign steps on the same fp32 bias: bit-equal. (Planted, DP2 updating from each rank's own
    # micro-batches only: 4 of the 12 entries differ, and the step-2 loss by 1.4e-4.)
    got = _biases(root / name / "checkpoints")
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    for rank, r in enumerate(biased_runs[name]):
        # Tolerance: test_moe's layout bound (fp32 sums reordered by DP / TP / SP / EP / CP; 9.7e-7 measured
        # there with TP on AVX-512), measured worst here 4.2e-8 (tp2sp); bound 1e-5.
        close(list(r["losses"].values()), list(ref.losses.values()), rtol=1e-5, site="router.layout_losses",
              case=f"{name} rank {rank}")
    # Same cause, measured worst 5.9e-7 (cp2); bound 5e-6 as test_moe's.
    close([m["moe_aux_loss"] for m in _metrics(root / name)], [m["moe_aux_loss"] for m in _metrics(root / "ref")],
          rtol=5e-6, site="router.layout_aux_loss", case=name)
    check_load_metrics(_metrics(root / name), _metrics(root / "ref"), name)  # the logged loads, exactly


def test_logged_loads_are_the_loads_the_bias_moved_by(biased_runs):
    """The tokens per expert in metrics.jsonl are the loads of the bias update: replaying
    b_e += rate * sign(mean load - load_e) over the logged steps gives the checkpoint's bias exactly."""
    rate = ROUTER["moe_router_bias_update_rate"]
    rows = _metrics(biased_runs["root"] / "ref")
    assert [r["step"] for r in rows] == list(range(STEPS))
    for name, bias in _biases(biased_runs["root"] / "ref" / "checkpoints").items():
        layer = name.split(".")[1]
        replay = torch.zeros_like(bias)
        for r in rows:
            load = torch.tensor(r["moe_tokens_per_expert"][layer], dtype=torch.float64)
            replay += torch.sign(load.mean() - load).float() * rate
        assert torch.equal(replay, bias), name


def test_resume_continues_with_the_saved_bias(biased_runs):
    """Resumed from the reference's step-2 checkpoint, steps 2 and 3 repeat the reference's losses and
    end at its bias, bit for bit (a bias restarting at zero changes the step-2 loss by 1.3e-3)."""
    root = biased_runs["root"]
    cfg = _router_config(biased_runs["data"])
    cfg.checkpoint.load = str(step_dir(root / "ref" / "checkpoints", 2))
    out = root / "resume"
    out.mkdir()
    with _one_thread():
        resumed = train(cfg, one_process_context(out), biased_runs["data_dir"], progress=False)
    assert resumed.losses == {s: biased_runs["ref"].losses[s] for s in (2, 3)}
    want, got = _biases(root / "ref" / "checkpoints"), _biases(out / "checkpoints")
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_convert_carries_the_bias(biased_runs, tmp_path):
    """`fivefold convert` to EP2 x PP2 writes each stage's biases (whole, no optimizer state); they load
    back into one process equal to the source's."""
    from fivefold.cli import main

    src = biased_runs["root"] / "ref" / "checkpoints"
    assert main(["convert", str(src), str(tmp_path), "--expert-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--world-size", "4"]) == 0
    want, got = _biases(src), _biases(tmp_path)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_weight_sync_refuses_the_expert_bias():
    """Engine weight sync copies parameters only: with an expert bias the inference copy would route
    without it, so it is refused (not built yet) before any rank communicates."""
    from fivefold.engine.sync import sync_weights
    from fivefold.errors import NotImplementedYet

    cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=4, vocab_size=64, num_experts=E,
                      moe_router_topk=K, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    with pytest.raises(NotImplementedYet, match="layers.0.mlp.router.expert_bias"):
        sync_weights(Decoder(cfg), Decoder(cfg))


def test_checkpoints_with_and_without_the_bias_load_both_ways(tmp_path, capsys):
    """Switching the expert bias on at a resume: the checkpoint's parameters load and the bias starts at
    zero, with a warning; a checkpoint with the bias loads into a model without it (the bias ignored)."""
    plain = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=4, vocab_size=64, num_experts=E,
                        moe_router_topk=K, moe_router_score_function="sigmoid")
    biased = replace(plain, moe_router_enable_expert_bias=True)
    for cfg, folder in ((plain, tmp_path / "plain"), (biased, tmp_path / "biased")):
        model = Decoder(cfg, seed=1)
        for b in model.buffers():
            b.fill_(1)
        ckpt.save_checkpoint(folder, 1, model=model, optimizer=torch.optim.AdamW(model.parameters()), rank=0,
                             writes_params=True, barrier=lambda: None, extra={})
    into_biased, into_plain = Decoder(biased, seed=2), Decoder(plain, seed=2)
    ckpt.load_checkpoint(tmp_path / "plain", model=into_biased, optimizer=None, rank=0, world_size=1)
    assert "saved without 1 buffer(s) of this model (first: layers.0.mlp.router.expert_bias)" in capsys.readouterr().err
    assert int(into_biased.get_submodule("layers.0.mlp.router").expert_bias.abs().sum()) == 0
    ckpt.load_checkpoint(tmp_path / "biased", model=into_plain, optimizer=None, rank=0, world_size=1)
    for (n, p), q in zip(into_biased.named_parameters(), into_plain.parameters()):
        assert torch.equal(p, q), n  # both hold the seed-1 weights now


def test_expert_counts_equal_torch_bincount():
    """fivefold.ops.counting.bincount (no host sync on CUDA) against torch.bincount: empty experts,
    a 2-D index tensor, no indices at all."""
    from fivefold.ops.counting import bincount
    idx = torch.tensor([[3, 0], [3, 5], [0, 3]])
    assert torch.equal(bincount(idx, 8), torch.bincount(idx.reshape(-1), minlength=8))
    assert torch.equal(bincount(idx[:0], 4), torch.zeros(4, dtype=torch.int64))
