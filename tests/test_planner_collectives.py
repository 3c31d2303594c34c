"""The planner's one list of collectives (fivefold/planner/time/layer_collectives.py) against independent
counts: the pipeline schedule's own send/recv actions for PP, and the CP and MoE helpers' call-byte
formulas (docs/derivations/cp_bytes.md, ep_bytes.md; asserted against the runtime's counter in their
tests/test_cp.py and tests/test_moe.py) written out here by hand. Pure: milliseconds."""
from dataclasses import replace

import pytest

from _tol import close
from fivefold.config.schema import ClusterConfig, Config, ModelConfig, ParallelConfig, TrainingConfig
from fivefold.pipeline.schedules import build_schedule
from fivefold.pipeline.ir import Kind
from fivefold.pipeline.simulate import Costs, simulate
from fivefold.planner.measured.callbytes import call_bytes
from fivefold.planner.time.layer_collectives import cp_collectives, layer_collectives, moe_collectives
from fivefold.planner.time.rank_collectives import step_collectives
from fivefold.planner.layout import Plan
from fivefold.planner.pipeline import pipeline_profile
from fivefold.planner.time.steptime import step_time
from fivefold.planner.presets.hardware import hardware

DENSE = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=8, num_query_groups=2, vocab_size=1000)
MOE = replace(DENSE, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, moe_aux_loss_coeff=0.01)


def plan(world=8, model=DENSE, mbs=2, gbs=16, seq=512, precision="fp32", **parallel) -> Plan:
    return Plan(Config(cluster=ClusterConfig(num_nodes=1, gpus_per_node=world, world_size=world),
                       parallel=ParallelConfig(**parallel), model=model,
                       training=TrainingConfig(seq_length=seq, global_batch_size=gbs, micro_batch_size=mbs,
                                               precision=precision)))


def by_tag(calls, tag, kind=None, phase=None):
    return sum(c.call_bytes for c in calls if c.tag == tag and (kind is None or c.kind == kind)
               and (phase is None or c.phase == phase))


@pytest.mark.parametrize("schedule,pp,vpp,sp", [("1f1b", 2, None, False), ("1f1b", 4, None, False),
                                                 ("interleaved", 2, 2, False), ("zb-h1", 4, None, True),
                                                 ("dualpipev", 2, None, False), ("gpipe", 4, None, True)])
def test_pp_bytes_are_the_schedules_sends_and_receives(schedule, pp, vpp, sp):
    tp = 2 if sp else 1
    p = plan(world=pp * tp, gbs=8 * 2, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
             pipeline_schedule=schedule, tensor_model_parallel_size=tp, sequence_parallel=sp)
    s = build_schedule(schedule, pp, p.microbatches, vpp)
    boundary = p.mbs * p.seq // tp * 256 * 4  # (b, s/tp, h) fp32 under SP, (b, s, h) without
    for r in range(pp):
        actions = sum(a.kind.is_comm for a in s.ranks[r])  # each SEND_*/RECV_* moves one boundary tensor
        assert call_bytes(p, r).get("pp", 0) == actions * boundary, (r, call_bytes(p, r))


@pytest.mark.parametrize("schedule,ranks", [("1f1b", {0, 3}), ("dualpipev", set())])
def test_tied_embedding_gradient_between_first_and_last_stage(schedule, ranks):
    p = plan(world=4, model=replace(DENSE, tie_word_embeddings=True), pipeline_model_parallel_size=4,
             pipeline_schedule=schedule)
    emb = DENSE.padded_vocab_size(1) * 256 * 4  # fp32 gradient of the whole (padded) embedding
    for r in range(4):
        assert call_bytes(p, r).get("embedding-grad", 0) == (emb if r in ranks else 0)


