"""Context parallelism: the attention alone against scaled_dot_product_attention, its call bytes
against docs/derivations/cp_bytes.md's formulas, its compute/communication overlap, and whole training
runs in every CP layout against the one-process run of the same model and data."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import json
from pathlib import Path

from _tol import close, within
from _train_util import corpus, one_process_context
from fivefold.cli.train import prepare
from fivefold.config.schema import ClusterConfig, Config, DataConfig, ModelConfig, TrainingConfig, to_dict
from fivefold.config.validate import layout_of
from fivefold.errors import UserError
from fivefold.model.decoder import Decoder
from fivefold.ops.attention import Documents, attention
from fivefold.train.context import RankContext
from fivefold.train.loop import train
from fivefold.train.loss import cp_tokens
from fivefold.config.schema import config_from_dict
from fivefold.train.parallelize import apply_context_parallel
from fivefold.parallel.context.ring_attention import ring_attention
from fivefold.planner.memory.cp_memory import attention_peak_bytes, ring_pieces
from fivefold.parallel.context.context_parallel import context_parallel_of, local_positions, split_sequence, split_tokens
from fivefold.runtime import comm, traffic
from fivefold.runtime.mesh import Mesh
from fivefold.topology import Layout

ATTN_LAYOUTS = [("p2p-cp2", dict(cp=2, dp=2)), ("p2p-cp4", dict(cp=4)), ("a2a-cp2", dict(cp=2, dp=2, cp_a2a=2)),
                ("a2a+p2p-cp4", dict(cp=4, cp_a2a=2)), ("a2a-cp4", dict(cp=4, cp_a2a=4)),
                ("allgather-cp2", dict(cp=2, dp=2, cp_gather=True)), ("allgather-cp4", dict(cp=4, cp_gather=True))]
HEADS = [(4, 2, 16, 8), (4, 1, 8, 8), (4, 4, 8, 12)]
"""(query heads, KV heads, q/k head dim, v head dim): GQA with dv != d (MLA's shape), MQA (a2a must
copy the single KV head), MHA with dv > d."""
B, S = 2, 32
DOCS = Documents(((0, 5, 19, 32), (0, 11, 32)))
"""Packed documents crossing the CP chunk boundaries (chunks of 4 tokens at CP4, 8 at CP2)."""
DOC_SHAPE = (4, 2, 16, 8)


def _qkv(a, g, d, dv):
    gen = torch.Generator().manual_seed(a * 100 + g * 10 + d + dv)
    return (torch.randn(B, a, S, d, generator=gen), torch.randn(B, g, S, d, generator=gen),
            torch.randn(B, g, S, dv, generator=gen), torch.randn(B, a, S, dv, generator=gen))


def _attention_case(rank, world):
    """Every layout x head shape: this rank's output and q/k/v gradients (its chunks), and the call
    bytes and event logs of its forward and of its backward."""
    results = {}
    for name, sizes in ATTN_LAYOUTS:
        cp = context_parallel_of(Mesh.build(Layout(**sizes)), heads_per_rank=4)
        for shape in HEADS:
            q, k, v, do = (split_sequence(t, 2, cp.size, cp.rank) for t in _qkv(*shape))
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            traffic.reset()
            o = cp.attention(q, k, v)
            fwd, fwd_events = traffic.table(), list(traffic.events)
            traffic.reset()
            o.backward(do)
            results[name, shape] = (cp.rank, o.detach(), q.grad, k.grad, v.grad, fwd, traffic.table(),
                                    fwd_events, list(traffic.events))
        q, k, v, do = (split_sequence(t, 2, cp.size, cp.rank) for t in _qkv(*DOC_SHAPE))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        o = cp.attention(q, k, v, docs=DOCS)
        o.backward(do)
        results[name, "docs"] = (cp.rank, o.detach(), q.grad, k.grad, v.grad)
        if cp.a2a.size == 1 and not cp.gathers:  # the ring with its K/V in 4 pieces (the default at these lengths is 2)
            for key, shape, docs in (("pieces", HEADS[0], None), ("pieces+docs", DOC_SHAPE, DOCS)):
                q, k, v, do = (split_sequence(t, 2, cp.size, cp.rank) for t in _qkv(*shape))
                q, k, v = (t.requires_grad_(True) for t in (q, k, v))
                o = ring_attention(q, k, v, cp.ring, docs=docs, pieces=4)
                o.backward(do)
                results[name, key] = (cp.rank, o.detach(), q.grad, k.grad, v.grad)
    try:  # 6 heads per TP rank cannot be split over an all-to-all of 4
        context_parallel_of(Mesh.build(Layout(cp=4, cp_a2a=4)), heads_per_rank=6)
    except UserError as e:
        results["refused"] = str(e)
    return results


@pytest.fixture(scope="module")
def attention_runs(workers):
    return workers(4).run(_attention_case)


@pytest.mark.parametrize("name", [n for n, _ in ATTN_LAYOUTS])
def test_cp_attention_equals_sdpa(attention_runs, name):
    for shape in HEADS:
        q, k, v, do = _qkv(*shape)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=shape[0] != shape[1])
        ref.backward(do)
        for res in attention_runs:
            r, o, dq, dk, dv = res[name, shape][:5]
            n = dict(ATTN_LAYOUTS)[name]["cp"]
            # fp32: the ring and the all-gather merge block softmaxes by log-sum-exp and the a2a path
            # re-orders heads; all add the same terms in another order than one SDPA call: measured
            # worst over the four CPU kernel settings (scripts/tolerances.py) 2.4e-6 absolute on O(1)
            # values (all-gather CP2), 0.041 of the bound (24x); bound 2e-5 + 2e-5 * |want|.
            for got, want in ((o, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
                close(got, split_sequence(want.detach(), 2, n, r), rtol=2e-5, atol=2e-5, site="cp.attention",
                      case=f"{name} {shape} rank {r}")


@pytest.mark.parametrize("name", [n for n, _ in ATTN_LAYOUTS])
def test_cp_attention_with_documents_equals_one_process(attention_runs, name):
    """Every CP mode with packed documents against the one-process backend with the same documents
    (itself checked against each document alone in tests/test_documents.py)."""
    q, k, v, do = _qkv(*DOC_SHAPE)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    ref = attention(q, k, v, docs=DOCS)
    ref.backward(do)
    n = dict(ATTN_LAYOUTS)[name]["cp"]
    for res in attention_runs:
        r, o, dq, dk, dv = res[name, "docs"]
        # per-document pieces merged by log-sum-exp in another order than one call per document:
        # measured worst over the four CPU kernel settings 1.4e-6 absolute on O(1) values (all-gather CP2
        # under ATen's default kernels), 0.028 of the bound (35x); bound 2e-5 + 2e-5 |want|
        for got, want in ((o, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
            close(got, split_sequence(want.detach(), 2, n, r), rtol=2e-5, atol=2e-5, site="cp.documents",
                  case=f"{name} rank {r}")


@pytest.mark.parametrize("name", [n for n, sizes in ATTN_LAYOUTS if "cp_a2a" not in sizes and "cp_gather" not in sizes])
def test_ring_in_more_pieces_equals_one_process(attention_runs, name):
    """The same ring with its K/V in 4 pieces per rank (with and without documents)."""
    n = dict(ATTN_LAYOUTS)[name]["cp"]
    for key, shape, docs in (("pieces", HEADS[0], None), ("pieces+docs", DOC_SHAPE, DOCS)):
        q, k, v, do = _qkv(*shape)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        ref = attention(q, k, v, docs=docs)
        ref.backward(do)
        for res in attention_runs:
            r, o, dq, dk, dv = res[name, key]
            # as test_cp_attention_equals_sdpa (more, smaller merges): measured worst 1.2e-6 (0.025 of the bound)
            for got, want in ((o, ref), (dq, q.grad), (dk, k.grad), (dv, v.grad)):
                close(got, split_sequence(want.detach(), 2, n, r), rtol=2e-5, atol=2e-5, site="cp.pieces",
                      case=f"{name} {key} rank {r}")


MEM_SHAPE = dict(b=1, s=2048, heads=4, kv_heads=4, d=32, dv=32)
GQA_SHAPE = dict(MEM_SHAPE, heads=8, kv_heads=2)
MEM_LAYOUTS = [("p2p-cp2", dict(cp=2, dp=2), 1, MEM_SHAPE), ("p2p-cp4", dict(cp=4), 1, MEM_SHAPE),
               ("a2a-cp2", dict(cp=2, dp=2, cp_a2a=2), 2, MEM_SHAPE), ("a2a-cp2-gqa", dict(cp=2, dp=2, cp_a2a=2), 2, GQA_SHAPE),
               ("p2p-cp4-gqa", dict(cp=4), 1, GQA_SHAPE)]


def _mem_inputs(sh):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(sh["b"], h, sh["s"], sh["d"], generator=gen)
            for h in (sh["heads"], sh["kv_heads"], sh["kv_heads"], sh["heads"])]


def _peak_of_step(q, k, v, do, attend, repeats: int = 3) -> int:
    """Peak bytes created by one forward + backward, measured as the benchmark does: after a warm-up
    step, so the inputs' .grad exist and are accumulated into. The least of `repeats` steps: when the
    transport releases a finished send's buffer varies, and on some runs (2 of ~6 full-suite runs,
    a2a-cp2 rank 2, +11.5%) a late release overlapped the peak; the formula is what the algorithm holds."""
    from benchmarks.pp_schedules import PeakTensorBytes

    def step():
        attend(q, k, v).backward(do)
    step()
    peaks = []
    for _ in range(repeats):
        with PeakTensorBytes() as mode:
            step()
        peaks.append(mode.peak)
    return min(peaks)


def _memory_case(rank, world):
    torch.set_num_threads(1)
    out = {}
    for name, sizes, _, sh in MEM_LAYOUTS:
        cp = context_parallel_of(Mesh.build(Layout(**sizes)), heads_per_rank=sh["heads"])
        q, k, v, do = (split_sequence(t, 2, cp.size, cp.rank).clone() for t in _mem_inputs(sh))
        out[name] = _peak_of_step(*(t.requires_grad_() for t in (q, k, v)), do, cp.attention)
    return out


def test_attention_memory_per_rank_meets_the_formula(workers):
    """docs/context_parallel.md "Memory per rank": measured peak within 5% of the formula in every CP
    mode (and one process), and the ring below 0.65 (CP2) / 0.40 (CP4) of one process's."""
    for sh in (MEM_SHAPE, GQA_SHAPE):
        q, k, v, do = _mem_inputs(sh)
        one = _peak_of_step(*(t.requires_grad_() for t in (q, k, v)), do, lambda *t: attention(*t))
        within(abs(one / attention_peak_bytes(**sh) - 1), 0.05, site="cp.memory_formula", case=f"one process {sh}")
    runs = workers(4).run(_memory_case)
    for name, sizes, a2a, sh in MEM_LAYOUTS:
        want = attention_peak_bytes(**sh, a2a=a2a, ring=sizes["cp"] // a2a)
        for r, res in enumerate(runs):
            within(abs(res[name] / want - 1), 0.05, site="cp.memory_formula", case=f"{name} rank {r}")
    # measured worst 3.3% (p2p-cp4, rank 3): the formula leaves out the log-sum-exp rows and
    # allocator-free temporaries of the merge; 5% is the requirement, not a margin.
    # The targets are at s = 8192 (benchmarks/cp_attention.py --seq 8192: 0.59 and 0.34 measured);
    # here through the formula just checked, for the benchmark's shape (8 heads, d = 64):
    big = dict(b=1, s=8192, heads=8, kv_heads=8, d=64, dv=64)
    ratio = {P: attention_peak_bytes(**big, ring=P) / attention_peak_bytes(**big) for P in (2, 4)}
    assert ratio[2] <= 0.65 and ratio[4] <= 0.40, ratio


def test_a2a_needs_heads_divisible_by_its_size(attention_runs):
    for res in attention_runs:
        assert "6 attention heads per TP rank divisible by 4" in res["refused"]


def test_split_and_positions_cover_the_sequence_once():
    s, n = 24, 3
    parts = [local_positions(s // n, n, r) for r in range(n)]
    assert parts[0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of 6
    assert sorted(torch.cat(parts).tolist()) == list(range(s))
    ids = torch.arange(2 * 21).view(2, 21)  # an unpacked batch of odd width is padded, then split

    class Two:
        size, rank = 2, 1

    got_ids, got_labels = split_tokens(ids, ids + 1, Two(), multiple=2)  # width 21 -> 24 (2*2*2 = 8 | 24)
    assert got_ids.shape == (2, 12)
    assert got_ids[0].tolist() == list(range(6, 18))  # chunks 1 and 2 of 4 chunks of 6
    assert got_labels[0].tolist() == list(range(7, 19))
    Two.rank = 0
    _, labels0 = split_tokens(ids, ids + 1, Two(), multiple=2)  # chunks 0 and 3: ends in the padding
    assert labels0[1].tolist() == list(range(22, 28)) + [40, 41, 42, -100, -100, -100]


def _sizes(name):
    """(A, P): all-to-all size and ring size of a layout (an all-gather layout has neither: 1, 1)."""
    sizes = dict(ATTN_LAYOUTS)[name]
    if sizes.get("cp_gather"):
        return 1, 1
    a2a = sizes.get("cp_a2a", 1)
    return a2a, sizes["cp"] // a2a


def _by_kind(table):
    out = {}
    for kind, tag, _, calls, nbytes in table:
        assert tag == "cp", tag
        c, n = out.get(kind, (0, 0))
        out[kind] = (c + calls, n + nbytes)
    return out


@pytest.mark.parametrize("name", [n for n, _ in ATTN_LAYOUTS])
def test_cp_call_bytes_match_the_formulas(attention_runs, name):
    """docs/derivations/cp_bytes.md, per rank: ring (P > 1) forward (P-1) b G (s/n) (d+dv) e sent, backward
    (P-1) b G (s/n) (d+dv) (e+4); a2a (A > 1) b (s/n) e (a d + G d + G dv + a dv) each way; all-gather
    K and V gathered (b g s (d+dv) e, counted as the gathered bytes) forward and again backward, and dK / dV
    reduce-scattered (the same, counted as the unscattered input), two calls each."""
    A, P = _sizes(name)
    n, e = A * P, 4  # fp32 inputs
    for a, g, d, dv in HEADS:
        if dict(ATTN_LAYOUTS)[name].get("cp_gather"):
            kv = B * g * S * (d + dv) * e
            for res in attention_runs:  # exact
                fwd, bwd = res[name, (a, g, d, dv)][5:7]
                assert _by_kind(fwd) == {"all_gather": (2, kv)}, (a, g, d, dv)
                assert _by_kind(bwd) == {"all_gather": (2, kv), "reduce_scatter": (2, kv)}, (a, g, d, dv)
            continue
        G = g if g % A == 0 else a
        ring_f = (P - 1) * B * G * (S // n) * (d + dv) * e
        ring_b = (P - 1) * B * G * (S // n) * (d + dv) * (e + 4)
        a2a = B * (S // n) * e * (a * d + G * d + G * dv + a * dv) if A > 1 else 0
        want_f, want_b = {}, {}
        if P > 1:  # K/V (and dK/dV) travel in m pieces, one call each per tensor and hop
            m = ring_pieces(S // n)
            want_f.update(send=(2 * (P - 1) * m, ring_f), recv=(2 * (P - 1) * m, ring_f))
            want_b.update(send=(4 * (P - 1) * m, ring_b), recv=(4 * (P - 1) * m, ring_b))
        if A > 1:
            want_f["all_to_all"] = want_b["all_to_all"] = (4, a2a)
        for res in attention_runs:  # exact: byte counts are integers
            fwd, bwd = res[name, (a, g, d, dv)][5:7]
            assert _by_kind(fwd) == want_f, (a, g, d, dv)
            assert _by_kind(bwd) == want_b, (a, g, d, dv)


@pytest.mark.parametrize("name", [n for n, _ in ATTN_LAYOUTS if _sizes(n)[1] > 1])
def test_ring_posts_the_next_pieces_before_computing_these(attention_runs, name):
    """Forward and backward, every tick's compute span runs while that tick's receives are in flight
    (posted after the previous span, ended after this one), except the forward's last tick, which
    has nothing left to receive."""
    P = _sizes(name)[1]
    m = ring_pieces(S // (P * _sizes(name)[0]))
    for res, ticks, overlapped in ((r, t, o) for r in attention_runs
                                   for t, o in ((P + m - 1, P + m - 2), (P + m, P + m))):
        events = res[name, HEADS[0]][7 if ticks == P + m - 1 else 8]
        starts = [i for i, ev in enumerate(events) if ev.kind == "compute" and ev.phase == "start"]
        ends = [i for i, ev in enumerate(events) if ev.kind == "compute" and ev.phase == "end"]
        assert len(starts) == ticks
        for t in range(overlapped):
            before = ends[t - 1] if t else -1
            posted = [j for j in range(before, starts[t]) if events[j].kind == "recv" and events[j].phase == "start"]
            assert posted, (t, events)
            done = [j for j in range(ends[t], len(events)) if events[j].kind == "recv" and events[j].phase == "end"]
            assert done and done[0] > ends[t], (t, events)


# --- training runs through the runtime (train.loop) in every CP layout --------------------------------

STEPS = 4
TRAIN_LAYOUTS = {
    # name: (parallel settings, training settings)
    "cp4-p2p": (dict(context_parallel_size=4), {}),
    "cp2-a2a-dp2": (dict(context_parallel_size=2, cp_comm_type="a2a"), {}),
    "cp4-a2a+p2p": (dict(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]),
                    {}),
    "cp2-tp2-sp": (dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "cp2-p2p-dp2-zero": (dict(context_parallel_size=2), dict(use_distributed_optimizer=True)),
    "pp2-cp2-1f1b": (dict(context_parallel_size=2, pipeline_model_parallel_size=2, pipeline_schedule="1f1b"), {}),
    "cp4-allgather": (dict(context_parallel_size=4, cp_comm_type="allgather"), {}),
}

DOCS_FLAGS = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
DOC_LAYOUTS = {  # packed documents (Megatron's --reset-attention-mask --reset-position-ids --eod-mask-loss)
    "docs-cp2-tp2-sp": dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    "docs-cp2-a2a-dp2": dict(context_parallel_size=2, cp_comm_type="a2a"),
    "docs-pp2-cp2": dict(context_parallel_size=2, pipeline_model_parallel_size=2, pipeline_schedule="1f1b"),
    "docs-cp2-allgather-tp2-sp": dict(context_parallel_size=2, cp_comm_type="allgather", tensor_model_parallel_size=2,
                                      sequence_parallel=True),
}
MOE_DOC_LAYOUTS = {  # the same documents through an MoE model's expert all-to-all
    "docs-moe-cp2-ep2": dict(context_parallel_size=2, expert_model_parallel_size=2),
}
MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2)


def _config(data: Path, world: int = 1, parallel: dict | None = None, docs: bool = False, moe: bool = False,
            **training) -> Config:
    """GQA (4 query heads, 2 KV heads), seq 64, 8 sequences a step; clipping active (norms > 1)."""
    cfg = Config(cluster=ClusterConfig(world_size=world),
                 model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                   vocab_size=256),
                 training=TrainingConfig(seq_length=64, global_batch_size=8, micro_batch_size=2, train_iters=STEPS,
                                         lr=3e-3, lr_warmup_iters=0, clip_grad=1.0, eval_interval=STEPS, eval_iters=1,
                                         **training),
                 data=DataConfig(path=str(data), eval_fraction=0.1))
    for k, v in (parallel or {}).items():
        setattr(cfg.parallel, k, v)
    for k, v in (DOCS_FLAGS if docs else {}).items():
        setattr(cfg.data, k, v)
    for k, v in (MOE if moe else {}).items():
        setattr(cfg.model, k, v)
    cfg.checkpoint.save_interval = 2
    return cfg


def _train_all(rank, world, configs: dict, root: str, data_dir: str) -> dict:
    """Every layout in turn on the same pool of ranks (one worker call): losses per step."""
    out = {}
    for name, config in configs.items():
        cfg = config_from_dict(config)
        run_dir = Path(root) / name
        run_dir.mkdir(parents=True, exist_ok=True)
        traffic.reset()
        result = train(cfg, RankContext(Mesh.build(layout_of(cfg)), run_dir), Path(data_dir), progress=False)
        out[name] = {"losses": result.losses, "eval": result.eval_losses, "cp_bytes": traffic.bytes(tag="cp")}
    return out


def _metric(out: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _params(out: Path, step: int) -> dict[str, torch.Tensor]:
    folder = out / "checkpoints" / f"step_{step:08d}"
    params = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        params.update(load_file(str(f)))
    return params


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory, workers):
    root = tmp_path_factory.mktemp("cp")
    data = corpus(root / "corpus")
    ref_cfg = _config(data)
    data_dir = prepare(ref_cfg, root)
    (root / "ref").mkdir()
    ref = train(ref_cfg, one_process_context(root / "ref"), data_dir, progress=False)
    (root / "ref-docs").mkdir()
    ref_docs = train(_config(data, docs=True), one_process_context(root / "ref-docs"), data_dir, progress=False)
    (root / "ref-docs-moe").mkdir()
    ref_docs_moe = train(_config(data, docs=True, moe=True), one_process_context(root / "ref-docs-moe"), data_dir,
                         progress=False)
    configs = {name: to_dict(_config(data, 4, parallel, **training)) for name, (parallel, training) in TRAIN_LAYOUTS.items()}
    configs.update({name: to_dict(_config(data, 4, parallel, docs=True)) for name, parallel in DOC_LAYOUTS.items()})
    configs.update({name: to_dict(_config(data, 4, parallel, docs=True, moe=True))
                    for name, parallel in MOE_DOC_LAYOUTS.items()})
    runs = workers(4).run(_train_all, configs, str(root), str(data_dir))
    return {"root": root, "data": data, "data_dir": data_dir, "ref": ref, "ref_docs": ref_docs,
            "ref_docs_moe": ref_docs_moe, "runs": runs}


@pytest.mark.parametrize("name", list(DOC_LAYOUTS) + list(MOE_DOC_LAYOUTS))
def test_cp_layout_with_documents_reproduces_one_process_run(train_runs, name):
    """TP+SP, a2a and PP with CP, and an MoE model with CP x EP, each document attending to itself
    with RoPE restarting and no loss at EOD inputs: the same losses and clipping norms as the
    one-process run with documents (which tests/test_documents.py checks against each document alone)."""
    moe = name in MOE_DOC_LAYOUTS
    ref = train_runs["ref_docs_moe" if moe else "ref_docs"]
    rtol = 2e-6 if moe else 1e-6  # MoE: measured worst 8.7e-8 (losses; routing on the same scores): 23x
    assert all(abs(a - b) > 1e-3 for a, b in zip(ref.losses.values(), train_runs["ref"].losses.values()))
    for rank, r in enumerate(train_runs["runs"]):
        # Tolerance: as test_cp_layout_reproduces_one_process_run. Measured worst 7.7e-8 relative on this
        # CPU's native kernels (docs-cp2-allgather-tp2-sp; 13x); over the four kernel settings the
        # documents' eval 5.2e-8, grad norms 5.2e-8.
        close(list(r[name]["losses"].values()), list(ref.losses.values()), rtol=rtol, site="cp.docs_losses",
              case=f"{name} rank {rank}")
        close(r[name]["eval"], ref.eval_losses, rtol=rtol, site="cp.docs_eval", case=f"{name} rank {rank}")
    close(_metric(train_runs["root"] / name, "grad_norm"),
          _metric(train_runs["root"] / ("ref-docs-moe" if moe else "ref-docs"), "grad_norm"),
          rtol=rtol, site="cp.docs_grad_norm", case=name)


def _cp_bytes_per_layer(parallel: dict, b: int = 2, s: int = 64, e: int = 4, forward_only: bool = False) -> int:
    """docs/derivations/cp_bytes.md for the tiny model: send + recv + all_to_all bytes, forward + backward (or forward
    only), of one layer and microbatch on one rank (4 heads, 2 KV heads, d = dv = 16, fp32)."""
    n, t = parallel["context_parallel_size"], parallel.get("tensor_model_parallel_size", 1)
    if parallel.get("cp_comm_type") == "allgather":  # K, V gathered forward and again backward, dK / dV reduce-scattered
        return (1 if forward_only else 3) * b * max(2 // t, 1) * s * 2 * 16 * e
    A = {"p2p": 1, "a2a": n}.get(parallel.get("cp_comm_type", "p2p")) or parallel["hierarchical_context_parallel_sizes"][0]
    P, a, g, d = n // A, 4 // t, max(2 // t, 1), 16
    G = g if g % A == 0 else a
    ring = 2 * (P - 1) * b * G * (s // n) * 2 * d * (e + (0 if forward_only else e + 4))  # send + recv
    a2a = (1 if forward_only else 2) * b * (s // n) * e * (a * d + 2 * G * d + a * d) if A > 1 else 0
    return ring + a2a


@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_cp_layout_reproduces_one_process_run(train_runs, name):
    root, ref = train_runs["root"], train_runs["ref"]
    for rank, r in enumerate(train_runs["runs"]):
        got = r[name]
        assert list(got["losses"]) == list(range(STEPS))
        # Evaluation (forward only, the last step's weights): same split and sums, same tolerance.
        close(got["eval"], ref.eval_losses, rtol=1e-6, site="cp.eval_loss", case=f"{name} rank {rank}")
        parallel = TRAIN_LAYOUTS[name][0]
        pp = parallel.get("pipeline_model_parallel_size", 1)
        dp = 4 // (parallel["context_parallel_size"] * parallel.get("tensor_model_parallel_size", 1) * pp)
        layer_microbatches = STEPS * (8 // (2 * dp)) * (2 // pp)  # steps x microbatches x layers on this rank
        evals = (8 // (2 * dp)) * (2 // pp)  # one eval batch: forward only
        fwd_only = _cp_bytes_per_layer(parallel, forward_only=True)
        assert got["cp_bytes"] == layer_microbatches * _cp_bytes_per_layer(parallel) + evals * fwd_only  # exact
        # Tolerance: fp32. The ring merges block softmaxes by log-sum-exp (and a2a re-orders heads),
        # CP x DP gradients are summed over 2-4 ranks in another order, TP/SP as in test_tp_model:
        # ~1e-7 relative per op; 4 AdamW steps stay within 1e-6. A CP chunk attending to the wrong
        # keys or a token counted twice moves the loss by > 1e-3. Measured worst over the CPU kernel
        # settings (docs/tolerances.md): losses 6.9e-8 (cp4-allgather), eval 3.9e-8, grad norms 2.9e-8;
        # bound 1e-6, >= 14x.
        close(list(got["losses"].values()), list(ref.losses.values()), rtol=1e-6, site="cp.losses", case=f"{name} rank {rank}")
    # The clipping norm counts each parameter once (replicated over CP, summed over DP x CP).
    close(_metric(root / name, "grad_norm"), _metric(root / "ref", "grad_norm"), rtol=1e-6, site="cp.grad_norm", case=name)
    if name.startswith("cp2-tp2") or name.startswith("pp2"):
        return  # TP shards / PP stages: the gathered comparison is test_tp_model's and the pipeline tests' job
    mine, theirs = _params(root / name, STEPS), _params(root / "ref", STEPS)
    assert mine.keys() == theirs.keys()
    for pname, p in theirs.items():
        # Tolerance: as tests/test_zero.py: ulp-level gradient differences through Adam's scale-free
        # m / sqrt(v) can move an element whose gradient cancels near 0 by up to lr (3e-3); 3e-4 absolute
        # and 1e-4 relative in norm, while a wrong gradient is off by ~lr in thousands of elements.
        # Measured worst over the four kernel settings (AVX-512): 2.2e-5 absolute, 9.3e-6 in norm
        # (cp2-p2p-dp2-zero gate_proj; the same before the all-gather layouts were added); on an AVX2
        # machine, natively and under ATEN_CPU_CAPABILITY=default: 1.5e-5, 6.5e-6. Bounds
        # 14x / 11x the worst.
        close(mine[pname], p, rtol=0, atol=3e-4, site="cp.final_weights", case=f"{name} {pname}")
        within((mine[pname] - p).norm() / p.norm(), 1e-4, site="cp.final_weights_norm", case=f"{name} {pname}")


def test_cp2_checkpoint_resumes_at_cp1(train_runs, tmp_path):
    """The CP2 x DP2 ZeRO run saved at step 2 (parameters unsharded by CP, AdamW chunks over DP x CP)
    resumes in one process on the same trajectory."""
    cfg = _config(train_runs["data"])
    cfg.checkpoint.load = str(train_runs["root"] / "cp2-p2p-dp2-zero" / "checkpoints" / "step_00000002")
    resumed = train(cfg, one_process_context(tmp_path), train_runs["data_dir"], progress=False).losses
    assert sorted(resumed) == [2, 3]
    want = train_runs["runs"][0]["cp2-p2p-dp2-zero"]["losses"]
    # Tolerance: as test_cp_layout_reproduces_one_process_run (another layout after the resume):
    # measured worst 5.1e-8; bound 1e-6, 20x.
    close([resumed[2], resumed[3]], [want[2], want[3]], rtol=1e-6, site="cp.resume_cp2_at_cp1")


# --- multi-head latent attention under CP: v head dim != q/k head dim, one key for all heads -----------

MLA_CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, multi_latent_attention=True, qk_layernorm=True,
                      kv_lora_rank=32, q_lora_rank=48, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)
MLA_LAYOUTS = {"p2p-cp2": dict(cp=2, dp=2), "a2a+p2p-cp4": dict(cp=4, cp_a2a=2)}


def _mla_batch() -> torch.Tensor:
    return torch.randint(0, MLA_CFG.vocab_size, (2, 65), generator=torch.Generator().manual_seed(5))


def _mla_loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = _mla_batch()
    x, labels = cp_tokens(model, ids[:, :-1], ids[:, 1:])  # (2, 64/cp)
    total, _ = model.loss(x, labels)
    total.backward()
    return total.detach(), {n: p.grad for n, p in model.named_parameters()}


def _mla_case(rank, world):
    """Each layout: the loss sum and parameter gradients of one batch, summed over the CP group."""
    out = {}
    for name, sizes in MLA_LAYOUTS.items():
        mesh = Mesh.build(Layout(**sizes))
        model = Decoder(MLA_CFG, mesh=mesh, seed=0)
        apply_context_parallel(model, mesh)  # the CP step of fivefold.train.parallelize
        total, grads = _mla_loss_and_grads(model)
        for t in (total, *grads.values()):
            comm.all_reduce_(t, mesh.cp, "test")
        out[name] = (total, grads)
    return out


@pytest.fixture(scope="module")
def mla_runs(workers):
    return workers(4).run(_mla_case)


@pytest.mark.parametrize("name", list(MLA_LAYOUTS))
def test_mla_under_cp_equals_one_process(mla_runs, name):
    ref_total, ref_grads = _mla_loss_and_grads(Decoder(MLA_CFG, seed=0))
    for rank, res in enumerate(mla_runs):
        total, grads = res[name]
        # fp32: the CP split adds the token losses and each parameter's per-token gradient terms in
        # two to four partial sums instead of one, and the ring merges block softmaxes: ~1e-7
        # relative per op. Measured: the loss sum equal (0) under every CPU setting, not promised;
        # gradients up to 3.3e-6 absolute (head.weight, p2p-cp2: 0.98 of the former 1e-6 + 1e-5 *
        # |want|); bound 1e-5 + 1e-4 * |want|, 10x. Attention to the wrong keys is off by ~1e-2.
        close(total, ref_total, rtol=1e-6, site="cp_mla.loss", case=f"{name} rank {rank}")
        for n, g in grads.items():
            close(g, ref_grads[n], rtol=1e-4, atol=1e-5, site="cp_mla.grads", case=f"{name} {n} rank {rank}")
