"""The calibration set read as planner inputs (fivefold.planner.calibration) and the harness
(benchmarks/calibrate.py) that compares the planner with it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.errors import UserError
from fivefold.planner.calibration.runs import EXCLUDED, FLOP_COUNTS, OUT_OF_SAMPLE, read_runs
from fivefold.planner.calibration.cases import case_of, cases, flops_per_token, stated_layout
from fivefold.planner.layout import Plan
from fivefold.config.pipeline_layout import parse_layout
from fivefold.planner.search.validity import config_errors

ROOT = Path(__file__).resolve().parents[1]


def test_every_row_is_read_and_each_exclusion_names_a_row_with_a_reason():
    runs = read_runs()
    assert len(runs) == 65  # the set's README: "There are 55 rows"; 10 added (benchmarks/data/gpu-runs.md)
    assert set(EXCLUDED) <= {r.row for r in runs}
    assert all(len(reason) > 20 for reason in EXCLUDED.values())
    judged = cases()
    assert len(judged) == len(runs) - len(EXCLUDED)


def test_every_judged_row_is_a_valid_layout_of_its_stated_sizes():
    for case in cases():
        run, plan = case.run, Plan(case.config)
        assert not config_errors(case.config), (run.row, config_errors(case.config))
        for column, got in (("gpus", plan.world), ("tp", plan.tp), ("pp", plan.pp), ("cp", plan.cp), ("dp", plan.dp)):
            if run.get(column) is not None:
                assert got == int(run.get(column)), (run.row, column)
        if run.get("vpp") is not None and plan.pp > 1:
            assert plan.vpp == int(run.get("vpp")), run.row
        if case.config.model.is_moe and run.get("ep") is not None:
            assert plan.ep == int(run.get("ep")), run.row
        # a value the source does not state is taken only with a stated assumption
        for column in ("micro_batch", "seq_len", "precision", "etp"):
            if run.get(column) is None and (column != "etp" or case.config.model.is_moe):
                assert any(a.startswith(column) for a in case.assumed), (run.row, column, case.assumed)


def test_the_moe_sources_count_flops_as_we_do():
    """Rows that print tokens/s and TFLOP/s pin the source's FLOPs per token down: within 1.5% of our
    causal count (measured worst 1.2%, row 43). DeepSeek-V3's rows were 4% above it until its MTP
    layer was counted (Megatron counts it; fivefold.planner.memory.mtp): a missing layer is outside the bound."""
    checked = 0
    for run in read_runs():
        if run.num("tokens_per_s_per_gpu") and run.num("tflops_per_gpu"):
            case = case_of(run)
            theirs = run.num("tflops_per_gpu") * 1e12 / run.num("tokens_per_s_per_gpu")
            ours = flops_per_token(case.config.model, case.config.training.seq_length, FLOP_COUNTS[run.source])
            assert abs(theirs / ours - 1) < 0.015, (run.row, theirs / ours)
            checked += 1
    assert checked >= 10


def test_megatron_layout_strings():
    h100 = parse_layout("Et*3|(tt|)*29m|L", pp=8, vpp=4, num_layers=61)
    assert h100.decoder == (3,) + (2,) * 29 + (0, 0) and h100.mtp[-2] == 1
    gb200 = parse_layout("Et*4|(tttt|)*14tmL", pp=4, vpp=4, num_layers=61)
    assert gb200.decoder == (4,) + (4,) * 14 + (1,) and gb200.mtp == (0,) * 15 + (1,)
    with pytest.raises(UserError, match="needs 16 .*--num-virtual-stages-per-pipeline-rank 8"):
        parse_layout("Et*3|(tt|)*29m|L", pp=4, vpp=4)
    with pytest.raises(UserError, match="places 61 decoder layers .* has 60"):
        parse_layout("Et*3|(tt|)*29m|L", pp=8, vpp=4, num_layers=60)
    with pytest.raises(UserError, match="unexpected 'x'"):
        parse_layout("Etx|L")
    with pytest.raises(UserError, match="E .*first stage only"):
        parse_layout("t|EtL")


def test_the_harness_prints_a_row_per_judged_run():
    out = subprocess.run([sys.executable, "benchmarks/calibrate.py"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(cases())
    assert "median" in out and "Excluded: row 10" in out


def _config(precision="bf16", dp_mode=None, **parallel):
    from fivefold.planner.presets import model_preset
    from fivefold.planner.search.configs import make_config
    p = dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2)
    p.update(parallel)
    return make_config(model_preset("llama3-8b").model, 16, 8, 4096, 64, precision, p, dp_mode=dp_mode)


def test_megatron_te_reduces_gradients_in_bf16_and_saves_fp8_linear_inputs():
    from fivefold.planner.memory.peak import peak_memory
    from fivefold.planner.calibration.runtime import apply, profile
    te, ours, tt = profile("megatron-te"), profile("fivefold"), profile("torchtitan")
    cfg = _config()
    assert apply(cfg, ours) is cfg and apply(cfg, te, stated_fp32_grads=True) is cfg
    bf16 = apply(cfg, te)
    assert bf16.training.grad_reduce_in_bf16 and apply(bf16, ours) is bf16  # a stated bf16 is never undone
    full, half = (peak_memory(Plan(c), ours.memory) for c in (cfg, bf16))
    assert half.grads == pytest.approx(full.grads / 2)  # 2 of 4 bytes per parameter
    fp8 = _config("fp8")
    te8, tt8 = peak_memory(Plan(fp8), te.memory), peak_memory(Plan(fp8), tt.memory)
    assert te8.detail["attention output (proj input)"] == pytest.approx(tt8.detail["attention output (proj input)"] / 2)
    assert te8.detail["q, k, v"] == tt8.detail["q, k, v"]  # flash attention's inputs stay 16-bit


def test_megatron_te_keeps_fp8_weight_copies_over_the_step():
    """Megatron-Core passes is_first_microbatch to TransformerEngine, which keeps each decoder linear's
    fp8 weight copies (weight and transpose, or MXFP8's two usages) over the step: 2 bytes per weight
    element of the rank's layers (not norms, embedding or output layer), 1 with fp8 primary weights,
    their scales too under MXFP8; none under bf16, nor torchtitan's per-GEMM casts. (Row 46 of gpu-runs.tsv, excluded, prints 169 GB
    for DeepSeek-V3 at PP8 VPP4 EP32 in MXFP8; row 38's layout in fp8 without its offloads sizes to
    171 GB of tensors with the copies, 160 without.)"""
    from dataclasses import replace
    from fivefold.planner.memory.peak import memory_per_rank
    from fivefold.planner.memory.params import layer_params
    from fivefold.planner.calibration.runtime import profile
    te, tt = profile("megatron-te"), profile("torchtitan")
    fp8, bf16 = Plan(_config("fp8")), Plan(_config())
    m = fp8.config.model
    for r in range(2):
        linear = sum(n * ((layer_params(m, i).attention + layer_params(m, i).dense_mlp) / fp8.tp)
                     for i, _, n in fp8.layer_groups(r))  # llama3-8b: whole KV heads per TP2 rank
        with_copies, without = memory_per_rank(fp8, te.memory)[r].weights, memory_per_rank(bf16, te.memory)[r].weights
        assert with_copies - without == pytest.approx(2 * linear, rel=1e-12)
        assert memory_per_rank(fp8, tt.memory)[r].weights == without
        primary = Plan(replace(fp8.config, training=replace(fp8.config.training, fp8_param_gather=True)))
        state = memory_per_rank(primary, replace(te.memory, traits=replace(te.memory.traits, fp8_weight_cache=False)))
        assert memory_per_rank(primary, te.memory)[r].weights - state[r].weights == pytest.approx(linear, rel=1e-12)
        # MXFP8: an e8m0 scale per 32 values on each copy and on each saved linear input
        mx = Plan(replace(fp8.config, training=replace(fp8.config.training, fp8_recipe="mxfp8")))
        scaled, plain = memory_per_rank(mx, te.memory)[r], memory_per_rank(fp8, te.memory)[r]
        assert scaled.weights - without == pytest.approx(2 * linear * (1 + 1 / 32), rel=1e-12)
        assert scaled.detail["qkv input"] == pytest.approx(plain.detail["qkv input"] * (1 + 1 / 32), rel=1e-12)


@pytest.mark.parametrize("mode", ["optim_grads", "optim_grads_params"])
def test_megatron_fsdp_reduces_every_microbatch_under_pp(mode):
    """megatron-te's ZeRO-2/3 is Megatron-FSDP, which reduce-scatters after every backward, also under PP
    (Megatron-LM megatron_fsdp.py: grad_reduce_every_bprop): 1/d fp32 gradient accumulators and one
    reduce-scatter per microbatch; ours under PP keeps whole buffers and reduces once; a run that states
    fp32 gradients (Llama 3, whose FSDP shards them) keeps their precision, not whole buffers."""
    from fivefold.planner.time.rank_collectives import step_collectives
    from fivefold.planner.memory.peak import memory_per_rank
    from fivefold.planner.memory.states import rank_params
    from fivefold.planner.calibration.runtime import apply, profile
    te, ours = profile("megatron-te"), profile("fivefold")
    cfg = _config("fp32", dp_mode=mode)
    fsdp, whole = Plan(apply(cfg, te)), Plan(apply(cfg, ours))
    assert fsdp.config.training.use_megatron_fsdp and not whole.config.training.use_megatron_fsdp
    assert Plan(apply(cfg, te, stated_fp32_grads=True)).config.training.use_megatron_fsdp  # Llama 3's
    dp, m = fsdp.dp, fsdp.microbatches
    assert (dp, m) == (4, 16)
    for r in range(2):
        dense = sum(rank_params(fsdp, r))
        assert memory_per_rank(fsdp, te.memory)[r].grads == pytest.approx(4 * dense / dp)  # fp32, 1/d each
        assert memory_per_rank(whole, ours.memory)[r].grads == pytest.approx(4 * dense)  # the whole buffer
        calls = {p.config.training.use_megatron_fsdp: [c for c in step_collectives(p, r) if c.tag == "dp-grad"]
                 for p in (fsdp, whole)}
        assert [(c.kind, c.spread) for c in calls[True]] == [("reduce_scatter", m)]
        assert [(c.kind, c.spread) for c in calls[False]] == [("reduce_scatter", 1)]
        assert calls[False][0].call_bytes == pytest.approx(4 * dense)
        assert calls[True][0].call_bytes == pytest.approx(m * 4 * dense)
    from fivefold.planner.presets import hardware, model_preset
    from fivefold.planner.report.tables import why
    from fivefold.planner.search.ranking import evaluate
    bf16 = _config(dp_mode=mode)  # the GPU model times 16-bit GEMMs
    said = [why(evaluate(apply(bf16, rt), hardware("h100-sxm"), rt.memory, rt.time), model_preset("llama3-8b").model,
                8)[-1] for rt in (te, ours)]
    assert f"Megatron-FSDP: ZeRO-{2 if mode == 'optim_grads' else 3} reduce-scatters after each of the 16" in said[0]
    assert "reduce-scatters the step's whole gradient buffers once" in said[1] and "Megatron-FSDP" not in said[1]
    if mode == "optim_grads_params":  # units gathered per microbatch: whole only while in use (in backward
        # the unit and the prefetched one, with their gradient buckets), not all 16 for the step
        from fivefold.config.precision import Precision
        from fivefold.planner.memory.states import backward_buckets
        from fivefold.planner.memory.params import embedding_params
        w, dense = 4, sum(rank_params(fsdp, 0))
        layer = (dense - embedding_params(fsdp.config.model, 2) / 2) / 16
        assert memory_per_rank(whole, ours.memory)[0].weights == pytest.approx(w * dense * (1 + 1 / dp))
        assert memory_per_rank(fsdp, te.memory)[0].weights == pytest.approx(w * dense / dp)
        prec = Precision.of(fsdp.config.training, fsdp.precision)
        assert backward_buckets(fsdp, 0, dense, prec, mode) == pytest.approx(2 * layer * (w + 4))


def test_overlap_hides_tp_traffic_and_attention_runs_at_the_bf16_rate():
    from dataclasses import replace
    from fivefold.planner.presets import hardware
    from fivefold.planner.time.steptime import step_time
    from fivefold.planner.time.time_assumptions import TimeAssumptions
    hw, plan = hardware("h100-sxm"), Plan(_config())
    overlapped = Plan(_config(tp_comm_overlap=True))
    exposed = step_time(plan, hw, TimeAssumptions()).parts["tp"]
    hidden = step_time(overlapped, hw, TimeAssumptions(tp_overlap=0.75)).parts["tp"]
    # per-layer TP traffic is cut to a quarter; the once-per-step SP norm-gradient all-reduce stays exposed
    assert exposed / 4 < hidden < exposed / 3
    # only where the config turns the overlap on (Megatron's --tp-comm-overlap, torchtitan's async TP):
    # a runtime that can overlap sends a plain TP run's traffic exposed
    assert step_time(plan, hw, TimeAssumptions(tp_overlap=0.75)).parts["tp"] == exposed
    assert step_time(overlapped, hw, TimeAssumptions()).parts["tp"] == exposed
    bf16, fp8 = (step_time(Plan(_config(p)), hw, TimeAssumptions()) for p in ("bf16", "fp8"))
    assert fp8.parts["compute"] > bf16.parts["compute"] / 2  # the attention core does not speed up
    assert step_time(plan, hw, replace(TimeAssumptions(), membound_passes=4.0)).parts["compute"] \
        > bf16.parts["compute"]


def test_short_attention_calls_run_below_the_kernels_rate():
    """`attention_half_keys`: a call over L keys runs at L / (L + h) of the attention rate. A p2p CP
    ring's calls cover s / CP keys, an all-to-all's the whole sequence: what h adds to the attention
    core's time is CP times larger on the ring (3 t h / L for each, t the core's time at full rate)."""
    from fivefold.planner.presets import hardware
    from fivefold.planner.time.steptime import step_time
    from fivefold.planner.time.time_assumptions import TimeAssumptions
    hw = hardware("h100-sxm")
    added = {}
    for comm in ("p2p", "a2a"):
        plan = Plan(_config(context_parallel_size=4, cp_comm_type=comm, pipeline_model_parallel_size=1))
        off, on = (step_time(plan, hw, TimeAssumptions(attention_half_keys=h)).parts["compute"] for h in (0.0, 842.0))
        added[comm] = on - off
    assert added["a2a"] > 0
    assert added["p2p"] / added["a2a"] == pytest.approx(4, rel=1e-9)  # float sums over the layers


def test_torchtitan_rows_search_without_accumulation_and_without_head_all_to_all():
    """torchtitan had no gradient accumulation before June 2025 and its CP is a ring: its December 2024
    cases search so, and its profile's space tries p2p only."""
    from fivefold.planner.calibration.runtime import profile
    by_row = {c.run.row: c for c in cases()}
    assert not by_row[16].accumulates and by_row[34].accumulates and by_row[1].accumulates
    assert profile("torchtitan").space().cp_comm_types == ("p2p",)
    assert "a2a" in profile("megatron-te").space().cp_comm_types