def cp_formulas(b, s, n, t, heads, groups, d, dv, e, A, P, again=False, gather=False):
    """docs/derivations/cp_bytes.md, per layer per microbatch per rank: {(kind, phase): bytes}; `gather`:
    TransformerEngine's all-gather CP (K and V of the whole sequence gathered forward and again
    backward, dK / dV reduce-scattered in the activation dtype)."""
    a_l, g_l = heads // t, max(1, groups // t)
    G = g_l if g_l % A == 0 else a_l
    out = {}
    if gather:
        kv = b * s * g_l * (d + dv) * e
        out.update({("all_gather", "forward"): kv, ("all_gather", "backward"): kv * (2 if again else 1),
                    ("reduce_scatter", "backward"): kv})
    if P > 1:
        fwd = (P - 1) * b * G * (s / n) * (d + dv) * e
        bwd = (P - 1) * b * G * (s / n) * (d + dv) * (e + 4) + (fwd if again else 0)
        out.update({("send", "forward"): fwd, ("recv", "forward"): fwd, ("send", "backward"): bwd,
                    ("recv", "backward"): bwd})
    if A > 1:
        x = b * (s / n) * e * (a_l * d + G * d + G * dv + a_l * dv)
        rerun = x - b * (s / n) * e * a_l * dv  # selective recompute: q, k, v again, not o back
        out.update({("all_to_all", "forward"): x, ("all_to_all", "backward"): x + (rerun if again else 0)})
    return out


@pytest.mark.parametrize("comm,hier,tp,recompute", [("p2p", None, 1, None), ("p2p", None, 2, "selective"),
                                                    ("a2a", None, 2, None), ("a2a", None, 4, None),
                                                    ("a2a+p2p", [2, 2], 1, None), ("a2a+p2p", [2, 2], 2, "selective"),
                                                    ("allgather", None, 1, None), ("allgather", None, 4, "selective")])
