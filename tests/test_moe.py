"""MoE training is layout invariant: EP2, EP4, EP2 x EDP2, TP2+SP x EP2 (ETP1 and ETP2), TP2+SP with
ETP2, TP2 without SP (ETP2), EP2 x EDP2 with ZeRO-1 and PP2 x EP2 give the losses, gradient norms,
logged aux losses and final weights of the one-process run on the same micro-batches (aux and z
losses on, shared experts, a dense first layer); EP checkpoints load at EP1; the EP / ETP bytes
equal the formula of docs/moe.md from the actual routing."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from _tol import close, within
from _train_util import corpus, one_process_context
from fivefold.checkpoint import io as ckpt
from fivefold.cli.train import prepare
from fivefold.config.schema import ClusterConfig, Config, DataConfig, ModelConfig, TrainingConfig, to_dict
from fivefold.config.validate import layout_of
from fivefold.model import Decoder
from fivefold.model.router import Router
from fivefold.runtime import comm, traffic
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout
from fivefold.train.context import RankContext
from fivefold.train.loop import train
from fivefold.config.schema import config_from_dict

STEPS, E, K, H = 3, 4, 2, 64

# name -> (world, parallel settings, zero)
LAYOUTS = {
    "ep2": (2, dict(expert_model_parallel_size=2), False),
    "ep4": (4, dict(expert_model_parallel_size=4), False),
    "ep2-edp2": (4, dict(expert_model_parallel_size=2), False),
    "tp2sp-ep2-etp1": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
                               expert_tensor_parallel_size=1), False),
    "tp2sp-ep2-etp2": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2),
                       False),  # ETP defaults to TP: ETP2 x EP2 x EDP1
    "tp2sp-etp2": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2), False),
    "tp2-etp2-nosp": (2, dict(tensor_model_parallel_size=2), False),  # the MoE layer splits the sequence itself
    "ep2-edp2-zero": (4, dict(expert_model_parallel_size=2), True),
    "pp2-ep2": (4, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2), False),
    "tp2sp-ep2-etp2-grouped": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                       expert_model_parallel_size=2), False),  # moe_grouped_gemm: one matmul per projection
}


def _model() -> ModelConfig:
    """4 layers: a dense first layer, then MoE with 4 experts, top-2, shared experts, aux and z losses."""
    return ModelConfig(num_layers=4, hidden_size=H, num_attention_heads=4, num_query_groups=2, vocab_size=256,
                       ffn_hidden_size=96, num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=32,
                       moe_shared_expert_intermediate_size=32, moe_first_k_dense_layers=1, moe_aux_loss_coeff=1e-2,
                       moe_z_loss_coeff=1e-3, init_method_std=0.05)


def _config(data: Path, world: int = 1, parallel: dict | None = None, zero: bool = False) -> Config:
    cfg = Config(cluster=ClusterConfig(world_size=world), model=_model(),
                 training=TrainingConfig(seq_length=64, global_batch_size=8, micro_batch_size=1, train_iters=STEPS,
                                         lr=3e-3, lr_warmup_iters=0, clip_grad=0.5, use_distributed_optimizer=zero),
                 data=DataConfig(path=str(data), eval_fraction=0.1))
    cfg.logging.moe_per_layer_logging = True  # tokens per expert of every MoE layer in metrics.jsonl
    for k, v in (parallel or {}).items():
        setattr(cfg.parallel, k, v)
    return cfg


@contextlib.contextmanager
def _one_thread():
    """One-process runs in the test process with one intra-op thread, as every worker rank has: on a
    shared 2-core machine the default threads made the reference run 6x slower (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_rank(rank: int, world: int, config: dict, out: str, data_dir: str) -> dict:
    cfg = config_from_dict(config)
    Path(out).mkdir(parents=True, exist_ok=True)
    result = train(cfg, RankContext(Mesh.build(layout_of(cfg)), Path(out)), Path(data_dir), progress=False)
    return {"losses": result.losses}


def softmax_margin(router: Router, x: torch.Tensor) -> float:
    """The smallest gap, over a router call's tokens, between the k-th and (k+1)-th softmax score."""
    scores = torch.softmax(torch.nn.functional.linear(x, router.weight).detach().float(), -1)
    return float(scores.topk(router.cfg.moe_router_topk + 1).values.diff(dim=-1)[:, -1].abs().min())


def group_limited_margin(router: Router, x: torch.Tensor) -> float:
    """The smallest gap, over a router call's tokens, between a chosen and an unchosen candidate of
    group-limited top-k on sigmoid scores + the expert bias (fivefold.model.router.top_k, written out
    again): the g-th and (g+1)-th group scores (the sum of a group's top k/g), and the k-th and
    (k+1)-th choice among the chosen groups' experts (inf where the chosen groups hold only k)."""
    cfg = router.cfg
    k, g = cfg.moe_router_topk, cfg.moe_router_group_topk
    choice = torch.sigmoid(torch.nn.functional.linear(x.detach().float(), router.weight.detach().float()))
    per_group = (choice + router.expert_bias).view(choice.shape[0], cfg.moe_router_num_groups, -1)
    group_scores = per_group.topk(k // g, dim=-1).values.sum(-1)  # (n, G)
    groups = group_scores.sort(dim=-1, descending=True).values
    out = per_group.masked_fill((group_scores < groups[:, g - 1:g]).unsqueeze(-1), float("-inf"))
    inside = out.flatten(1).sort(dim=-1, descending=True).values
    return min(float((groups[:, g - 1] - groups[:, g]).min()), float((inside[:, k - 1] - inside[:, k]).min()))


@contextlib.contextmanager
def router_margins(margin=softmax_margin):
    """The routing margin (`margin(router, input)`) of every router call of the runs trained in this
    process inside the block, training and evaluation forwards alike, appended to the list it yields."""
    import fivefold.train.loop as loop
    margins: list[float] = []
    build = loop.build

    def build_recording(config, ctx, **kw):
        parts = build(config, ctx, **kw)
        for m in parts.model.modules():
            if isinstance(m, Router):
                m.register_forward_hook(lambda m, args, out: margins.append(margin(m, args[0])))
        return parts
    loop.build = build_recording
    try:
        yield margins
    finally:
        loop.build = build


@pytest.fixture(scope="module")
def runs(tmp_path_factory, workers):
    root = tmp_path_factory.mktemp("moe")
    data = corpus(root / "corpus")
    ref_cfg = _config(data)
    data_dir = prepare(ref_cfg, root)
    (root / "ref").mkdir()
    with router_margins() as margins, _one_thread():
        ref = train(ref_cfg, one_process_context(root / "ref"), data_dir, progress=False)
    out = {"root": root, "data": data, "data_dir": data_dir, "ref": ref, "margin": min(margins)}
    for name, (world, parallel, zero) in LAYOUTS.items():
        cfg = _config(data, world, parallel, zero)
        cfg.model.moe_grouped_gemm = name.endswith("-grouped")  # against the reference's per-expert loop
        out[name] = workers(world).run(_train_rank, to_dict(cfg), str(root / name), str(data_dir))
    return out


def test_routing_margins_are_far_above_fp32_noise(runs):
    # Every token's k-th and (k+1)-th router scores (~0.25) differ by more than 1e-5 in the reference
    # run, 100x the fp32 noise (~1e-7) that reordered sums put on them: routing cannot flip between
    # layouts, so the comparisons below compare the same discrete routing.
    assert runs["margin"] > 1e-5


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_reproduces_one_process_run(runs, name):
    ref, root = runs["ref"], runs["root"]
    for rank, r in enumerate(runs[name]):
        assert list(r["losses"]) == list(range(STEPS))
        # Tolerance (docs/tolerances.md): EP / TP / SP / PP / DP reorder fp32 sums (expert matmuls over
        # other row batches, all-to-alls, row-parallel partial sums, gradient reductions): step 0 agrees
        # to 3e-8. AdamW's first update is ~lr * sign(g), so gradient elements that cancel to ~0 take
        # ulp-level noise into whole-lr weight differences: with TP the later losses drift to 9.7e-7
        # (measured worst, tp2sp-ep2-etp1, AVX-512; EP-only layouts <= 8e-8). Bound 1e-5: 10x that. A
        # router gradient left unsummed over TP (planted) moves the losses by 4.7e-5..7.5e-5.
        close(list(r["losses"].values()), list(ref.losses.values()), rtol=1e-5, site="moe.losses", case=f"{name} rank {rank}")
    # The norm counts every dense shard, every expert (ETP slice) and every ZeRO chunk once; clipping
    # is active (clip_grad=0.5). Same cause: measured worst 1.3e-6 (tp2sp-ep2-etp1, step 2; step 0:
    # 1.4e-8); bound 2e-5, 15x. The planted unsummed router gradient moves it by 4.7e-5 at step 0.
    close([m["grad_norm"] for m in _metrics(root / name)], [m["grad_norm"] for m in _metrics(root / "ref")],
          rtol=2e-5, site="moe.grad_norm", case=name)
    ref_aux = [m["moe_aux_loss"] for m in _metrics(root / "ref")]  # the logged aux loss, also through PP
    assert all(a > 0 for a in ref_aux)
    # Same fp32 noise, measured worst 3.3e-7 (tp2sp-ep2-etp1); bound 5e-6, 15x. Counting a TP
    # shard's, a micro-batch's or a stage's term twice or not at all is >= 1e-1 off.
    close([m["moe_aux_loss"] for m in _metrics(root / name)], ref_aux, rtol=5e-6, site="moe.aux_loss", case=name)
    check_load_metrics(_metrics(root / name), _metrics(root / "ref"), name)
    # The final weights, every expert included: the layout's checkpoint loaded into one process (the
    # experts of all EP ranks / ETP slices / PP stages reassemble by name) equals the reference's.
    cfg = _config(runs["data"])
    mine, theirs = Decoder(cfg.model), Decoder(cfg.model)
    for model, folder in ((mine, root / name), (theirs, root / "ref")):
        ckpt.load_checkpoint(folder / "checkpoints", model=model, optimizer=None, rank=0, world_size=1)
    for (n, p), q in zip(mine.named_parameters(), theirs.parameters()):
        # Tolerance: Adam's m / sqrt(v) turns ulp-level gradient differences of elements that are
        # cancellations near 0 into update differences up to lr = 3e-3. Measured worst element 1.2e-4
        # (head.weight, tp2sp-ep2-etp1); bound 2e-3, 17x. In norm the differences stay small (worst
        # 1.8e-5 relative; bound 2e-4, 11x), while a wrong expert's update is off by ~lr in every
        # element of weights ~5e-2: ~1e-1 of the weight's norm.
        close(p, q, rtol=0, atol=2e-3, site="moe.final_weights", case=f"{name} {n}")
        within((p - q).norm() / q.norm(), 2e-4, site="moe.final_weights_norm", case=f"{name} {n}")


def check_load_metrics(got: list[dict], ref: list[dict], name: str) -> None:
    """The per-layer load metrics of a layout equal the one-process run's: the tokens per expert are
    integers summed over every rank and micro-batch, so equal exactly (routing cannot flip:
    test_routing_margins_are_far_above_fp32_noise), hence the imbalances too; the per-layer aux
    losses within 2e-5 (fp32 noise, measured worst 3.3e-7 on AVX-512, 1.3e-6 on AVX2: cp2;
    15x; a term counted twice or not at all is >= 1e-1 off)."""
    for field in ("moe_tokens_per_expert", "moe_load_imbalance_per_layer", "moe_load_imbalance"):
        assert [m[field] for m in got] == [m[field] for m in ref], (name, field)
    for m, r in zip(got, ref):
        close(list(m["moe_aux_loss_per_layer"].values()), list(r["moe_aux_loss_per_layer"].values()), rtol=2e-5,
              site="moe.aux_loss_per_layer", case=name)


def test_reference_load_metrics_count_every_assignment(runs):
    """One process: every MoE layer (not the dense first one) logs the step's k assignments of each of
    its global_batch x seq tokens spread over its experts, and the aux losses of the layers add up to
    moe_aux_loss; the heatmap of the run is written."""
    cfg = _config(runs["data"])
    for m in _metrics(runs["root"] / "ref"):
        loads = m["moe_tokens_per_expert"]
        assert sorted(loads, key=int) == ["1", "2", "3"]
        assert all(sum(v) == cfg.training.global_batch_size * cfg.training.seq_length * K for v in loads.values())
        assert all(max(v) / (sum(v) / E) == pytest.approx(m["moe_load_imbalance_per_layer"][k], rel=1e-12)
                   for k, v in loads.items())
        assert m["moe_load_imbalance"] == max(m["moe_load_imbalance_per_layer"].values()) > 1
        assert sum(m["moe_aux_loss_per_layer"].values()) == pytest.approx(m["moe_aux_loss"], rel=1e-12)
    assert (runs["root"] / "ref" / "expert_load.png").stat().st_size > 0


def test_plot_command_redraws_a_runs_pictures(runs, tmp_path, capsys):
    """`fivefold plot RUN` draws the loss curve and the expert-load heatmap again from the run's
    metrics.jsonl; a file that is not a run's metrics, an unknown picture, or a heatmap asked of a run
    without per-layer loads is refused naming the fix."""
    from fivefold.cli import main

    ref = runs["root"] / "ref"
    assert main(["plot", str(ref), "--out", str(tmp_path / "again")]) == 0
    for png in ("loss.png", "expert_load.png"):
        assert (tmp_path / "again" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    flat = tmp_path / "flat.jsonl"  # the same run without its per-layer fields
    flat.write_text("".join(json.dumps({k: v for k, v in m.items() if not k.endswith(("_per_layer", "_per_expert"))})
                            + "\n" for m in _metrics(ref)))
    assert main(["plot", str(flat), "--out", str(tmp_path / "flat")]) == 0
    assert "no expert_load.png" in capsys.readouterr().out
    assert not (tmp_path / "flat" / "expert_load.png").exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"step": 1, "loss": 2.0}\n{"step": 2,\n')
    for argv, words in ((["plot", str(flat), "--what", "expert-load"], "--moe-per-layer-logging"),
                        (["plot", str(ref), "--what", "losses"], "choose from loss, rl, expert-load"),
                        (["plot", str(broken)], "broken.jsonl:2: malformed JSON line"),
                        (["plot", str(tmp_path / "nowhere")], "no such file")):
        assert main(argv) == 2, argv
        assert words in capsys.readouterr().err, argv


def test_ep2_checkpoint_resumes_at_ep1(runs):
    """The EP2 x EDP2 run's final checkpoint (each expert written once, by its EDP replica 0) loads
    on one process and gives the reference's next loss."""
    cfg = _config(runs["data"])
    cfg.training.train_iters = STEPS + 1
    cfg.checkpoint.load = str(runs["root"] / "ep2-edp2" / "checkpoints")
    out = runs["root"] / "resume"
    out.mkdir()
    cfg2 = _config(runs["data"])
    cfg2.training.train_iters = STEPS + 1
    cfg2.checkpoint.load = str(runs["root"] / "ref" / "checkpoints")
    out2 = runs["root"] / "resume-ref"
    out2.mkdir()
    with _one_thread():
        resumed = train(cfg, one_process_context(out), runs["data_dir"], progress=False).losses
        expected = train(cfg2, one_process_context(out2), runs["data_dir"], progress=False).losses
    # Tolerance: the two checkpoints differ by the EP layout's fp32 noise (see above): measured 8.3e-8;
    # bound 1e-6, 12x.
    assert list(resumed) == [STEPS]
    close(resumed[STEPS], expected[STEPS], rtol=1e-6, site="moe.resume_ep2_at_ep1")


def test_pipeline_stage_without_experts_trains_like_one_process(runs, workers):
    """TP2+SP x PP2 x EP2 with ZeRO-1 where the first stage holds only dense layers
    (moe_first_k_dense_layers=2): that stage has no expert parameters but still takes part in the
    expert domain's gradient-norm collectives (fivefold.parallel.data.data_parallel), so the run neither
    hangs nor miscounts the norm."""
    root = runs["root"]
    cfg = _config(runs["data"], 4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                        pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                                        expert_tensor_parallel_size=1), True)
    ref_cfg = _config(runs["data"])
    for c in (cfg, ref_cfg):
        c.model.moe_first_k_dense_layers = 2
    (root / "dense-stage-ref").mkdir()
    with _one_thread():
        ref = train(ref_cfg, one_process_context(root / "dense-stage-ref"), runs["data_dir"], progress=False)
    out = workers(4).run(_train_rank, to_dict(cfg), str(root / "dense-stage"), str(runs["data_dir"]))
    # Tolerance: the layout tests' (fp32 sums reordered by TP / SP / EP / PP / ZeRO-1).
    for r in out:
        assert list(r["losses"].values()) == pytest.approx(list(ref.losses.values()), rel=1e-6, abs=0)
    assert [m["grad_norm"] for m in _metrics(root / "dense-stage")] == pytest.approx(
        [m["grad_norm"] for m in _metrics(root / "dense-stage-ref")], rel=2e-6, abs=0)


# --- the exact all-to-all bytes, from the routing of one micro-batch -----------------------------------

def _bytes_rank(rank: int, world: int, layout: dict) -> dict:
    lay = Layout(**layout)
    mesh = Mesh.build(lay)
    cfg = _model()
    model = Decoder(cfg, mesh=mesh, sequence_parallel=lay.tp > 1, seed=1)
    routed: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda mod, args, out: routed.append(out.experts))
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(mesh.dp.rank))
    traffic.reset()
    total, count = model.loss(ids, ids)
    total.backward()
    got = {k: traffic.bytes(kind=k, tag=t) for k, t in (("all_to_all", "ep"), ("all_gather", "etp"),
                                                        ("reduce_scatter", "etp"))}
    calls = traffic.calls(kind="all_to_all", tag="ep")
    layers = []
    for experts in routed:  # per MoE layer: rows this rank routes, and rows every EP rank sends each expert
        counts = torch.bincount(experts.reshape(-1), minlength=E)  # (E,)
        every = comm.all_gather(counts.unsqueeze(0), 0, mesh.ep, "test")  # (ep, E)
        mine = list(range(mesh.ep.rank * E // lay.ep, (mesh.ep.rank + 1) * E // lay.ep))
        received = int(every[:, mine].sum())  # R
        etp_rows = comm.all_gather(torch.tensor([received]), 0, mesh.etp, "test")  # R of each ETP rank
        layers.append({"n": experts.shape[0], "R": received, "Rmax": int(etp_rows.max()), "E_loc": len(mine)})
    return {"got": got, "calls": calls, "layers": layers}


@pytest.mark.parametrize("layout", [dict(dp=2, ep=2), dict(tp=2, etp=2)], ids=["ep2", "tp2-etp2"])
def test_all_to_all_bytes_equal_the_formula(workers, layout):
    lay = Layout(**layout)
    for r in workers(lay.world_size).run(_bytes_rank, layout):
        hb = H * 4  # fp32 rows
        moe_layers = r["layers"]
        assert len(moe_layers) == 3  # layers 1..3
        if lay.ep > 1:
            # per MoE layer: count exchange 8E + dispatch n*k rows + combine R rows, and the backward's two
            # all-to-alls with the splits swapped (R rows, then n*k rows): 8E + 2 (n k + R) h B
            want = sum(8 * E + 2 * (x["n"] * K + x["R"]) * hb for x in moe_layers)
            assert r["got"]["all_to_all"] == want and r["calls"] == 5 * len(moe_layers)
        else:
            assert r["got"]["all_to_all"] == 0
        if lay.etp > 1:
            # per MoE layer: count all-gather 8 E_loc etp + rows all-gather etp Rmax h B (forward) and the
            # partial outputs' all-gather in backward; reduce-scatters: forward output, backward of the gather
            ag = sum(8 * x["E_loc"] * lay.etp + 2 * lay.etp * x["Rmax"] * hb for x in moe_layers)
            rs = sum(2 * lay.etp * x["Rmax"] * hb for x in moe_layers)
            assert (r["got"]["all_gather"], r["got"]["reduce_scatter"]) == (ag, rs)


# --- the router's losses by hand, the examples, what is refused ----------------------------------------

def test_router_losses_by_hand():
    """aux_loss, seq_aux_loss and z_loss of a 2-sequence x 3-token micro-batch, written out."""
    from fivefold.model.router import load_balancing_loss, route, z_loss

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5], [1.0, 0.0, 2.5, 0.0],
                           [0.2, 0.1, 0.0, 1.5], [2.0, 0.0, 1.0, 0.0], [0.0, 0.1, 0.2, 3.0]])
    cfg = ModelConfig(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1)
    experts, weights, scores = route(logits, cfg)
    p = torch.softmax(logits, -1)
    assert experts.tolist() == [[0, 1], [1, 2], [2, 0], [3, 0], [0, 2], [3, 2]]
    top = p.gather(1, experts)
    # The hand formulas below recompute the router's math in their own order: fp32 rounding of a few
    # ops on O(0.1..1) values. Measured: 0 (weights, aux loss), 1.2e-7 (seq aux, z loss) relative.
    close(weights, top / top.sum(-1, keepdim=True), rtol=1.3e-6, atol=1e-5, site="router.weights_renormalised")  # (Mixtral)
    hits = torch.zeros(6, 4).scatter_(1, experts, 1.0)
    f, pm = hits.sum(0) / (2 * 6), p.mean(0)  # fraction of the k*T assignments, mean probability
    want = 0.1 * 4 * (f * pm).sum()
    close(load_balancing_loss(scores, experts, cfg, None, batch=2), want, rtol=1e-6, site="router.aux_loss")
    seq = ModelConfig(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss")
    per_seq = [0.1 * 4 * ((hits[i:i + 3].sum(0) / 6) * p[i:i + 3].mean(0)).sum() for i in (0, 3)]
    close(load_balancing_loss(scores, experts, seq, None, batch=2), sum(per_seq) / 2, rtol=2e-6, site="router.seq_aux_loss")
    close(z_loss(logits, 1e-3, None), 1e-3 * torch.logsumexp(logits, -1).square().mean(), rtol=2e-6, site="router.z_loss")
    pre = ModelConfig(num_experts=4, moe_router_topk=2, moe_router_pre_softmax=True)
    close(route(logits, pre)[1], top, rtol=1.3e-6, atol=1e-5, site="router.weights_pre_softmax")  # not renormalised (OLMoE, Qwen)


@pytest.mark.parametrize("path,tp,ep,etp", [("examples/moe.yaml", 2, 2, 1), ("examples/megatron_flags_moe.txt", 2, 4, 2)])
def test_moe_examples_validate_and_are_supported(path, tp, ep, etp):
    from fivefold.config.load import load_config
    from fivefold.config.validate import validate
    from fivefold.config.supported import check_supported

    loaded = load_config(path, [])
    validate(loaded.config, loaded.dialect)  # the Megatron dialect turns SP on for TP x EP
    check_supported(loaded.config)
    lay = layout_of(loaded.config)
    assert (lay.tp, lay.ep, lay.etp, loaded.config.parallel.sequence_parallel) == (tp, ep, etp, True)


def test_unbuilt_moe_settings_are_refused(tmp_path):
    from fivefold.errors import NotImplementedYet
    from fivefold.config.supported import check_supported

    cfg = _config(tmp_path)
    cfg.model.moe_router_load_balancing_type = "sinkhorn"
    with pytest.raises(NotImplementedYet, match=r"sinkhorn.*not implemented yet"):
        check_supported(cfg)


def _expert_overlap_rank(rank: int, world: int, config: dict) -> dict:
    import time

    from fivefold.testing.measure import synthetic_batch
    from fivefold.train.loop import build
    from fivefold.train.step import train_step

    cfg = config_from_dict(config)
    ctx = RankContext(Mesh.build(layout_of(cfg)), Path("."))
    parts = build(cfg, ctx)
    ready = []
    parts.model.embedding.weight.register_post_accumulate_grad_hook(lambda p: ready.append(time.perf_counter()))
    traffic.reset()
    train_step(parts, synthetic_batch(cfg, 0, ctx.dp_rank, ctx.dp_size), lr=1e-3, clip_grad=1.0, device=ctx.device)
    starts = [e.time for e in traffic.events if e.tag == "edp-grad" and e.phase == "start"]
    return {"starts": starts, "embedding_ready": ready[-1]}


@pytest.mark.parametrize("parallel", [dict(expert_model_parallel_size=2),  # EDP over ranks {0,2}, {1,3}
                                      dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                           expert_model_parallel_size=2, expert_tensor_parallel_size=1)])
