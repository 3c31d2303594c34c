"""The validation rules, over a flat dict of the sizes they read (so the fix search can try many).

`sizes_of(config)` flattens a Config into short knob names; `adjust(s, dialect)` applies what a
dialect does on its own (returns warnings); `errors(s)` lists every broken rule. Each broken rule is
a `Rule` naming the canonical field, its value, the rule in words, and the knobs that may fix it,
the preferred one first (the fix search in fixes.py changes the fewest knobs).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from fivefold.config.schema import (ACTIVATIONS, CP_COMM_TYPES, DIM_NAMES, DISPATCHERS, DROP_POLICIES, NORMALIZATIONS,
                                    POSITION_EMBEDDINGS, QK_NORM_SCOPES, ROUTER_DTYPES, ROUTER_SCORE_FUNCTIONS,
                                    Config, default_ffn_size)
from fivefold.config.pipeline_layout import parse_layout
from fivefold.config.split import layers_per_stage
from fivefold.errors import UserError
from fivefold.pipeline.schedules import REGISTRY, microbatch_problem

KNOB_FIELDS = {
    "tp": "parallel.tensor_model_parallel_size", "pp": "parallel.pipeline_model_parallel_size",
    "vpp": "parallel.virtual_pipeline_model_parallel_size", "cp": "parallel.context_parallel_size",
    "ep": "parallel.expert_model_parallel_size", "etp": "parallel.expert_tensor_parallel_size",
    "sp": "parallel.sequence_parallel", "hcp": "parallel.hierarchical_context_parallel_sizes",
    "a2a_overlap": "parallel.overlap_moe_expert_parallel_comm", "tp_overlap": "parallel.tp_comm_overlap",
    "dispatcher": "parallel.moe_token_dispatcher_type",
    "cp_comm": "parallel.cp_comm_type", "schedule": "parallel.pipeline_schedule",
    "order": "parallel.order", "split": "parallel.pipeline_layers_per_stage",
    "first": "parallel.decoder_first_pipeline_num_layers",
    "last": "parallel.decoder_last_pipeline_num_layers",
    "acc_emb": "parallel.account_for_embedding_in_pipeline_split",
    "acc_loss": "parallel.account_for_loss_in_pipeline_split",
    "vpp_layers": "parallel.num_layers_per_virtual_pipeline_stage",
    "pp_layout": "parallel.pipeline_model_parallel_layout",
    "group": "parallel.microbatch_group_size_per_vp_stage",
    "layers": "model.num_layers", "heads": "model.num_attention_heads", "kv": "model.num_query_groups",
    "hidden": "model.hidden_size", "ffn": "model.ffn_hidden_size", "kvc": "model.kv_channels",
    "vocab": "model.vocab_size", "vocab_div": "model.make_vocab_size_divisible_by",
    "moe_ffn": "model.moe_ffn_hidden_size", "shared": "model.moe_shared_expert_intermediate_size",
    "mla": "model.multi_latent_attention", "norm": "model.normalization",
    "experts": "model.num_experts", "topk": "model.moe_router_topk",
    "capacity": "model.moe_expert_capacity_factor", "drop": "model.moe_token_drop_policy",
    "pad": "model.moe_pad_expert_input_to_capacity",
    "seq": "training.seq_length", "gbs": "training.global_batch_size", "mbs": "training.micro_batch_size",
    "rgran": "training.recompute_granularity", "rmethod": "training.recompute_method",
    "rnum": "training.recompute_num_layers", "world": "cluster.world_size",
    "log": "logging.log_interval",
    "act": "model.activation", "pos": "model.position_embedding_type", "maxpos": "model.max_position_embeddings",
    "qk_scope": "model.qk_layernorm_scope",
    "score": "model.moe_router_score_function", "rdtype": "model.moe_router_dtype",
    "groups": "model.moe_router_num_groups", "gtopk": "model.moe_router_group_topk",
    "ebias": "model.moe_router_enable_expert_bias", "brate": "model.moe_router_bias_update_rate",
    "rscale": "model.moe_router_topk_scaling_factor", "mtp": "model.mtp_num_layers",
    "precision": "training.precision",
}


@dataclass(frozen=True)
class Rule:
    field: str
    value: object
    rule: str
    knobs: tuple[str, ...]
    """Knobs that can fix it, preferred first."""
    severity: str = "error"


_KNOB_PATHS = tuple((knob, *dotted.split(".")) for knob, dotted in KNOB_FIELDS.items())
_KNOB_SECTIONS = tuple({section for _, section, _ in _KNOB_PATHS})


def sizes_of(config: Config) -> dict:
    sections = {name: vars(getattr(config, name)) for name in _KNOB_SECTIONS}
    s = {knob: sections[section][name] for knob, section, name in _KNOB_PATHS}  # every knob is a field
    c = config.cluster
    s["world"] = c.resolved_world_size
    s["gpn"] = c.gpus_per_node
    for k in ("hcp", "split"):
        s[k] = tuple(s[k]) if s[k] is not None else None
    return s


def dp_of(s: dict) -> int:
    return s["world"] // (s["tp"] * s["pp"] * s["cp"])


def etp_of(s: dict) -> int:
    return s["etp"] if s["etp"] is not None else s["tp"]


def adjust(s: dict, dialect: str) -> list[Rule]:
    """Apply what the dialect's own tool does silently or with a warning; return those warnings."""
    out: list[Rule] = []
    if s["gbs"] is None and isinstance(s["mbs"], int) and s["tp"] * s["pp"] * s["cp"] > 0 \
            and s["world"] % (s["tp"] * s["pp"] * s["cp"]) == 0:
        s["gbs"] = s["mbs"] * dp_of(s)  # Megatron's default global batch
    stages, problem = _layout(s)
    if stages is not None and not problem:  # Megatron derives VPP from the string
        s["split"], v = stages.decoder, stages.stages // s["pp"]
        s["vpp"] = v if v > 1 else None
    n, units = s["vpp_layers"], s["layers"] + bool(s["acc_emb"]) + bool(s["acc_loss"])
    if n and isinstance(n, int) and n >= 1 and s["pp"] >= 1 and units % (s["pp"] * n) == 0:
        v = units // (s["pp"] * n)
        s["vpp"], s["vpp_layers"] = (v if v > 1 else None), None
        if v == 1:
            out.append(Rule(KNOB_FIELDS["vpp_layers"], n, f"{units} layers / (PP={s['pp']} x {n} layers per "
                            "virtual stage) = 1 chunk per pipeline rank: no interleaving; VPP left unset, as "
                            "Megatron-LM does", ("vpp_layers",), "warning"))
    if s["vpp"] == 1:
        out.append(Rule(KNOB_FIELDS["vpp"], 1, "one chunk per pipeline rank is no interleaving; VPP left unset, "
                        "as Megatron-LM does", ("vpp",), "warning"))
        s["vpp"] = None
    if s["vpp"] and s["vpp"] > 1 and s["schedule"] == "1f1b":
        s["schedule"] = "interleaved"
    if s["group"] is not None and s["schedule"] != "interleaved":
        out.append(Rule(KNOB_FIELDS["group"], s["group"], "groups microbatches per virtual stage, which only "
                        f"the interleaved schedule has (this one: {s['schedule']}); ignored, as Megatron-LM does",
                        ("group",), "warning"))
        s["group"] = None
    if dialect == "skyrl" and s["sp"] != (s["tp"] > 1):
        out.append(Rule(KNOB_FIELDS["sp"], s["sp"], "SkyRL turns sequence parallelism on exactly when "
                        f"TP > 1 (TP={s['tp']}); SP set to {s['tp'] > 1}", ("sp",), "warning"))
        s["sp"] = s["tp"] > 1
    if dialect == "megatron" and s["sp"] and s["tp"] == 1:
        out.append(Rule(KNOB_FIELDS["sp"], True, "Megatron-LM turns sequence parallelism off when "
                        "tensor_model_parallel_size=1; SP set to False", ("sp",), "warning"))
        s["sp"] = False
    if s["tp"] > 1 and s["ep"] > 1 and not s["sp"]:
        out.append(Rule(KNOB_FIELDS["sp"], False, f"expert parallelism (EP={s['ep']}) with tensor "
                        f"parallelism (TP={s['tp']}) needs sequence parallelism (Megatron-Core <=0.14 "
                        "refuses, >=0.15 warns); SP turned on", ("sp",), "warning"))
        s["sp"] = True
    if s["a2a_overlap"]:
        out.append(Rule(KNOB_FIELDS["a2a_overlap"], True, "fivefold's runtime (`fivefold train`) runs the EP "
                        "all-to-all without Megatron's 1F1B overlap: the same sums, its own schedule; "
                        "`fivefold estimate --runtime megatron-te` times the overlap", ("a2a_overlap",), "warning"))
    if s["tp_overlap"] and s["sp"]:
        out.append(Rule(KNOB_FIELDS["tp_overlap"], True, "fivefold's runtime (`fivefold train`) sends the TP / SP "
                        "traffic without overlapping it with the GEMMs: the same sums; `fivefold estimate --runtime "
                        "megatron-te` (or torchtitan) times the overlap", ("tp_overlap",), "warning"))
    if s["dispatcher"] != "alltoall" and s["experts"] and s["ep"] > 1:
        out.append(Rule(KNOB_FIELDS["dispatcher"], s["dispatcher"], "fivefold's runtime (`fivefold train`) sends "
                        "the EP exchange as an all-to-all: the same sums; `fivefold estimate --runtime megatron-te` "
                        "times this dispatcher", ("dispatcher",), "warning"))
    return out


