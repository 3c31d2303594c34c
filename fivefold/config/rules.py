"""The validation rules, over a flat dict of the sizes they read (so the fix search can try many).

`sizes_of(config)` flattens a Config into short knob names; `adjust(s, dialect)` applies what a
dialect does on its own (returns warnings); `errors(s)` lists every broken rule. Each broken rule is
a `Rule` naming the canonical field, its value, the rule in words, and the knobs that may fix it,
the preferred one first (the fix search in fixes.py changes the fewest knobs).

The sizes and `Rule`: knobs.py; the pipeline's rules: rules_pipeline.py; MoE's: rules_moe.py. This module
applies them all and re-exports the names its readers use (`from fivefold.config.rules import ...`).
"""
from __future__ import annotations

from math import prod

from fivefold.config.knobs import KNOB_FIELDS, Rule, dp_of, etp_of, ffn_of, sizes_of
from fivefold.config.rules_moe import a2a_overlap_problems, moe_rules
from fivefold.config.rules_pipeline import layout_of, pipeline_rules, stage_layers
from fivefold.config.schema import (ACTIVATIONS, CP_COMM_TYPES, DIM_NAMES, DISPATCHERS, DROP_POLICIES, NORMALIZATIONS,
                                    POSITION_EMBEDDINGS, QK_NORM_SCOPES, ROUTER_DTYPES, ROUTER_SCORE_FUNCTIONS)
from fivefold.pipeline.schedules import REGISTRY

__all__ = ["KNOB_FIELDS", "Rule", "a2a_overlap_problems", "adjust", "dp_of", "errors", "etp_of", "exchange_errors",
           "ffn_of", "sizes_of", "stage_layers"]


def adjust(s: dict, dialect: str) -> list[Rule]:
    """Apply what the dialect's own tool does silently or with a warning; return those warnings."""
    out: list[Rule] = []
    if s["gbs"] is None and isinstance(s["mbs"], int) and s["tp"] * s["pp"] * s["cp"] > 0 \
            and s["world"] % (s["tp"] * s["pp"] * s["cp"]) == 0:
        s["gbs"] = s["mbs"] * dp_of(s)  # Megatron's default global batch
    stages, problem = layout_of(s)
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
    out += pipeline_rules(s, dp)
    out += moe_rules(s, dp)
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