def test_expert_gradients_are_reduced_during_backward(workers, tmp_path, parallel):
    """Each MoE layer's expert bucket is launched when backward passes the layer (on a communicator of
    its own, so its order against the dense buckets does not matter, even where EDP is the DP x CP
    ranks): one launch per MoE layer, all before backward reaches the embedding."""
    cfg = _config(tmp_path, 4, parallel)
    for rank, r in enumerate(workers(4).run(_expert_overlap_rank, to_dict(cfg))):
        assert len(r["starts"]) == cfg.model.num_layers - cfg.model.moe_first_k_dense_layers, rank  # MoE layers
        assert max(r["starts"]) < r["embedding_ready"], rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_matmul_keeps_no_stacked_weights(dtype):
    """The grouped projection (experts._GroupedMM) against torch._grouped_mm's own autograd on the
    stacked weights: the same output and gradients bit for bit (an expert with no rows included), and
    what it keeps for backward is the input and the weights themselves, where torch's keeps a stacked
    copy of every expert's weight (measured on an H200: 192 MiB a layer, 64 experts of 1024 x 512)."""
    from fivefold.parallel.expert.dispatch import _grouped
    torch.manual_seed(0)
    weights = [torch.randn(48, 32, dtype=dtype, requires_grad=True) for _ in range(4)]
    offsets = torch.tensor([7, 7, 27, 40], dtype=torch.int32)  # expert 1 gets no rows
    x = torch.randn(40, 32, dtype=dtype, requires_grad=True)
    dy = torch.randn(40, 48, dtype=dtype)
    results = []
    for ours in (True, False):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = _grouped(x, weights, offsets) if ours else \
                torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offsets)
        y.backward(dy)
        results.append([y.detach(), x.grad.clone(), *(w.grad.clone() for w in weights)])
        kept = {t.untyped_storage().data_ptr() for t in saved} - {t.untyped_storage().data_ptr() for t in [x, offsets, *weights]}
        assert (not kept) == ours, f"ours={ours}: tensors kept beyond the input and the weights: {len(kept)}"
        x.grad = None
        for w in weights:
            w.grad = None
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert torch.count_nonzero(results[0][2 + 1]) == 0


