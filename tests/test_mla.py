"""MLA (and LayerNorm) under every parallel layout against the one-process run: TP2 x DP2 with and
without SP (queries compressed or not), PP2 x TP2 + SP, DP4, selective recompute, ZeRO-1 (losses and
norms: its ranks hold gradient chunks); LayerNorm under TP2 + SP; the built model's
parameter count against the planner's.

Reference: the same Decoder (same per-name init) in one process, trained by fivefold.train.step's
train_step on the same global batches (8 sequences of 64 tokens, microbatches of 2, constant LR, AdamW, clipping at
1.0), 3 steps. Each layout trains 3 steps with train_step (through the pipeline schedule with PP = 2,
1F1B) and returns its losses, gradient norms and the step-0 gradient of every parameter it holds,
compared with its TP slice (its ParamMeta `shard`) of the one-process gradient.

Tolerances (fp32): the layouts compute the same products and reorder fp32 sums: row-parallel partial
sums, the vocab-parallel softmax, the gradients of the replicated down-projections and norms summed
over TP (MLA's W_qa / W_kva under SP), microbatch and DP gradient sums. Each is ~1e-7 relative;
AdamW's 1/sqrt(v) keeps the differences from growing over 3 steps. Measured worst on every layout
and CPU kernel setting (docs/tolerances.md): losses 8.6e-8 relative (bound 1e-6, 12x), norms 3.7e-7
relative (bound 1e-5, 27x), step-0 gradients 6.8e-9 absolute against entries of ~1e-4..1e-1
(bound 1e-7, 15x).
Leaving the SP down-projections' gradients unsummed over TP moves them by 8.5e-3 and the norm by 4.5e-3.
"""
from __future__ import annotations

import pytest
import dataclasses

import torch

from _tol import close
from fivefold.config.schema import Config, ModelConfig, ParallelConfig, TrainingConfig
from fivefold.data.loader import Microbatch, StepBatch
from fivefold.model.decoder import Decoder, build_decoder
from fivefold.train.parallelize import parallelize
from fivefold.parallel.param_meta import named_metas
from fivefold.planner.memory.params import count_params
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout
from fivefold.train.step import train_step

STEPS, GBS, MBS, SEQ, LR = 3, 8, 2, 64, 3e-3
MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, multi_latent_attention=True, qk_layernorm=True,
           kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
MODELS = {"mla-q48": ModelConfig(**MLA, q_lora_rank=48),
          "mla-q-none": ModelConfig(**MLA, q_lora_rank=None),
          "layernorm": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   vocab_size=256, normalization="LayerNorm")}
LAYOUTS = [  # (model, tp, pp, dp, sp, selective recompute, ZeRO-1) on 4 ranks
    ("mla-q48", 2, 1, 2, False, False, False),
    ("mla-q48", 2, 1, 2, True, True, False),
    ("mla-q-none", 2, 1, 2, True, False, False),
    ("mla-q48", 2, 2, 1, True, False, False),
    ("mla-q-none", 1, 1, 4, False, False, False),
    ("mla-q48", 2, 1, 2, True, False, True),
    ("layernorm", 2, 1, 2, True, False, False),
]


def _config(model: str, tp: int = 1, pp: int = 1, sp: bool = False) -> Config:
    return Config(model=MODELS[model],
                  parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          sequence_parallel=sp, pipeline_schedule="1f1b"),
                  training=TrainingConfig(seq_length=SEQ, global_batch_size=GBS, micro_batch_size=MBS, lr=LR,
                                          lr_decay_style="constant"))