def test_torchtitans_december_2024_loss_is_eager():
    """torchtitan at 9dec370 did not compile its loss (F.cross_entropy on the logits cast to fp32): at
    its backward the saved fp32 log-softmax, its incoming gradient and the logits' gradient, 12 bytes a
    logit against a fused kernel's 6 (16-bit logits + fp32 softmax); June 2025's rows compile it. With
    that, the 8B rows' estimates come within 8% of the reserved GiB torchtitan printed (16-17: 0.99;
    18-21: 0.92 of ~84 GiB, 0.62 without it; the allocator's reserve above its 5% slack is not fitted)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from calibrate import compare
    from dataclasses import replace
    by_row = {c.run.row: c for c in cases()}
    assert by_row[16].eager_loss and not by_row[34].eager_loss and not by_row[32].eager_loss
    tokens, vocab = 2 * 8192, 128256  # row 16: local batch 2 x 8192, no TP
    eager, fused = (compare(c)["memory"] for c in (by_row[16], replace(by_row[16], eager_loss=False)))
    assert eager.rank == fused.rank == 0 and eager.logits - fused.logits == pytest.approx(6 * tokens * vocab)
    for row in (16, 17, 18, 19, 20, 21, 22, 23):
        assert 0.9 <= compare(by_row[row])["memory_ratio"] <= 1.05, row
    # under TP the loss is torch's DTensor loss_parallel, eager: 16 bytes per local logit at its peak
    # (row 24: TP8, local batch 16 x 8192 tokens, the vocabulary split 8 ways)
    tp_eager, tp_fused = (compare(c)["memory"] for c in (by_row[24], replace(by_row[24], eager_loss=False)))
    tokens, local_vocab = 16 * 8192, by_row[24].config.model.padded_vocab_size(8) / 8  # 129024: a multiple of 128 x TP
    assert tp_eager.logits - tp_fused.logits == pytest.approx((16 - 6) * tokens * local_vocab)


def test_loss_parallel_holds_16_bytes_a_local_logit_eagerly(tmp_path):
    """torch.distributed.tensor.parallel.loss_parallel's cross entropy on fp32-cast vocab-sharded
    logits, eager, against F.cross_entropy on one rank's logits: the peak of live bytes from the
    profiler's allocation events over forward + backward, per local logit (2 gloo ranks; the planner's
    `runtime.EAGER_LOSS_PARALLEL_TRANSIENT` + 4 held, and `EAGER_TRAITS`' 12)."""
    import subprocess
    script = ROOT / "tests" / "_loss_parallel_peak.py"
    # --log-dir: else torchrun leaves a torchelastic_* folder in the temp dir
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          f"--log-dir={tmp_path}", str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = dict(line.split() for line in out.stdout.splitlines() if line.startswith(("plain", "loss_parallel")))
    from fivefold.planner.memory.traits import EAGER_TRAITS
    from fivefold.planner.calibration.runtime import EAGER_LOSS_PARALLEL_TRANSIENT
    # measured 12.000004 / 16.016 (worst 0.10% over the closed forms: a few scalars and DTensor's
    # bookkeeping beside the (T, V) tensors); bound 1%, 10x that. Byte counts, the same on any CPU
    assert float(got["plain"]) == pytest.approx(EAGER_TRAITS.loss_bytes(), rel=0.01)
    held = EAGER_TRAITS.loss_bytes() - EAGER_TRAITS.loss_transient_bytes
    assert float(got["loss_parallel"]) == pytest.approx(EAGER_LOSS_PARALLEL_TRANSIENT + held, rel=0.01)