def test_grouped_gemm_equals_the_per_expert_loop():
    """moe_grouped_gemm (torch._grouped_mm, all local experts in one matmul per projection) against the
    loop, on rows with an expert that gets none, through a sum's stride-0 gradient (which _grouped_mm's
    own backward refuses); widths that break its 16-byte rows are refused naming the fix."""
    from fivefold.errors import UserError
    from fivefold.parallel.expert.dispatch import run_experts, use_grouped_gemm
    torch.manual_seed(0)
    experts = [torch.nn.ModuleDict({n: torch.nn.Linear(*shape, bias=False) for n, shape in
                                    (("gate_proj", (H, 32)), ("up_proj", (H, 32)), ("down_proj", (32, H)))})
               for _ in range(4)]
    counts = torch.tensor([5, 0, 7, 3])
    x = torch.randn(15, H)
    outs, grads = [], []
    for grouped in (False, True):
        xs = x.clone().requires_grad_()
        y = run_experts(xs, counts, experts, None, grouped)
        (y.sum() + (y * y).sum()).backward()
        outs.append(y.detach())
        grads.append([xs.grad] + [torch.zeros_like(p) if p.grad is None else p.grad.clone()  # the loop skips an empty expert
                                   for e in experts for p in e.parameters()])
        for e in experts:
            e.zero_grad(set_to_none=True)
    # Measured 0 here (bit-identical: the same per-row dot products); another SIMD width may block the
    # sums differently, ulp-level (~1e-7): bound 1e-5.
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip([outs[1]] + grads[1], [outs[0]] + grads[0]))
    print(f"grouped vs loop: worst difference {worst:.1e} of the largest element")
    close(outs[1], outs[0], rtol=1e-5, atol=1e-6, site="moe.grouped_gemm_out")
    for g, h in zip(grads[1], grads[0]):
        close(g, h, rtol=1e-5, atol=1e-6, site="moe.grouped_gemm_grad")
    assert torch.count_nonzero(grads[1][1 + 3]) == 0  # expert 1 had no rows: no gradient
    assert use_grouped_gemm(None, torch.device("cpu")) is False and use_grouped_gemm(None, torch.device("cuda"))
    odd = [torch.nn.ModuleDict({n: torch.nn.Linear(*shape, bias=False) for n, shape in
                                (("gate_proj", (H, 30)), ("up_proj", (H, 30)), ("down_proj", (30, H)))})]
    with pytest.raises(UserError, match="multiples of 4, or moe_grouped_gemm=false"):
        run_experts(x[:3], torch.tensor([3]), odd, None, True)