def test_cp_bytes_follow_the_cp_helpers_formulas(comm, hier, tp, recompute):
    # tp=4 with 2 KV groups: KV replicated (g_l = 1), and under a2a with A=4 not divisible: G = a_l
    p = plan(world=4 * tp, context_parallel_size=4, cp_comm_type=comm, hierarchical_context_parallel_sizes=hier,
             tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    p.config.training.recompute_granularity = recompute
    A, P = {"p2p": (1, 4), "a2a": (4, 1), "a2a+p2p": (2, 2), "allgather": (1, 1)}[comm]
    want = cp_formulas(2, 512, 4, tp, 8, 2, 32, 32, 4, A, P, again=recompute == "selective", gather=comm == "allgather")
    calls = cp_collectives(p, forward_again=recompute == "selective", core_only=True)
    got = {}
    for c in calls:
        got[c.kind, c.phase] = got.get((c.kind, c.phase), 0) + c.call_bytes
    close(got, want, rtol=1e-12, site="planner.cp_collective_bytes")  # the same products in another order
    # the ring hides behind the attention core; TransformerEngine's all-gather "cannot be overlapped"
    assert all((c.hides_behind == "attention") == (c.kind in ("send", "recv")) for c in calls)


def test_all_gather_cp_runs_two_chunk_calls_per_rank_and_holds_the_gathered_kv_in_backward():
    """Rank r's two chunks attend to prefixes of r + 1 and 2CP - r of the 2CP chunks: at L / (L + h) of
    the kernel's rate each, the pair costs what two calls over (2CP + 1) s / 4CP keys cost, on every rank
    (`attention_call_keys`, against the sum over the calls written out); a ring step is a call over
    s / CP keys. In backward the gathered K, V and their gradients, 2 b s g (d + dv) e, are a temporary
    beside the MLP's."""
    from fivefold.planner.memory.traits import ArchTraits
    from fivefold.planner.memory.activations import Sharding, backward_transient
    from fivefold.planner.time.layer_collectives import attention_call_keys
    from fivefold.planner.memory.peak import memory_per_rank
    h, s, cp = 842.0, 8192, 4
    p = plan(world=cp, context_parallel_size=cp, cp_comm_type="allgather", seq=s)
    chunk = s / (2 * cp)
    for r in range(cp):
        calls = [(r + 1) * chunk, (2 * cp - r) * chunk]  # keys of each call; work ~ keys
        time = sum(L / (L / (L + h)) for L in calls)  # work / rate, up to one constant
        L = attention_call_keys(p)
        assert time == pytest.approx(sum(calls) / (L / (L + h)), rel=1e-12)
    assert attention_call_keys(plan(world=cp, context_parallel_size=cp, seq=s)) == s / cp
    assert attention_call_keys(plan(world=cp, context_parallel_size=cp, cp_comm_type="a2a", seq=s)) == s
    ring = plan(world=cp, context_parallel_size=cp, seq=s, mbs=1, model=replace(DENSE, vocab_size=64))
    gather = Plan(replace(ring.config, parallel=replace(ring.config.parallel, cp_comm_type="allgather")))
    m = gather.config.model
    kv = 2 * 1 * s * 2 * (32 + 32) * 4  # 2 KV groups, head dim 32, the whole sequence, twice, fp32
    assert backward_transient(m, 0, 1, s, Sharding.of(cp=cp), ArchTraits()) == 0  # fused: nothing beside it
    before, after = memory_per_rank(ring)[0], memory_per_rank(gather)[0]
    # the peak moves from the forward's logits (a small vocabulary here) to the attention's backward
    assert after.activations - before.activations == pytest.approx(kv - before.logits, rel=1e-12)


def test_ep_and_etp_bytes_follow_the_moe_helpers_formulas():
    h, k, E, b, s = 256, 2, 8, 2, 512
    for tp, ep, etp, sp in [(1, 4, 1, False), (2, 2, 2, True), (2, 1, 2, True), (2, 1, 1, False)]:
        p = plan(world=8, model=MOE, tensor_model_parallel_size=tp, sequence_parallel=sp, expert_model_parallel_size=ep,
                 expert_tensor_parallel_size=etp)
        calls = moe_collectives(p)
        n = b * s / tp  # tokens this rank routes
        ep_want = (8 * E + 4 * n * k * h * 4) if ep > 1 else 0       # counts + dispatch/combine fwd and bwd
        etp_want = (8 * E / ep * etp + 4 * etp * n * k * h * 4) if etp > 1 else 0
        tp_want = 2 * b * s * h * 4 if tp > 1 and not sp else 0        # the layer's split + output gather
        assert by_tag(calls, "ep") == ep_want and by_tag(calls, "etp") == etp_want and by_tag(calls, "tp") == tp_want
        assert by_tag(calls, "moe-aux") == (8 * E if tp > 1 else 0)  # aux-loss counts over TP x CP
        per_layer = 3 * h * 128 // etp * (E // ep) * 4
        edp = 8 // (etp * ep)
        step = step_collectives(p, 0)
        assert by_tag(step, "edp-grad") == (per_layer * 8 if edp > 1 else 0)
        # the routers' fp32 gradients join the TP flat all-reduce (each TP rank saw its tokens only)
        norms = 256 * (2 * 8 + 1) if sp else 0
        assert by_tag(step, "tp-grad") == (4 * (norms + E * h * 8) if tp > 1 else 0)


@pytest.mark.parametrize("factor,pad,share", [(None, False, 1.0), (0.5, False, 0.5), (1.25, False, 1.0),
                                              (1.25, True, 1.25), (8.0, True, 4.0)])
def test_token_dropping_scales_the_routed_rows(factor, pad, share):
    """A router call over n = b s / (tp cp) = 512 tokens, k = 2 of E = 8 experts: routing balanced, each
    expert fills to n k / E = 128 rows, so a capacity factor drops only below 1; padded, every expert
    computes exactly min(ceil(128 c), n) rows: 160 at c = 1.25, all 512 at c = 8 (capacity > n). The
    EP dispatch / combine rows and the expert activations scale alike."""
    from fivefold.planner.memory.traits import ArchTraits
    from fivefold.planner.memory.activations import Sharding, layer_activation_bytes, routed_share
    m = replace(MOE, num_experts=8, moe_expert_capacity_factor=factor, moe_pad_expert_input_to_capacity=pad)
    assert routed_share(m, 512) == share
    capped, dropless = (plan(world=2, model=x, expert_model_parallel_size=2, mbs=1, seq=512)
                        for x in (m, replace(m, moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False)))
    assert by_tag(moe_collectives(capped), "ep") - 8 * 8 == pytest.approx(share * (by_tag(moe_collectives(dropless), "ep") - 8 * 8))
    saved = [layer_activation_bytes(x.config.model, 1, 1, 512, Sharding.of(), ArchTraits())["expert inputs"]
             for x in (capped, dropless)]
    assert saved[0] == pytest.approx(share * saved[1])


def test_sp_layer_is_ten_activation_tensors_and_wire_bytes_follow_the_algorithms():
    p = plan(world=4, tensor_model_parallel_size=4, sequence_parallel=True, precision="bf16")
    M = 2 * 512 * 256 * 2
    calls = layer_collectives(p, 0)
    assert sum(c.call_bytes for c in calls) == 10 * M
    assert sum(c.wire_bytes(4) for c in calls) == 10 * M * 3 / 4
    no_sp = plan(world=4, tensor_model_parallel_size=4, precision="bf16")
    assert sum(c.wire_bytes(4) for c in layer_collectives(no_sp, 0)) == 4 * M * 2 * 3 / 4  # ring all-reduce 2(n-1)/n
    est = step_time(p, hardware("h100-sxm"))
    assert est.comm_bytes["tp"] > 8 * 10 * M * 3 / 4 * p.microbatches  # + embedding, output layer and loss


def test_pending_weight_gradients_come_from_the_schedule():
    # ZB-H1, 2 ranks, 4 microbatches: rank 1 runs ... B3 W2 W3: two B-done-W-pending at the end, one
    # at its forwards; rank 0 holds stage 0, whose B has nothing to compute (W runs its backward)
    prof = pipeline_profile("zb-h1", 2, None, 4)
    assert prof.pending_weight_chunks == (0, 2) and prof.pending_weight_chunks_at_forward == (0, 1)
    assert pipeline_profile("1f1b", 4, None, 8).pending_weight_chunks == (0, 0, 0, 0)
    s = build_schedule("zb-h1", 2, 4, None)
    assert [str(a) for a in s.ranks[1] if a.kind in (Kind.B, Kind.W)][-3:] == ["1B3", "1W2", "1W3"]
    # under full recompute each B is the whole backward (fivefold.pipeline.executor): a microbatch's
    # activations go at its B, so ZB-H1 holds what 1F1B does and nothing waits for W
    for p, m in ((2, 4), (4, 8), (3, 7)):
        fused = pipeline_profile("zb-h1", p, None, m, fused=True)
        assert fused.moments == pipeline_profile("1f1b", p, None, m).moments and not any(fused.pending_weight_chunks)
    # DualPipeV, 2 ranks, 8 microbatches: rank 1 holds 5 chunks when nothing is W-pending and 2 when
    # 2 are, never 5 and 2 at once (rank 1 holds no loss stage: the V puts it on rank 0); the held
    # counts peak where the simulator's in-flight count does
    v = pipeline_profile("dualpipev", 2, None, 8)
    assert v.moments[1][1] == ((2, 2, 0), (5, 0, 0)) and v.pending_weight_chunks == (1, 2)
    sched = build_schedule("dualpipev", 2, 8, None)
    full = simulate(sched, Costs.per_rank(sched, 1 / 3, 1 / 3, 1 / 3))
    assert tuple(max(h for front in fronts for h, *_ in front) for fronts in v.moments) == tuple(full.peak_in_flight)


@pytest.mark.parametrize("sp,r_q", [(True, 96), (False, 96), (True, None)])
def test_mla_attention_moves_the_latents(sp, r_q):
    # fivefold/model/mla.py under TP: the column-parallel up-projections take the query latent (r_q,
    # or x itself, h) and the KV latent (r); the one rope key (dr) goes through a plain gather / copy
    mla = replace(DENSE, num_query_groups=None, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=r_q, kv_lora_rank=64,
                  qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64, num_layers=2)
    p = plan(world=2, model=mla, tensor_model_parallel_size=2, sequence_parallel=sp)
    per = 2 * 512 * 4  # b s tokens x fp32
    w_q = r_q or 256
    attn = [c for c in layer_collectives(p, 0)][: -5 if sp else -2]  # the MLP half's calls come last
    want = per * (3 * (w_q + 64) + 2 * 32 + 2 * 256) if sp else per * (w_q + 64 + 32 + 256)
    assert sum(c.call_bytes for c in attn) == want
    if sp:  # the replicated down-projections and latent norms see s/tp tokens: gradients summed over TP
        down = 256 * (64 + 32) + 64 + (256 * r_q + r_q if r_q else 0)
        assert by_tag(step_collectives(p, 0), "tp-grad") == 4 * (256 * (2 * 2 + 1) + 2 * down)