def test_the_fitted_profiles_meet_their_stated_error_on_their_own_rows():
    """docs/planner_calibration.md states these; a change to the model that loses them fails here."""
    import statistics
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from calibrate import compare
    for runtime, median_at_most, max_at_most in (("megatron-te", 0.10, 0.25), ("torchtitan", 0.10, 0.25)):
        errs = [abs(compare(c)["error"]) for c in cases()
                if c.runtime == runtime and c.tokens_per_s and c.run.row not in OUT_OF_SAMPLE]
        assert statistics.median(errs) <= median_at_most and max(errs) <= max_at_most, (runtime, sorted(errs))
    # rows the constants never saw, held to issue 16's bar for a left-out source (median 15%, max 30%)
    unseen = [abs(compare(c)["error"]) for c in cases() if c.run.row in OUT_OF_SAMPLE]
    assert len(unseen) == len(OUT_OF_SAMPLE) and statistics.median(unseen) <= 0.15 and max(unseen) <= 0.30, unseen


def test_measured_alternatives_of_one_workload_are_ordered_as_published():
    """The only measured evidence on the ranking: rows that ran two layouts of one workload. The MoE zoo's
    Qwen3-235B layouts on 256 H100s (rows 47-51: EP32 with and without the 1F1B all-to-all overlap,
    Megatron-FSDP EP8, PP32, TP4) keep their published order (48 and 49 tie at 1861.8 and are left out);
    torchtitan's plain / async TP pairs (24 / 25, 32 / 33: the same layout, `calibration.TP_OVERLAP_OF`)
    are ordered as published: the async run hides a share of its TP traffic, the plain one none."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from calibrate import compare, measured_order
    order = measured_order([compare(c) for c in cases()])
    zoo = {(a, b) for a in (47, 48, 49, 50, 51) for b in (47, 48, 49, 50, 51)}
    assert {p for p in order["same"] if p in zoo} == {(48, 47), (49, 47), (47, 50), (47, 51), (48, 50), (48, 51),
                                                      (49, 50), (49, 51), (50, 51)}
    assert {(25, 24), (33, 32), (57, 56), (61, 60), (63, 62)} <= set(order["same"])
    assert not order["tied"] and not order["reversed"]


def test_a_fit_knows_which_constants_its_rows_do_not_depend_on():
    """Megatron-LM's table (dense, bf16) cannot set the fp8 rate or any expert constant: the fit
    (`calibrate.fit`, which then leaves them at TimeAssumptions' defaults instead of wherever a flat
    least squares would) names exactly those; with the Megatron-Core MoE report's rows, none."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from calibrate import FREE, unused
    from fivefold.planner.calibration.runtime import PROFILES
    by_source = {s: [c for c in cases() if c.run.source == s] for s in ("MLM-README", "MCORE-MOE-2603")}
    assert set(unused(PROFILES["megatron-te"], by_source["MLM-README"], FREE["megatron-te"])) == {
        "fp8_gemm_efficiency", "expert_efficiency", "expert_half_rows", "ep_overlap", "ep_overlap_1f1b"}
    moe = [c for c in by_source["MCORE-MOE-2603"] if c.tokens_per_s]
    assert unused(PROFILES["megatron-te"], moe, FREE["megatron-te"]) == ()


