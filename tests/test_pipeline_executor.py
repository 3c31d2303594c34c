"""The executor against the one-process model: every schedule, PP=2 and 4, DP, TP (+SP), uneven split,
CSV, ties.

Reference: the same Decoder (same per-name init) in one process, trained by fivefold.train.step's
train_step on the same global batches (8 sequences of 64 tokens, constant LR, AdamW, clipping).
Each pipeline case trains 3 steps with fivefold.train.pipeline_step and returns the losses and the
gradients of step 0 of every parameter it holds.

Tolerances (fp32): a pipeline computes the same operations per microbatch as the one-process run;
what changes is how gradients are summed (per-microbatch autograd.grad results added into .grad in
schedule order, DP all-reduce) and the loss sum's order. Those are reorderings of fp32 sums of
~8 terms: relative error ~1e-7 per step, amplified by AdamW's division by sqrt(v) in later steps.
Measured worst over the CPU kernel settings (docs/tolerances.md): losses 7.5e-8 relative (bound 1e-6,
13x); gradient norms 6.0e-6 relative (PP2 x TP2 zero-bubble, step 2: AdamW's sign-like early updates
of near-zero gradient elements; bound 1e-4, 16x); step-0 gradients 2.9e-8 absolute against entries
of ~1e-2 (bound 1e-6, 34x). Forward-only log-probs are bit-exact (same ops per microbatch).
With TP, each rank's gradient is compared with its slice (its ParamMeta `shard`) of the one-process gradient;
TP adds reorderings of the same kind (row-parallel partial sums, vocab-parallel softmax, SP norm-gain
sums over TP), so the tolerances stay.
"""
import os
from pathlib import Path

import pytest
import torch

from _tol import close
from fivefold.checkpoint import io as ckpt
from fivefold.checkpoint.layout import step_dir
from fivefold.config.schema import Config, ModelConfig, ParallelConfig, TrainingConfig
from fivefold.data.loader import Microbatch, StepBatch
from fivefold.errors import UserError
from fivefold.model.decoder import Decoder
from fivefold.train.parallelize import parallelize
from fivefold.pipeline.stages import schedule_for
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout
from fivefold.train.step import train_step

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEPS, GBS, SEQ = 3, 8, 64


def _config(pp: int = 1, dp: int = 1, mbs: int = 1, tie: bool = False, **parallel) -> Config:
    return Config(model=ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=256,
                                    tie_word_embeddings=tie),
                  parallel=ParallelConfig(pipeline_model_parallel_size=pp, **parallel),
                  training=TrainingConfig(seq_length=SEQ, global_batch_size=GBS, micro_batch_size=mbs,
                                          lr=3e-3, lr_decay_style="constant"))


