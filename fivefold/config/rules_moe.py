"""The MoE validation rules: expert parallelism and its folding into the dense grid (ETP x EP inside
TP x CP x DP), capacity, the router (group-limited top-k, expert bias, scaling) and the 1F1B all-to-all
overlap's requirements; over the flat sizes of knobs.py."""
from __future__ import annotations

from fivefold.config.knobs import KNOB_FIELDS, Rule, etp_of, ffn_of


def moe_rules(s: dict, dp: int) -> list[Rule]:
    ep, experts = s["ep"], s["experts"]
    if not experts:
        if ep > 1:
            return [Rule(KNOB_FIELDS["ep"], ep, "expert parallelism needs a MoE model (set num_experts)",
                         ("ep",))]
        return []
    out = []
    if experts % ep:
        out.append(Rule(KNOB_FIELDS["ep"], ep, f"num_experts={experts} must be divisible by "
                        "expert_model_parallel_size", ("ep",)))
    if s["capacity"] is not None and not s["capacity"] > 0:
        out.append(Rule(KNOB_FIELDS["capacity"], s["capacity"], "must be > 0, or unset for dropless MoE",
                        ("capacity",)))
    if s["pad"] and s["capacity"] is None:
        out.append(Rule(KNOB_FIELDS["pad"], True, "padding expert inputs to capacity needs a capacity: set "
                        "moe_expert_capacity_factor (Megatron-LM requires the same)", ("capacity", "pad")))
    if s["topk"] < 1 or s["topk"] > experts:
        out.append(Rule(KNOB_FIELDS["topk"], s["topk"], f"must be >= 1; cannot route to more than "
                        f"num_experts={experts}", ("topk",)))
    out += _router(s)
    etp, dense = etp_of(s), s["tp"] * s["cp"] * dp
    moe_ffn = s["moe_ffn"] or ffn_of(s)
    if moe_ffn % etp:
        given = "" if s["moe_ffn"] else " (unset: the MLP width)"
        out.append(Rule(KNOB_FIELDS["moe_ffn"], moe_ffn, f"the routed experts' width{given} must divide "
                        f"evenly over expert_tensor_parallel_size={etp} (ETP defaults to TP)",
                        ("moe_ffn", "etp")))
    if dense % (etp * ep):
        out.append(Rule(KNOB_FIELDS["etp"], etp, f"MoE folding: ETP*EP = {etp}*{ep} = {etp * ep} must "
                        f"divide TP*CP*DP = {s['tp']}*{s['cp']}*{dp} = {dense} (ETP defaults to TP)",
                        ("etp", "ep")))
    elif s["pp"] > 1 and _pp_stride(s, {"tp": s["tp"], "cp": s["cp"], "dp": dp}) != \
            _pp_stride(s, {"tp": etp, "ep": ep, "dp": dense // (etp * ep)}):
        out.append(Rule(KNOB_FIELDS["order"], s["order"], "the dense and expert grids must share their "
                        "pipeline groups: with this order they do not (put pp last)", ("order",)))
    return out


def a2a_overlap_problems(s: dict) -> list[Rule]:
    """Megatron-LM's requirements of the 1F1B all-to-all overlap (TransformerConfig's checks of
    overlap_moe_expert_parallel_comm); the first broken one, turning the overlap off its first fix."""
    if not s["a2a_overlap"]:
        return []
    field, why = KNOB_FIELDS["a2a_overlap"], "the 1F1B all-to-all overlap (overlap_moe_expert_parallel_comm) needs "
    if s["ep"] <= 1:
        return [Rule(field, True, why + "expert parallelism (EP > 1), as Megatron-LM requires", ("a2a_overlap", "ep"))]
    if s["dispatcher"] == "allgather":
        return [Rule(field, True, why + "the alltoall or flex token dispatcher (moe_token_dispatcher_type is "
                     "allgather, Megatron-LM's default)", ("a2a_overlap", "dispatcher"))]
    if s["rgran"] == "full" or s["rmethod"] is not None or s["rnum"] is not None:
        return [Rule(field, True, why + "no full recompute: recompute_granularity not full, recompute_method and "
                     "recompute_num_layers unset (Megatron-LM refuses them together)", ("a2a_overlap", "rgran"))]
    if s["pp"] > 1 and not s["vpp"]:
        return [Rule(field, True, why + f"interleaving under pipeline parallelism (PP={s['pp']}): set "
                     "virtual_pipeline_model_parallel_size, as Megatron-LM requires", ("a2a_overlap", "vpp"))]
    if (s["mtp"] or 0) > 1:
        return [Rule(field, True, why + f"at most one MTP layer (mtp_num_layers={s['mtp']})", ("a2a_overlap", "mtp"))]
    if s["precision"] not in ("bf16", "fp16", "fp8"):
        return [Rule(field, True, why + f"a 16-bit model (precision={s['precision']}: Megatron-LM refuses fp32)",
                     ("a2a_overlap", "precision"))]
    return []


def _router(s: dict) -> list[Rule]:
    """Group-limited routing, expert bias and top-k scaling (Megatron's TransformerConfig checks, and
    the two group sizes its top-k would fail or degenerate on)."""
    out, experts, topk, groups, chosen = [], s["experts"], s["topk"], s["groups"], s["gtopk"]
    if chosen and not groups:
        out.append(Rule(KNOB_FIELDS["groups"], groups, f"group-limited routing (moe_router_group_topk={chosen}) "
                        "needs the number of expert groups", ("groups", "gtopk")))
    elif chosen and experts % groups:
        out.append(Rule(KNOB_FIELDS["groups"], groups, f"num_experts={experts} must split into "
                        "moe_router_num_groups equal groups", ("groups",)))
    elif chosen and chosen > groups:
        out.append(Rule(KNOB_FIELDS["gtopk"], chosen, f"cannot choose more groups than moe_router_num_groups="
                        f"{groups}", ("gtopk", "groups")))
    elif chosen and chosen > topk:
        out.append(Rule(KNOB_FIELDS["gtopk"], chosen, f"a group scores the sum of its top moe_router_topk/"
                        f"group_topk = {topk}//{chosen} = 0 experts: group_topk must be at most moe_router_topk",
                        ("gtopk", "topk")))
    elif chosen and topk > chosen * (experts // groups):
        out.append(Rule(KNOB_FIELDS["topk"], topk, f"the {chosen} chosen groups of {experts // groups} experts "
                        f"hold {chosen * (experts // groups)}, fewer than moe_router_topk",
                        ("gtopk", "groups", "topk")))
    if s["ebias"] and s["score"] == "softmax":
        out.append(Rule(KNOB_FIELDS["ebias"], True, "the expert bias needs moe_router_score_function sigmoid or "
                        "sqrtsoftplus (Megatron-LM refuses softmax)", ("score", "ebias")))
    if not s["brate"] >= 0:
        out.append(Rule(KNOB_FIELDS["brate"], s["brate"], "must be >= 0 (a negative rate pushes load toward the "
                        "busiest experts)", ("brate",)))
    if s["rscale"] is not None and not s["rscale"] > 0:
        out.append(Rule(KNOB_FIELDS["rscale"], s["rscale"], "must be > 0, or unset for no scaling", ("rscale",)))
    return out


def _pp_stride(s: dict, sizes: dict) -> int:
    """Rank distance between pipeline stages for a grid whose dims (in `order`) have these sizes."""
    stride = 1
    for d in s["order"].split("-"):
        if d == "pp":
            return stride
        stride *= sizes.get(d, 1)
    return stride