def _middle_rank(cfg, rt, hw, ta=None) -> tuple[dict, dict]:
    """(seconds, wire bytes) by kind of pipeline rank 1's microbatch as `rt` runs `cfg`: step_time's
    parts are the slowest rank's, which a change of switch can move (the last rank's loss)."""
    from fivefold.planner.time.links import Links
    from fivefold.planner.time.layer_cost import _keys
    from fivefold.planner.time.steptime import _rank_cost
    from fivefold.planner.time.layer_collectives import group_sizes
    from fivefold.planner.calibration.runtime import apply
    ta = ta or rt.time
    plan = Plan(apply(cfg, rt))
    links = Links(plan, hw, cfg.cluster.gpus_per_node, ta)
    rate = hw.achievable_flops(plan.precision) * ta.gemm_efficiency
    parts, sent, _ = _rank_cost(plan, 1, links, group_sizes(plan), rate, _keys(plan, links, rate))
    return parts, sent


def test_the_1f1b_all_to_all_overlap_hides_ep_traffic_where_megatron_allows_it():
    """Rows 47 and 48 are one run without and with --overlap-moe-expert-parallel-comm (published 1663
    and 1862 tokens/s): the cases differ in that switch alone, the overlapped one is faster, and its EP
    time is the un-overlapped one's times (1 - ep_overlap_1f1b) / (1 - ep_overlap). The search turns
    it on wherever Megatron-LM's rules allow (EP > 1, VPP under PP, no full recompute), and only there."""
    from dataclasses import replace
    from fivefold.config.rules import a2a_overlap_problems, sizes_of
    from fivefold.planner.presets import hardware, model_preset
    from fivefold.planner.calibration.runtime import apply, profile
    from fivefold.planner.search.ranking import search
    from fivefold.planner.time.steptime import step_time
    te = profile("megatron-te")
    by_row = {c.run.row: c for c in cases()}
    off, on = by_row[47].config, by_row[48].config
    assert replace(off, parallel=replace(off.parallel, overlap_moe_expert_parallel_comm=True)) == on
    hw = hardware("h100-sxm")
    t_off, t_on = (step_time(Plan(apply(c, te)), hw, te.time) for c in (off, on))
    assert t_on.step_time < t_off.step_time
    ta = te.time
    assert _middle_rank(on, te, hw)[0]["ep"] / _middle_rank(off, te, hw)[0]["ep"] == pytest.approx(
        (1 - ta.ep_overlap_1f1b) / (1 - ta.ep_overlap))
    result = search(model_preset("qwen3-30b-a3b").model, hw, 64, 8, 4096, 256, "bf16", te.space(), te.memory, ta,
                    grad_reduce_in_bf16=True)
    with_it = [c for c in result.ranked if c.config.parallel.overlap_moe_expert_parallel_comm]
    assert with_it and all("a2a-overlap" in c.label for c in with_it)
    for c in result.ranked:  # on exactly where the rules allow it
        allowed = not a2a_overlap_problems(sizes_of(replace(c.config, parallel=replace(
            c.config.parallel, overlap_moe_expert_parallel_comm=True))))
        assert c.config.parallel.overlap_moe_expert_parallel_comm == allowed, c.label