def _batch(step: int, dp_rank: int, dp: int, mbs: int) -> StepBatch:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 256, (GBS, SEQ + 1), generator=g)
    mine = tokens[dp_rank * GBS // dp: (dp_rank + 1) * GBS // dp]
    micro = [Microbatch(mine[k:k + mbs, :-1], mine[k:k + mbs, 1:], mbs * SEQ) for k in range(0, len(mine), mbs)]
    return StepBatch(micro, GBS * SEQ, None)


_REFERENCE: dict[bool, tuple] = {}
"""tie -> (losses, step-0 gradients, gradient norms) of the one-process run."""


def _reference(tie: bool):
    if tie not in _REFERENCE:
        config = _config(tie=tie)
        model = Decoder(config.model, seed=config.training.seed)
        parts = parallelize(model, Mesh.build(Layout()), config)  # one rank, no process group
        losses, grads, norms = [], {}, []
        for step in range(STEPS):
            r = train_step(parts, _batch(step, 0, 1, 1), lr=3e-3, clip_grad=1.0,
                           device=torch.device("cpu"))
            losses.append(r.loss)
            norms.append(r.grad_norm)
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        _REFERENCE[tie] = (losses, grads, norms)
    return _REFERENCE[tie]


def _train(rank: int, world: int, config: Config, dp: int, save: Path | None = None):
    """3 pipeline steps: (losses, {name: (step-0 grad, shard or None)}, grad norms, {name: final
    value}); with `save`, a checkpoint of the final parameters is written there (every rank its
    shards, placed by their ParamMeta)."""
    from fivefold.checkpoint import io as ckpt
    from fivefold.pipeline.stages import build_pipeline
    from fivefold.runtime import comm
    from fivefold.parallel.param_meta import named_metas

    from fivefold.model.recompute import is_recomputing
    from fivefold.runtime import traffic

    p = config.parallel
    mesh = Mesh.build(Layout(pp=p.pipeline_model_parallel_size, tp=p.tensor_model_parallel_size, dp=dp))
    mbs = config.training.micro_batch_size
    pipe = build_pipeline(config, mesh, GBS // (mbs * dp), device=torch.device("cpu"))
    parts = parallelize(pipe, mesh, config)
    losses, grads, norms = [], {}, []
    reruns = {s: 0 for s in pipe.stages}  # a layer's forward run again by recompute, per stage
    for s, stage in pipe.stages.items():
        for layer in stage.layers.values():
            layer.register_forward_pre_hook(lambda *_, s=s: reruns.__setitem__(s, reruns[s] + is_recomputing()))
    traffic.reset()
    for step in range(STEPS):
        r = train_step(parts, _batch(step, mesh.coords["dp"], dp, mbs), lr=3e-3, clip_grad=1.0,
                       device=torch.device("cpu"))
        run = r.run
        assert run.log == list(pipe.schedule.ranks[mesh.pp.rank])  # executed order = the IR's
        losses.append(r.loss)
        norms.append(r.grad_norm)
        if step == 0:
            for s, stage in pipe.stages.items():
                metas = named_metas(stage)
                grads.update({n: (q.grad.clone(), metas[n].shard) for n, q in stage.named_parameters()})
    if save is not None:
        ckpt.save_checkpoint(save, STEPS, model=pipe.module, optimizer=parts.dp, rank=rank, writes_params=mesh.dp.rank == 0,
                             barrier=lambda: comm.barrier(mesh.group("world")), extra={})
    moved = {tag: traffic.bytes(tag=tag) for tag in ("tp", "sp")}  # the TP layers' collectives
    return losses, grads, norms, {n: q.detach().clone() for n, q in pipe.module.named_parameters()}, reruns, moved


def _check(results, tie: bool = False):
    ref_losses, ref_grads, ref_norms = _reference(tie)
    seen = set()
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
    for rank, (losses, grads, norms, *_) in enumerate(results):
        # fp32 sums reordered (see module docstring): rtol 1e-6 on the losses, 1e-4 on the norms
        # (the norm counts every TP shard and PP stage once, replicated and tied copies once)
        close(losses, ref_losses, rtol=1e-6, site="pipeline.losses", case=f"{test} rank {rank}")
        close(norms, ref_norms, rtol=1e-4, site="pipeline.grad_norms", case=f"{test} rank {rank}")
        for name, (g, spec) in grads.items():
            if tie and name == "head.weight":  # the last stage's copy of the tied embedding
                name = "embedding.weight"
            ref = ref_grads[name] if spec is None else spec.of(ref_grads[name])  # this TP rank's slice
            close(g, ref, rtol=0, atol=1e-6, site="pipeline.grads", case=f"{test} rank {rank} {name}")
            seen.add(name)
    assert seen == set(ref_grads)  # every parameter is held by some rank and checked


CASES = [  # (schedule, pp, vpp, tie)
    ("gpipe", 2, None, False), ("1f1b", 2, None, False), ("interleaved", 2, 2, False),
    ("zb-h1", 2, None, False), ("dualpipev", 2, None, True),
    ("gpipe", 4, None, False), ("1f1b", 4, None, True), ("interleaved", 4, 2, False),
    ("zb-h1", 4, None, False), ("dualpipev", 4, None, False),
]


@pytest.mark.parametrize("schedule,pp,vpp,tie", CASES, ids=[f"{c[0]}-pp{c[1]}{'-tied' if c[3] else ''}" for c in CASES])
def test_schedule_matches_one_process(workers, schedule, pp, vpp, tie):
    config = _config(pp=pp, tie=tie, pipeline_schedule=schedule, virtual_pipeline_model_parallel_size=vpp)
    _check(workers(pp).run(_train, config, 1), tie)


def test_zb_h1_full_recompute_reruns_each_layer_once(workers):
    """Full recompute under a zero-bubble schedule: a split backward would rerun a checkpointed layer's
    forward in B and again in each of W's graph tasks (one per weight group: 10 reruns per layer and
    microbatch on the last stage, each holding what it rebuilt), so such a stage's B
    runs the whole backward and its W only frees: one rerun, as 1F1B. Same sums as one process."""
    config = _config(pp=2, pipeline_schedule="zb-h1")
    config.training.recompute_granularity, config.training.recompute_method = "full", "uniform"
    config.training.recompute_num_layers = 1
    results = workers(2).run(_train, config, 1)
    _check(results)
    layers, microbatches = config.model.num_layers // 2, GBS * STEPS
    assert [r[4] for r in results] == [{0: layers * microbatches}, {1: layers * microbatches}]


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_zb_h1_split_backward_moves_the_tp_bytes_of_one_backward(workers, sp):
    """B asks the column-parallel linear for dX alone (its all-reduce, or under SP its reduce-scatter)
    and W for the weights' gradients alone (under SP the input gathered again): together the bytes
    of 1F1B's one backward, rank by rank (if each ran the whole backward, the last stage would move
    1.5x: tp 26 vs 17 MiB in benchmarks/planner_vs_measured's model), and the same sums."""
    runs = {}
    for schedule in ("zb-h1", "1f1b"):
        config = _config(pp=2, pipeline_schedule=schedule, tensor_model_parallel_size=2, sequence_parallel=sp)
        runs[schedule] = workers(4).run(_train, config, 1)
        _check(runs[schedule])
    assert [r[5] for r in runs["zb-h1"]] == [r[5] for r in runs["1f1b"]]
    assert all(r[5]["sp" if sp else "tp"] for r in runs["zb-h1"])


def test_interleaved_in_microbatch_groups(workers):
    """Megatron's microbatch_group_size_per_vp_stage: 8 microbatches in groups of 3, 3 and 2 (the last
    group >= PP), forwards through chunk 0 then chunk 1 per group: the same sums in another order."""
    config = _config(pp=2, pipeline_schedule="interleaved", virtual_pipeline_model_parallel_size=2,
                     microbatch_group_size_per_vp_stage=3)
    order = [(a.stage, a.mb) for a in schedule_for(config, GBS).ranks[0] if a.kind.value == "F"]
    assert order[:6] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)] and order[-4:] == [(0, 6), (0, 7), (2, 6), (2, 7)]
    _check(workers(2).run(_train, config, 1))