def _positive(s: dict) -> list[Rule]:
    out = []
    for k in ("tp", "pp", "cp", "ep", "layers", "heads", "hidden", "vocab", "vocab_div", "seq", "gbs", "mbs",
              "world", "log"):
        if k == "gbs" and s[k] is None:
            continue
        if not isinstance(s[k], int) or s[k] < 1:
            out.append(Rule(KNOB_FIELDS[k], s[k], "must be a whole number >= 1", (k,)))
    for k in ("vpp", "etp", "kv", "experts", "vpp_layers", "rnum", "ffn", "kvc", "moe_ffn", "shared", "first",
              "last", "groups", "gtopk", "group"):
        if s[k] is not None and s[k] < 1:
            out.append(Rule(KNOB_FIELDS[k], s[k], "must be >= 1 or unset", (k,)))
    return out


def _choices(s: dict) -> list[Rule]:
    out = []
    for k, allowed in (("schedule", tuple(REGISTRY)), ("cp_comm", CP_COMM_TYPES), ("norm", NORMALIZATIONS),
                       ("rgran", (None, "selective", "full")), ("rmethod", (None, "uniform", "block")),
                       ("act", ACTIVATIONS), ("pos", POSITION_EMBEDDINGS), ("drop", DROP_POLICIES),
                       ("qk_scope", QK_NORM_SCOPES), ("score", ROUTER_SCORE_FUNCTIONS), ("rdtype", ROUTER_DTYPES),
                       ("dispatcher", DISPATCHERS)):
        if s[k] not in allowed:
            out.append(Rule(KNOB_FIELDS[k], s[k], f"must be one of {', '.join(map(str, allowed))}", (k,)))
    dims = s["order"].split("-") if isinstance(s["order"], str) else []
    if sorted(dims) != sorted(DIM_NAMES):
        out.append(Rule(KNOB_FIELDS["order"], s["order"], "must order each of tp, cp, ep, dp, pp once",
                        ("order",)))
    return out