def test_stacked_expert_gradients_are_added_into_the_buffer_at_once(monkeypatch):
    """bf16 experts with fp32 gradient buffers (a GPU run's mixed precision), grouped matmuls: the
    stacked weight gradient is added into the experts' buffer views in one operation
    (reducer.add_stacked_grads), not once per expert by the hook; two microbatches give the buffers of
    the per-expert adds bit for bit; where the views are not evenly spaced (or ZeRO-2's buffers come and
    go) each expert's hook adds it as before; a zero-bubble B pass adds nothing; each gradient is counted
    once towards its bucket's reduction, by add_stacked_grads or by the hook."""
    from fivefold.parallel.data import reducer
    from fivefold.parallel.expert import dispatch as experts_mod
    from fivefold.parallel.data.reducer import GradReducer
    from fivefold.parallel.expert.dispatch import run_experts
    from fivefold.runtime.backward_pass import input_grads_only
    group = Mesh.build(Layout()).dp_cp
    counts, xs = torch.tensor([5, 0, 7, 4]), [torch.randn(16, H).bfloat16() for _ in range(2)]
    used: list[bool] = []
    real = reducer.add_stacked_grads
    monkeypatch.setattr(experts_mod, "add_stacked_grads", lambda *a: used.append(real(*a)) or used[-1])

    def buffers(fused: bool, **reducer) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = [torch.nn.ModuleDict({n: torch.nn.Linear(*shape, bias=False) for n, shape in
                                      (("gate_proj", (H, 32)), ("up_proj", (H, 32)), ("down_proj", (32, H)))})
                 for _ in range(4)]
        params = [p for e in layer for p in e.parameters()]
        for p in params:
            p.data = p.data.bfloat16()
        red = GradReducer(params, group, grad_dtype=torch.float32, **reducer)
        if not fused:
            for p in params:
                p._count_grad = None  # as if the reducer added each gradient in its hook only
        red.zero_grad()
        for i, x in enumerate(xs):
            red.prepare(last=i == len(xs) - 1)
            run_experts(x, counts, layer, None, True).float().square().sum().backward()
        # each gradient counted once: every bucket was launched by the last backward, none too early
        assert all(b.pending == 0 and b.work is not None for b in red.buckets), [b.pending for b in red.buckets]
        with input_grads_only():  # B: dW is computed and dropped; nothing may reach the buffers
            x = xs[0].clone().requires_grad_()
            torch.autograd.grad(run_experts(x, counts, layer, None, True).sum(), [x])
        red.finish()
        return [b.buffer.clone() for b in red.buckets]

    apart, together = buffers(False), buffers(True)
    assert used == [False] * 6 + [True] * 6, used  # 3 projections x 2 microbatches
    assert len(apart) == len(together) and all(torch.equal(a, b) for a, b in zip(apart, together))
    used.clear()
    buffers(True, bucket_bytes=H * 32 * 2 * 4)  # each bucket holds a few experts' weights: not one even spacing
    assert used and not any(used), used
    # either order of the views in their buffer (a reducer fills it from the last parameter: decreasing)
    for order in (1, -1):
        buf, grads, counted = torch.zeros(3 * 8), torch.randn(3, 2, 4).bfloat16(), []
        ps = [torch.nn.Parameter(torch.zeros(2, 4, dtype=torch.bfloat16)) for _ in range(3)]
        for i, p in enumerate(ps):
            j = i if order == 1 else 2 - i
            p.main_grad, p._count_grad = buf[8 * j: 8 * j + 8].view(2, 4), counted.append
        assert reducer.add_stacked_grads(ps, grads)
        want = grads.float() if order == 1 else grads.float().flip(0)
        assert torch.equal(buf.view(3, 2, 4), want) and counted == ps