def test_pp2_dp2(workers):
    config = _config(pp=2, pipeline_schedule="1f1b")
    _check(workers(4).run(_train, config, 2))


def test_uneven_split(workers):
    config = _config(pp=2, pipeline_schedule="zb-h1", pipeline_layers_per_stage=[3, 5])
    _check(workers(2).run(_train, config, 1))


def test_hand_written_csv_schedule(workers):
    config = _config(pp=2, mbs=2, pipeline_schedule_csv=str(EXAMPLES / "hand_schedule.csv"))
    _check(workers(2).run(_train, config, 1))


def test_a_csv_schedule_naming_a_huge_microbatch_is_refused_before_it_is_built(tmp_path):
    """Training's `pipeline_schedule_csv` goes through the size limit `fivefold schedule --load-csv` has:
    a cell naming microbatch 10^20 is refused as it is read (building the schedule for it hung)."""
    path = tmp_path / "huge.csv"
    path.write_text("0F99999999999999999999,0BW99999999999999999999\n1F0,1BW0\n")
    with pytest.raises(UserError, match="stage-microbatches; a schedule holds at most 262,144"):
        schedule_for(_config(pp=2, pipeline_schedule_csv=str(path)), GBS)


def test_pp2_tp2_sp_1f1b_tied(workers):
    # SP: (b, s/tp, h) stage boundaries, norm gains' gradients summed over TP; tied embedding: the
    # vocabulary shards of the first and last stage summed over the embedding group per TP rank.
    config = _config(pp=2, tie=True, pipeline_schedule="1f1b", tensor_model_parallel_size=2, sequence_parallel=True)
    _check(workers(4).run(_train, config, 1), tie=True)