def errors(s: dict) -> list[Rule]:
    """Every broken rule of the (already adjusted) sizes."""
    out = _positive(s) + _choices(s)
    if out:
        return out
    tp, pp, cp, world, seq = s["tp"], s["pp"], s["cp"], s["world"], s["seq"]
    mp = tp * pp * cp
    if world % mp:
        out.append(Rule(KNOB_FIELDS["tp"], tp, f"TP*PP*CP = {tp}*{pp}*{cp} = {mp} must divide the "
                        f"world size {world}", ("tp", "pp", "cp", "world")))
        return out
    dp = world // mp
    if s["sp"] and tp == 1:
        out.append(Rule(KNOB_FIELDS["sp"], True, "sequence parallelism needs tensor_model_parallel_size > 1",
                        ("sp", "tp")))
    if cp > 1 and seq % (2 * cp):
        out.append(Rule(KNOB_FIELDS["cp"], cp, f"context parallelism needs seq_length divisible by "
                        f"2*{cp}={2 * cp}; seq_length={seq} is not", ("seq", "cp")))
    elif s["sp"] and (seq // cp) % tp:
        out.append(Rule(KNOB_FIELDS["sp"], True, f"sequence parallelism needs seq_length/CP = {seq}/{cp} "
                        f"divisible by tensor_model_parallel_size={tp}", ("seq", "tp", "sp")))
    heads, kv = s["heads"], s["kv"] or s["heads"]
    if heads % tp:
        out.append(Rule(KNOB_FIELDS["heads"], heads, f"attention heads must divide evenly over "
                        f"tensor_model_parallel_size={tp}", ("tp",)))
    if s["mla"]:
        pass  # MLA has no KV heads: every head gets its keys and values from the shared latent
    elif heads % kv:
        out.append(Rule(KNOB_FIELDS["kv"], kv, f"num_attention_heads={heads} must be a multiple of the "
                        "number of KV heads", ("kv",)))
    elif kv % tp and tp % kv:
        out.append(Rule(KNOB_FIELDS["kv"], kv, f"KV heads must be divisible by TP={tp} or TP "
                        "divisible by KV heads", ("tp", "kv")))
    out += _widths(s)
    if s["qk_scope"] == "projection" and (s["mla"] or s["norm"] != "RMSNorm"):
        what = "multi_latent_attention" if s["mla"] else f"normalization={s['norm']}"
        out.append(Rule(KNOB_FIELDS["qk_scope"], "projection", f"q / k norms over the whole projection are "
                        f"OLMoE's RMSNorms over GQA's q and k, not built with {what}", ("qk_scope", "norm")))
    out += _cp_exchange(s)
    out += _pipeline(s, dp)
    out += _moe(s, dp)
    if s["pos"] == "learned_absolute" and seq > s["maxpos"]:
        out.append(Rule(KNOB_FIELDS["maxpos"], s["maxpos"], f"learned absolute positions need "
                        f"max_position_embeddings >= seq_length={seq} (one table row per position)",
                        ("maxpos", "seq")))
    if s["gbs"] % (s["mbs"] * dp):
        out.append(Rule(KNOB_FIELDS["gbs"], s["gbs"], f"global batch must be a multiple of "
                        f"micro_batch_size*DP = {s['mbs']}*{dp} = {s['mbs'] * dp}", ("gbs", "mbs")))
    out += a2a_overlap_problems(s)
    if s["tp_overlap"] and not s["sp"]:
        out.append(Rule(KNOB_FIELDS["tp_overlap"], True, "TP communication overlap (tp_comm_overlap) needs sequence "
                        "parallelism (sequence_parallel, with TP > 1), as Megatron-LM requires", ("tp_overlap", "sp")))
    if s["rgran"] == "full" and s["rmethod"] not in ("uniform", "block"):
        out.append(Rule(KNOB_FIELDS["rmethod"], s["rmethod"], "full recompute needs recompute_method uniform "
                        "or block (Megatron-LM refuses without one)", ("rmethod",)))
    if s["rgran"] == "selective" and s["rmethod"] is not None:
        out.append(Rule(KNOB_FIELDS["rmethod"], s["rmethod"], "recompute_method applies to full recompute "
                        "only (Megatron-LM refuses it with selective)", ("rmethod", "rgran")))
    if s["rgran"] == "full" and s["rmethod"] in ("uniform", "block") and not s["rnum"]:
        out.append(Rule(KNOB_FIELDS["rnum"], None, f"full recompute with method {s['rmethod']} needs "
                        "recompute_num_layers (Megatron-LM refuses without it)", ("rnum",)))
    return out


def _cp_exchange(s: dict) -> list[Rule]:
    """The CP exchange's own rules (cp_comm_type: all-to-all's heads, a2a+p2p's two sizes)."""
    out, tp, cp, heads = [], s["tp"], s["cp"], s["heads"]
    if s["cp_comm"] == "a2a" and cp > 1 and heads % (cp * tp):
        out.append(Rule(KNOB_FIELDS["cp_comm"], "a2a", f"all-to-all context parallelism needs the "
                        f"{heads // tp if heads % tp == 0 else heads} heads per TP rank divisible by "
                        f"CP={cp}", ("cp", "cp_comm")))
    if s["cp_comm"] == "a2a+p2p":
        h = s["hcp"]
        if not h or len(h) != 2 or prod(h) != cp:
            out.append(Rule(KNOB_FIELDS["hcp"], list(h) if h else h, f"cp_comm_type a2a+p2p needs "
                            f"hierarchical_context_parallel_sizes [a2a, p2p] whose product is CP={cp}",
                            ("hcp", "cp_comm")))
        elif heads % tp == 0 and (heads // tp) % h[0]:
            out.append(Rule(KNOB_FIELDS["hcp"], list(h), f"cp_comm_type a2a+p2p needs the {heads // tp} heads "
                            f"per TP rank divisible by the all-to-all size {h[0]}", ("hcp", "cp_comm")))
    return out


def exchange_errors(s: dict) -> list[Rule]:
    """`errors(s)` where sizes equal to `s` but for the CP exchange (cp_comm) break no rule: only the
    rules that read it can break (of the choices, the exchange's: `errors` then lists the choices'
    problems alone; else the exchange's own rules), and `adjust` does not read it."""
    return _choices(s) or _cp_exchange(s)


def ffn_of(s: dict) -> int:
    if s["ffn"]:
        return s["ffn"]
    return 4 * s["hidden"] if s["act"] == "gelu" else default_ffn_size(s["hidden"])


def _widths(s: dict) -> list[Rule]:
    """Widths Megatron-Core splits with `divide()` (an assert): head_dim, and the MLP over TP."""
    out, tp = [], s["tp"]
    if not s["mla"] and s["kvc"] is None and s["hidden"] % s["heads"]:
        out.append(Rule(KNOB_FIELDS["hidden"], s["hidden"], f"hidden_size must be a multiple of "
                        f"num_attention_heads={s['heads']} (head_dim = hidden/heads; or set kv_channels)",
                        ("hidden", "heads")))
    ffn = ffn_of(s)
    if ffn % tp:
        unset = "4*hidden" if s["act"] == "gelu" else "8*hidden/3 rounded to 64"
        given = "" if s["ffn"] else f" (unset: {unset} = {ffn})"
        out.append(Rule(KNOB_FIELDS["ffn"], ffn, f"the MLP width{given} must divide evenly over "
                        f"tensor_model_parallel_size={tp}", ("ffn", "tp")))
    if s["experts"] and s["shared"] and s["shared"] % tp:
        out.append(Rule(KNOB_FIELDS["shared"], s["shared"], f"the shared experts' width must divide "
                        f"evenly over tensor_model_parallel_size={tp}", ("shared", "tp")))
    return out


def stage_layers(s: dict) -> list[int]:
    """Decoder layers per virtual stage for sizes `s`; ValueError with the rule when impossible."""
    chunks = REGISTRY[s["schedule"]].chunks(s["vpp"])
    if s["split"] is not None:
        split = list(s["split"])
        if any(x is not None for x in (s["first"], s["last"])) or s["acc_emb"] or s["acc_loss"]:
            raise ValueError("an explicit pipeline_layers_per_stage excludes Megatron's uneven-split options")
        if len(split) != s["pp"] * chunks or sum(split) != s["layers"] or min(split) < 0:
            raise ValueError(f"pipeline_layers_per_stage={split} must have pp*vpp={s['pp'] * chunks} "
                             f"entries >= 0 summing to num_layers={s['layers']}")
        return split
    return layers_per_stage(s["layers"], s["pp"], chunks, s["first"], s["last"], bool(s["acc_emb"]),
                            bool(s["acc_loss"]))


def _layout(s: dict):
    """(the parsed pipeline_model_parallel_layout, why it cannot be trained with the other sizes of
    `s`): (None, None) when unset, (None, why) when it does not parse."""
    if not s["pp_layout"]:
        return None, None
    try:
        stages = parse_layout(s["pp_layout"])
    except UserError as e:
        return None, str(e).split(": ", 1)[-1]  # the message without its flag and value (the Rule names them)
    return stages, _layout_problem(s, stages)


def _layout_problem(s: dict, stages) -> str | None:
    """Why the parsed layout string cannot be trained with the other sizes of `s` (None: it can)."""
    given = [KNOB_FIELDS[k] for k in ("vpp_layers", "first", "last") if s[k] is not None]
    if given:
        return f"places the layers itself: unset {', '.join(given)} (Megatron-LM refuses both)"
    if s["split"] is not None and tuple(s["split"]) != stages.decoder:
        return f"places {list(stages.decoder)} decoder layers per stage; pipeline_layers_per_stage says {list(s['split'])}"
    pp = s["pp"]
    if stages.stages % pp:
        return f"has {stages.stages} stages, not a multiple of pipeline_model_parallel_size={pp}"
    if s["vpp"] not in (None, stages.stages // pp):
        return (f"has {stages.stages} stages: PP={pp} x VPP={stages.stages // pp}; virtual_pipeline_model_parallel_size "
                f"says {s['vpp']} (unset it: the string sets it)")
    if sum(stages.decoder) != s["layers"]:
        return f"places {sum(stages.decoder)} decoder layers (t); num_layers={s['layers']}"
    mtp = s["mtp"] or 0
    if sum(stages.mtp) != mtp:
        return f"places {sum(stages.mtp)} MTP layers (m); mtp_num_layers={mtp}"
    return None


def _pipeline(s: dict, dp: int) -> list[Rule]:
    out = []
    _, problem = _layout(s)
    if problem:
        return [Rule(KNOB_FIELDS["pp_layout"], s["pp_layout"], problem, ("pp_layout",))]
    if s["vpp_layers"]:
        return [Rule(KNOB_FIELDS["vpp_layers"], s["vpp_layers"], f"num_layers={s['layers']} must be a "
                     f"multiple of PP*num_layers_per_virtual_pipeline_stage", ("vpp_layers", "pp"))]
    try:
        stage_layers(s)
    except ValueError as e:
        knobs = ("split",) if s["split"] is not None else ("pp", "vpp", "first", "last")
        out.append(Rule(KNOB_FIELDS["layers"], s["layers"], str(e), knobs))
    if s["gbs"] % (s["mbs"] * dp) == 0:
        broken = microbatch_problem(s["schedule"], s["pp"], s["vpp"], s["gbs"] // (s["mbs"] * dp), s["group"])
        if broken:
            knob = "group" if s["group"] is not None else "vpp"
            knobs = ("group", "gbs") if knob == "group" else \
                ("gbs", "group", "vpp", "pp") if "multiple" in broken else ("vpp", "pp", "schedule")
            out.append(Rule(KNOB_FIELDS[knob], s[knob], broken, knobs))
    return out


def _moe(s: dict, dp: int) -> list[Rule]:
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