def _train_rank_fused(rank: int, world: int, config: dict, out: str, data_dir: str, fused: bool) -> dict:
    """_train_rank with the stacked expert-gradient adds on or off; how many it made."""
    import fivefold.parallel.expert.dispatch as ex
    real, made = ex.add_stacked_grads, []
    ex.add_stacked_grads = (lambda *a: made.append(real(*a)) or made[-1]) if fused else (lambda *a: False)
    try:
        return {**_train_rank(rank, world, config, out, data_dir), "added": sum(made)}
    finally:
        ex.add_stacked_grads = real  # the worker pool outlives this test


def test_stacked_expert_gradients_under_a_zero_bubble_pipeline(tmp_path, workers):
    """PP2 with ZB-H1 (B drops the weight gradients, W makes them), bf16 experts with fp32 buffers,
    grouped matmuls: the stacked adds give the losses of the per-expert adds bit for bit."""
    data = corpus(tmp_path / "corpus")
    cfg = _config(data, 2, {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1"})
    cfg.model.moe_grouped_gemm, cfg.training.precision = True, "bf16"
    data_dir = prepare(cfg, tmp_path)
    runs = {fused: workers(2).run(_train_rank_fused, to_dict(cfg), str(tmp_path / f"fused-{fused}"), str(data_dir),
                                  fused) for fused in (False, True)}
    assert sum(r["added"] for r in runs[True]) > 0 and not any(r["added"] for r in runs[False])
    assert [r["losses"] for r in runs[True]] == [r["losses"] for r in runs[False]]