def test_pp2_tp2_zb_h1_checkpoint_loads_in_one_process(workers, tmp_path):
    # Without SP; zero-bubble B/W split through the TP layers' communicating backward.
    config = _config(pp=2, pipeline_schedule="zb-h1", tensor_model_parallel_size=2)
    results = workers(4).run(_train, config, 1, tmp_path)
    _check(results)
    # The (PP stage x TP shard) checkpoint assembles into the one-process model, each shard at its
    # offset: every rank's final parameter is bit-exactly its slice of the loaded one.
    model = Decoder(config.model, seed=config.training.seed)
    ckpt.load_checkpoint(step_dir(tmp_path, STEPS), model=model, optimizer=None, rank=0, world_size=1)
    loaded = dict(model.named_parameters())
    seen = set()
    for (_, grads, _, final, *_) in results:
        for name, value in final.items():
            spec = grads[name][1]
            assert torch.equal(value, loaded[name].detach() if spec is None else spec.of(loaded[name].detach()))
            seen.add(name)
    assert seen == set(loaded)


def _forward_only(rank: int, world: int, config: Config):
    from fivefold.pipeline.stages import build_pipeline
    from fivefold.train.pipeline_step import pipeline_evaluate, pipeline_logprobs

    mesh = Mesh.build(Layout(pp=config.parallel.pipeline_model_parallel_size))
    pipe = build_pipeline(config, mesh, GBS, device=torch.device("cpu"))
    batch = _batch(7, 0, 1, 1)
    loss = pipeline_evaluate(pipe, [batch], mesh=mesh)
    lp = pipeline_logprobs(pipe, [m.input_ids for m in batch.microbatches], [m.labels for m in batch.microbatches],
                           mesh=mesh)
    ids, labels = [m.input_ids for m in batch.microbatches], [m.labels for m in batch.microbatches]
    return loss, lp, pipe.executor.run(ids, labels, mode="loss").log


def test_forward_only_eval_loss_and_logprobs(workers):
    config = _config(pp=2, pipeline_schedule="interleaved", virtual_pipeline_model_parallel_size=2)
    model = Decoder(config.model, seed=config.training.seed)
    batch = _batch(7, 0, 1, 1)
    with torch.no_grad():
        ref_loss = sum(float(model.loss(m.input_ids, m.labels)[0]) for m in batch.microbatches) / batch.global_tokens
        ref_lp = [model.logprobs(m.input_ids, m.labels) for m in batch.microbatches]
    for loss, lp, log in workers(2).run(_forward_only, config):
        # same ops, microbatch losses summed in another order (measured: equal, not promised)
        close(loss, ref_loss, rtol=1e-6, site="pipeline.eval_loss")
        for a, b in zip(lp, ref_lp):
            assert torch.equal(a, b)  # the same ops on the same microbatch: bit-exact (measured, every CPU setting)
        assert all(a.kind.value in ("F", "SEND_F", "RECV_F") for a in log)  # no backward ran


@pytest.mark.parametrize("split", [False, True], ids=["bw", "b-then-w"])
def test_stage_backward_adds_each_weight_gradient_as_it_is_made(split):
    """A stage's backward (BW, or B then W) adds each weight's gradient into where it accumulates as
    autograd produces it, so at most one weight's gradient is alive beyond the buffers; one
    `autograd.grad` over all the weights would hold every gradient of the stage until it returned (the
    first stage of GPipe PP2 x CP2 ZeRO-1 at mbs1 would measure 0.911 of the planner). Eight
    256 x 256 fp32 linears (256 KiB each); the same gradients as one plain backward, exactly."""
    from fivefold.pipeline.backward import backward_full, backward_input, backward_weight
    from fivefold.testing.measure import _tracker
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(8)])
    params = list(layers.parameters())
    x = torch.randn(4, 256, requires_grad=True)
    want = torch.autograd.grad(layers(x).square().sum(), [x, *params])
    for p in params:  # as a GradReducer leaves them: .grad a view of the buffer gradients accumulate in
        p.grad = torch.zeros_like(p)
    out = layers(x)
    grad_out = 2 * out.detach()
    tracker = _tracker()
    tracker.track_external(layers)  # the weights and their gradient buffers: not what is measured
    with tracker:
        if split:
            dx, plan = backward_input(out, grad_out, x, params)
            backward_weight(plan)
        else:
            dx = backward_full(out, grad_out, x, params)
    peak = tracker.get_tracker_snapshot("peak")[x.device]
    transient = sum(v for k, v in peak.items() if getattr(k, "value", k) in ("Temp", "Activation"))
    one = 256 * 256 * 4
    assert transient <= 2 * one, f"{transient / one:.1f} weight gradients alive at the peak"
    assert torch.equal(dx, want[0]) and all(torch.equal(p.grad, w) for p, w in zip(params, want[1:]))