def test_each_token_dispatcher_is_timed_as_megatron_sends_it():
    """Row 47 (Qwen3-235B, EP32 over 4 nodes) under megatron-te with each of Megatron's dispatchers,
    against closed forms: flex (DeepEP, the row's) puts on the network nodes_hit / k of the all-to-all's
    per-copy bytes (the same bytes counted; without latencies, network-bound, its EP time is exactly
    that share); allgather moves every EP rank's n tokens (h values) to each rank, 4 calls a layer, plus
    the routing maps and fp32 probabilities (ep n E 5 bytes), against the all-to-all's 4 n k h copies and
    its 8-byte per-expert counts: the ratio of their EP bytes is exact. fivefold's runtime sends an
    all-to-all whatever the config says (`apply`)."""
    from dataclasses import replace
    from fivefold.planner.presets import hardware
    from fivefold.planner.calibration.runtime import apply, profile
    from fivefold.planner.time.links import nodes_hit
    te, hw = profile("megatron-te"), hardware("h100-sxm")
    row = next(c for c in cases() if c.run.row == 47)
    assert row.config.parallel.moe_token_dispatcher_type == "flex"
    no_latency = replace(te.time, network_latency=0.0, intra_latency=0.0)
    est = {d: _middle_rank(replace(row.config, parallel=replace(row.config.parallel, moe_token_dispatcher_type=d)),
                           te, hw, no_latency) for d in ("flex", "alltoall", "allgather")}
    m, plan = row.config.model, Plan(row.config)
    assert est["flex"][1]["ep"] == est["alltoall"][1]["ep"]
    share = nodes_hit(m.num_experts, m.moe_router_topk, 1, 1, 4) / m.moe_router_topk  # 3.6 of 4 nodes for 8 copies
    assert est["flex"][0]["ep"] / est["alltoall"][0]["ep"] == pytest.approx(share, rel=1e-12)
    n, h, B, E, k, ep = plan.mbs * plan.seq / (plan.cp * plan.tp), m.hidden_size, 2, m.num_experts, m.moe_router_topk, plan.ep
    ratio = (4 * ep * n * h * B + ep * n * E * 5) / (4 * n * k * h * B + 8 * E)  # 4.08 here
    assert est["allgather"][1]["ep"] / est["alltoall"][1]["ep"] == pytest.approx(ratio, rel=1e-12)
    assert est["alltoall"][0]["ep"] < est["allgather"][0]["ep"]
    ours = apply(replace(row.config, parallel=replace(row.config.parallel, moe_token_dispatcher_type="allgather")),
                 profile("fivefold"))
    assert ours.parallel.moe_token_dispatcher_type == "alltoall"