def _batch(step: int, dp_rank: int, dp: int) -> StepBatch:
    tokens = torch.randint(0, 256, (GBS, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    mine = tokens[dp_rank * GBS // dp: (dp_rank + 1) * GBS // dp]
    micro = [Microbatch(mine[k:k + MBS, :-1], mine[k:k + MBS, 1:], MBS * SEQ) for k in range(0, len(mine), MBS)]
    return StepBatch(micro, GBS * SEQ, None)


def _run(config: Config, mesh: Mesh, recompute: bool, zero: bool = False):
    """STEPS steps of `config` on `mesh`: (losses, grad norms, {name: (step-0 grad, shard)}); with
    `zero` (the distributed optimizer: each rank holds gradient chunks, not whole gradients) no grads."""
    from fivefold.pipeline.stages import build_pipeline

    dp, dp_rank = mesh.dp_cp.size, mesh.coords["dp"]
    cpu = torch.device("cpu")
    config = dataclasses.replace(config, training=dataclasses.replace(
        config.training, use_distributed_optimizer=zero, recompute_granularity="selective" if recompute else None))
    model = build_pipeline(config, mesh, GBS // (MBS * dp), device=cpu) if mesh.pp.size > 1 else \
        build_decoder(config, mesh)
    parts = parallelize(model, mesh, config)
    stages = parts.decoders
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        r = train_step(parts, _batch(step, dp_rank, dp), lr=LR, clip_grad=1.0, device=cpu)
        losses.append(r.loss)
        norms.append(r.grad_norm)
        if step == 0 and not zero:
            for stage in stages:
                metas = named_metas(stage)
                grads.update({n: (p.grad.clone(), metas[n].shard) for n, p in stage.named_parameters()})
    return losses, norms, grads


def _layer_traffic(mesh: Mesh, sp: bool, b: int) -> tuple[dict, dict]:
    """One MLA layer forward and backward: {(kind, tag): bytes} of each."""
    from fivefold.runtime import traffic

    layer = Decoder(MODELS["mla-q48"], mesh=mesh, layers=[0], embedding=False, head=False, sequence_parallel=sp)
    x = torch.randn(b, SEQ, MLA["hidden_size"], generator=torch.Generator().manual_seed(0))
    x = (x.chunk(mesh.tp.size, 1)[mesh.tp.rank] if sp else x).requires_grad_(True)
    traffic.reset()
    y = layer(x)
    fwd = {(k, t): n for k, t, _, _, n in traffic.table()}
    traffic.reset()
    y.backward(torch.ones_like(y))
    return fwd, {(k, t): n for k, t, _, _, n in traffic.table()}


def _layouts(rank: int, world: int, layouts):
    """Every layout in turn on the same ranks, then one MLA layer's traffic at TP2 (+SP)."""
    out = []
    for model, tp, pp, dp, sp, recompute, zero in layouts:
        mesh = Mesh.build(Layout(tp=tp, pp=pp, dp=dp))
        out.append(_run(_config(model, tp, pp, sp), mesh, recompute, zero))
    mesh = Mesh.build(Layout(tp=2, dp=world // 2))
    return out, [_layer_traffic(mesh, sp, 2) for sp in (False, True)]


@pytest.fixture(scope="module")
def references():
    """model -> the one-process run (a one-rank mesh, no process group), on one intra-op thread like
    a worker rank: on the shared 2-core machine two threads ran these tiny matmuls 5-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {m: _run(_config(m), Mesh.build(Layout()), False) for m in MODELS}
    finally:
        torch.set_num_threads(threads)


def test_every_layout_reproduces_one_process(workers, references):
    out = workers(4).run(_layouts, LAYOUTS)  # one call: the 4 ranks build every layout in turn
    results = [layouts for layouts, _ in out]
    _check_layer_traffic([traffic for _, traffic in out])
    for i, (model, tp, pp, dp, sp, recompute, zero) in enumerate(LAYOUTS):
        ref_losses, ref_norms, ref_grads = references[model]
        seen = set()
        for rank, per_layout in enumerate(results):
            losses, norms, grads = per_layout[i]
            where = f"{model} tp{tp} pp{pp} dp{dp}{' sp' if sp else ''}{' zero1' if zero else ''} rank {rank}"
            # reordered fp32 sums (module docstring): rtol 1e-6 on the loss trajectory, 1e-5 on the norm,
            # which counts every TP shard once and every TP-replicated weight (down-projections, norms) once
            close(losses, ref_losses, rtol=1e-6, site="mla.losses", case=where)
            close(norms, ref_norms, rtol=1e-5, site="mla.grad_norms", case=where)
            for name, (g, spec) in grads.items():
                want = ref_grads[name][0] if spec is None else spec.of(ref_grads[name][0])
                close(g, want, rtol=0, atol=1e-7, site="mla.grads", case=f"{where} {name}")
                seen.add(name)
        assert seen == (set() if zero else set(ref_grads)), where  # every parameter held by a rank is checked


def _check_layer_traffic(per_rank) -> None:
    """The collectives of one MLA layer at TP=2 equal the analytic count (call bytes, fp32): the
    latents and k_pe enter the head-split layers through one collective each, never x itself."""
    b, s, h = 2, SEQ, MLA["hidden_size"]
    r_q, r, dr = 48, MLA["kv_lora_rank"], MLA["qk_pos_emb_head_dim"]
    bs = b * s * 4  # bytes of one fp32 feature over the (b, s) tokens
    for (plain_fwd, plain_bwd), (sp_fwd, sp_bwd) in per_rank:
        # forward: g after o_proj and after down_proj; backward: f before q_b_proj (r_q), kv_b_proj (r),
        # k_pe (dr) and the fused gate/up (h)
        assert plain_fwd == {("all_reduce", "tp"): 2 * h * bs}
        assert plain_bwd == {("all_reduce", "tp"): (r_q + r + dr + h) * bs}
        # SP forward: all-gather of the q latent, the kv latent, k_pe and the MLP input; reduce-scatter
        # after o_proj and down_proj. Backward: their duals, plus the re-gather of the column layers'
        # saved s/tp inputs (q latent, kv latent, MLP input) for dL/dW.
        assert sp_fwd == {("all_gather", "sp"): (r_q + r + dr + h) * bs, ("reduce_scatter", "sp"): 2 * h * bs}
        assert sp_bwd == {("all_gather", "sp"): (2 * h + r_q + r + h) * bs,
                          ("reduce_scatter", "sp"): (r_q + r + dr + h) * bs}


@pytest.mark.parametrize("model", ["mla-q48", "mla-q-none"])
def test_parameter_count_equals_the_planners(model):
    cfg = MODELS[model]
    built = sum(p.numel() for p in Decoder(cfg).parameters())  # vocab 256: no padding at TP=1
    assert built == count_params(cfg).total


def test_example_and_megatron_flags_reach_mla_and_layernorm():
    from fivefold.config.load import load_config
    from fivefold.config.validate import validate
    from fivefold.config.supported import check_supported

    loaded = load_config("examples/mla.yaml")
    validate(loaded.config, loaded.dialect)
    check_supported(loaded.config)  # MLA with TP x SP x DP runs
    flags = ["--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
             "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--normalization", "LayerNorm",
             "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--position-embedding-type", "rope", "--attention-dropout", "0",  # MLA: RoPE, no biases, no
             "--disable-bias-linear"]  # attention dropout (Megatron's defaults otherwise: config.megatron_defaults)
    loaded = load_config(None, flags, world_size=4)
    validate(loaded.config, loaded.dialect)
    check_supported(loaded.config)
    m = loaded.config.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.normalization, m.qk_layernorm) == (True, 48, 32, 16, 8, 16, "LayerNorm", True)