def test_nodes_hit_per_token_agree_with_the_router():
    """`nodes_hit` (DeepEP's sends per token across nodes) against the runtime's router on random logits
    (40,000 tokens: the sampling error of a mean is ~0.3%): within 1% with whole groups per node or no
    group limit (measured 0.75% worst), 6.1% over where a group spans two nodes (the planner's account of
    its even split; measured +6.1%), bound 10%."""
    import torch
    from fivefold.config.schema import ModelConfig
    from fivefold.model.router import top_k
    from fivefold.planner.time.links import nodes_hit
    generator = torch.Generator().manual_seed(0)
    for experts, k, groups, chosen, nodes, bound in ((256, 8, 8, 4, 8, 0.015), (256, 8, 8, 4, 4, 0.015),
                                                       (256, 8, 8, 4, 16, 0.10), (128, 8, None, None, 4, 0.015),
                                                       (160, 6, 8, 3, 8, 0.015)):
        cfg = ModelConfig(num_experts=experts, moe_router_topk=k, moe_router_num_groups=groups,
                          moe_router_group_topk=chosen)
        node = top_k(torch.randn(40000, experts, generator=generator), cfg) // (experts // nodes)
        measured = torch.zeros(node.shape[0], nodes).scatter_(1, node, 1).sum(1).mean().item()
        assert nodes_hit(experts, k, groups or 1, chosen or 1, nodes) == pytest.approx(measured, rel=bound)


def test_runtime_flag_is_checked(capsys):
    from fivefold.cli import main
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--model", "llama3-8b", "--gpus", "8", "--runtime", "deepspeed"])
    assert e.value.code == 2 and "deepspeed" in capsys.readouterr().err


def test_published_runs_are_judged_to_fit():
    """Every run whose published memory (if any) fits its device is judged to fit: the memory options
    of the notes (optimizer offload, bf16 moments, fp8 weights, activation offload), torchtitan's
    op-level SAC, FSDP, Megatron's module recompute and Llama 3's pipeline and sharded gradients as its
    paper says (`calibration.LLAMA3_LAYOUT`, `Case.fp32_grads`) are counted. Llama 3's rank 1 holds
    79.6 GiB of 80 at DP64: its 17.6 microbatches of one-layer chunks in flight."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from calibrate import compare
    results = [compare(c) for c in cases()]
    misses = {r["row"] for r in results if not r["fits"] and r.get("published_fits", True)}
    assert not misses, sorted(misses)
    assert {r["row"] for r in results if not r.get("published_fits", True)} == {45}  # a breakdown, 186 > 173 GiB


def test_recompute_reruns_are_charged():
    """Selective recompute of `moe` reruns the experts and the MoE layer's dispatch / combine; full
    recompute the layer's calls; ZeRO-3 without PP gathers per microbatch, each behind its own."""
    from fivefold.planner.time.layer_collectives import layer_collectives
    from fivefold.planner.time.rank_collectives import step_collectives
    from fivefold.planner.presets import hardware, model_preset
    from fivefold.planner.search.configs import make_config
    from fivefold.planner.time.steptime import step_time
    from fivefold.planner.time.time_assumptions import TimeAssumptions
    m = model_preset("qwen3-235b-a22b").model
    par = dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=8,
               pipeline_model_parallel_size=8, account_for_embedding_in_pipeline_split=True,
               account_for_loss_in_pipeline_split=True)  # 94 layers + 2 = 96 = 8 x 12
    hw = hardware("h100-sxm")

    def plan(recompute=None, modules=None, **kw):
        return Plan(make_config(m, 256, 8, 4096, 2048, "bf16", {**par, **kw}, recompute=recompute,
                                recompute_modules=modules))
    plans = {"none": plan(), "moe": plan("selective", ["moe"]), "norms": plan("selective", ["layernorm", "moe_act"])}
    ep = {k: [c for c in layer_collectives(p, 5) if c.group == "ep"] for k, p in plans.items()}
    assert len(ep["moe"]) == len(ep["none"]) + 3 and len(ep["norms"]) == len(ep["none"])  # counts, dispatch, combine
    t = {k: step_time(p, hw, TimeAssumptions()).parts for k, p in plans.items()}
    assert t["none"]["compute"] < t["norms"]["compute"] < t["moe"]["compute"]
    assert t["moe"]["ep"] > t["none"]["ep"] == t["norms"]["ep"]
    fsdp = Plan(make_config(m, 256, 8, 4096, 2048, "bf16", dict(expert_model_parallel_size=8, tensor_model_parallel_size=2,
                                                               sequence_parallel=True), micro_batch=1,
                            dp_mode="optim_grads_params"))
    gathers = [c for c in step_collectives(fsdp, 0) if c.kind == "all_gather"]
    assert gathers and all(c.spread == fsdp.microbatches for c in gathers)


def test_a_layout_states_the_published_one_on_the_fields_its_source_states():
    """The ranking's "unstated free" rank: Megatron-LM's table states TP, PP and DP but not the micro-batch,
    VPP or recompute; torchtitan's 8B row states all of them."""
    import copy
    by_row = {c.run.row: c for c in cases()}
    mlm, tt = by_row[5], by_row[16]
    assert {"micro_batch", "vpp", "split", "recompute"} <= mlm.unstated and not tt.unstated
    other = copy.deepcopy(mlm.config)
    other.training.micro_batch_size, other.parallel.virtual_pipeline_model_parallel_size = 4, 14
    states = stated_layout(mlm)
    assert states(mlm.config) and states(other)
    other.parallel.tensor_model_parallel_size, other.cluster.world_size = 4, 384  # TP is stated
    assert not states(other)
    other = copy.deepcopy(tt.config)
    other.training.micro_batch_size = 1
    assert stated_layout(tt)(tt.config) and not stated_layout(tt)(other)


def _our_gpu_runs():
    """(gpu preset, name, config path, overrides, step ms, peak MiB, optimizer) of every row of
    benchmarks/data/gpu/fivefold-<gpu>.tsv."""
    data = ROOT / "benchmarks" / "data" / "gpu"
    rows = []
    for tsv in sorted(data.glob("fivefold-*.tsv")):
        gpu = tsv.stem.removeprefix("fivefold-")
        for line in tsv.read_text().splitlines():
            if line and not line.startswith("#"):
                name, cfg, extra, _, ms, mib, optimizer = line.split("\t")
                rows.append((gpu, name, data / cfg, extra.split(), float(ms), float(mib), optimizer))
    return rows


def test_fivefold_profile_against_our_runtime_on_gpus():
    """The `fivefold` profile against our own runtime's runs on one H200 and one H100
    (benchmarks/data/gpu/fivefold-*.tsv); rows run with the per-tensor optimizer are estimated with its
    cost (PER_TENSOR_OPTIMIZER_BYTES). Memory: the estimate less the allocator's slack and reserve is
    what torch.cuda.max_memory_allocated measured, 1.004-1.012 of it: bound 3%. Time (dense rows): the
    profile's rates were measured per op class on the H200's 4-layer kernels; the estimate is kernel
    time, and the eager runtime's launch gaps put the measured step 1.00-1.11x (H100, two machines) and 1.12-1.24x
    (H200) above it, i.e. the estimate is 0.81-1.00 of the step: bound 25%, the issue's limit for
    published rows. MoE rows are 2.4-4.4x their estimate (host-bound launches, benchmarks/RESULTS.md):
    memory only. The H200's MoE row ran while grouped expert GEMMs kept a stacked copy of their weights
    for backward: its gap is those copies (3 x 64 experts x 1024 x 512 bf16 a layer, 7 MoE layers)."""
    import dataclasses

    from fivefold.config.load import load_config
    from fivefold.config.validate import validate
    from fivefold.planner.presets import hardware
    from fivefold.planner.calibration.runtime import PER_TENSOR_OPTIMIZER_BYTES, profile
    from fivefold.planner.search.ranking import evaluate
    ours, MiB = profile("fivefold"), 2**20
    per_tensor = dataclasses.replace(ours.time, optimizer_bytes_per_param=PER_TENSOR_OPTIMIZER_BYTES)
    rows = _our_gpu_runs()
    assert {r[0] for r in rows} == {"h100", "h200"} and {r[6] for r in rows} == {"per-tensor", "fused"}
    for gpu, name, path, extra, ms, mib, optimizer in rows:
        config = load_config(str(path), extra, world_size=1).config
        validate(config)
        c = evaluate(config, hardware(gpu), ours.memory, per_tensor if optimizer == "per-tensor" else ours.time,
                     check=False)
        allocated = (c.memory.total - c.memory.overhead - c.memory.reserve) / MiB
        step = c.estimate.step_time * 1e3
        print(f"{gpu} {name}: memory measured {mib:.0f} / estimated {allocated:.0f} MiB = {mib / allocated:.3f}; "
              f"step measured {ms:.1f} / estimated {step:.1f} ms = {ms / step:.2f}")
        if name.endswith("-stacked"):
            copies = 7 * 3 * 64 * 1024 * 512 * 2 / MiB
            assert 0.95 <= (mib - allocated) / copies <= 1.15, name
            continue
        assert abs(mib / allocated - 1) <= 0.03, (gpu, name)
        if not name.startswith("moe"):
            assert abs(step / ms - 1) <= 0.25, (gpu, name)
