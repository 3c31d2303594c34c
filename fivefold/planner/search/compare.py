"""A layout the user names, beside the search's ranking: `fivefold plan --compare "TP4 PP8 VPP5"`.

The description is the planner's own label grammar (what `plan` prints), case-insensitive, words in
any order: TPn (sequence parallelism on when n > 1; "TPn+SP" is accepted), CPn or CPn(p2p|a2a),
PPn, VPPn, groupN (interleaving's microbatches per group, Megatron's
--microbatch-group-size-per-virtual-pipeline-stage; default PP, or the smallest group that runs a
microbatch count PP does not divide, as the search takes it), one schedule name other than 1f1b/interleaved (zb-h1, dualpipev, gpipe), EPn, ETPn, DPn
(checked against the GPU count), mbsN, rc-none | rc-sel | rc-full, or rc-sel(MODULE,...) with Megatron's
--recompute-modules (core_attn, mla_up_proj, layernorm, mlp, moe_act, moe, shared_experts), and
a2a-overlap (read, not required: the runtime's 1F1B all-to-all overlap is on where the search would
put it, `SearchSpace.a2a_overlap`). A size left out is 1 (ETP: TP);
the micro-batch and recompute left out are the search's: the smallest micro-batch of the search, and
the first recompute mode that fits. A label's split is read as it prints it: splitF/../L
(Megatron's --decoder-first/last-pipeline-num-layers) or split+emb / split+loss / split+embloss (its
--account-for-embedding/loss-in-pipeline-split). Where no split is named and the layers do not divide
over PP x VPP, the split the search would try is taken (Megatron's uneven first/last stage or the embedding/loss as layers), else
a per-stage list as Megatron's --pipeline-model-parallel-layout writes it (61 layers on PP8 x VPP4).

`rank_of` places a named layout among the ranked ones: 1 + the searched layouts that are faster;
`held_to` finds the fewest of its own choices that, held fixed, put it among the first few (what the
search weighs against it: a published run's constraint, or a choice that costs it).
"""
from __future__ import annotations

import itertools
import re

from fivefold.errors import UserError
from fivefold.pipeline.schedules import REGISTRY
from fivefold.config.modules import RECOMPUTE_MODULES, modules_not_in
from fivefold.planner.memory.mtp import mtp_stage_layers
from fivefold.planner.search.configs import A2A_OVERLAP, DP_MODE_LABEL, make_config, with_group, recompute_label
from fivefold.planner.search.ranking import Candidate, evaluate, rank_key
from fivefold.planner.search.space import SearchSpace, layer_splits

_SIZE = re.compile(r"(tp|cp|pp|vpp|group|ep|etp|dp|mbs)(\d+)$")
_RECOMPUTE = {"rc-none": None, "rc-sel": "selective", "rc-selective": "selective", "rc-full": "full"}
GRAMMAR = ("TPn[+SP] CPn[(p2p|a2a)] PPn VPPn [groupN] [splitF/../L|split+emb|split+loss|split+embloss] EPn ETPn DPn "
           "mbsN rc-none|rc-sel[(MODULE,...)]|rc-full [distopt|zero2|fsdp] [gpipe|zb-h1|dualpipev] [a2a-overlap], "
           "e.g. \"TP4 PP8 VPP5 DP32 mbs1 rc-sel\"")
DP_MODES = {label: mode for mode, label in DP_MODE_LABEL.items() if label} | {"zero1": "optim", "zero3": "optim_grads_params"}
"""Words for the data-parallel mode (the labels', and ZeRO's stage names)."""


def parse(text: str) -> dict:
    """The words of a layout description -> {"sizes": {...}, "cp_comm": ..., "schedule": ..., "recompute": ...}."""
    sizes, out = {}, {"cp_comm": "p2p", "schedule": None, "recompute": "search", "modules": None, "dp_mode": None}
    if not text.strip():
        raise UserError(f"--compare {text!r}: name a layout; the grammar is {GRAMMAR}")
    words = text.lower()
    m = re.search(r"rc-sel(?:ective)?\(([^)]*)\)", words)
    if m:  # rc-sel(layernorm,moe): Megatron's --recompute-modules
        out["recompute"], out["modules"] = "selective", [x.strip() for x in m.group(1).split(",") if x.strip()]
        unknown = [x for x in out["modules"] if x not in RECOMPUTE_MODULES] or ([] if out["modules"] else ["(none)"])
        if unknown:
            raise UserError(f"--compare {text!r}: recompute module {', '.join(unknown)} unknown; Megatron's are "
                            + ", ".join(RECOMPUTE_MODULES))
        words = words[:m.start()] + " " + words[m.end():]
    for word in words.replace(",", " ").split():
        if word in ("split", A2A_OVERLAP):
            continue
        split = _split(word)
        if split is not None:
            if out.get("split"):
                raise UserError(f"--compare {text!r}: two layer splits given")
            out["split"] = split
            continue
        if word in DP_MODES or word in _RECOMPUTE:  # (rc-sel(...) was read above: its recompute is set)
            key, value = ("dp_mode", DP_MODES[word]) if word in DP_MODES else ("recompute", _RECOMPUTE[word])
            if out[key] != (None if key == "dp_mode" else "search"):
                raise UserError(f"--compare {text!r}: {'a DP mode' if key == 'dp_mode' else 'recompute'} given "
                                f"twice ({word!r} the second): keep one")
            out[key] = value
            continue
        if word in REGISTRY and word != "interleaved":  # (1f1b: the default; interleaved: VPPn)
            out["schedule"] = None if word == "1f1b" else word
            continue
        m = re.fullmatch(r"cp(\d+)\((p2p|a2a|allgather|a2a\+p2p)\)", word)
        if m:
            sizes["cp"], out["cp_comm"] = int(m.group(1)), m.group(2)
            continue
        m = _SIZE.match(word.removesuffix("+sp"))
        if not m or int(m.group(2)) < 1:
            raise UserError(f"--compare {text!r}: cannot read {word!r}; the grammar is {GRAMMAR}")
        if m.group(1) in sizes:
            raise UserError(f"--compare {text!r}: {m.group(1).upper()} given twice")
        sizes[m.group(1)] = int(m.group(2))
    out["sizes"] = sizes
    return out


def _split(word: str) -> dict | None:
    """A label's layer split as ParallelConfig fields: splitF/../L (Megatron's decoder first / last
    pipeline stage layers, `none` where unset) or split+emb, split+loss, split+embloss (the embedding
    and / or loss counted as layers); None for another word."""
    m = re.fullmatch(r"split(\d+|none)/\.\./(\d+|none)", word)
    if m:
        first, last = (None if x == "none" else int(x) for x in m.groups())
        return {"decoder_first_pipeline_num_layers": first, "decoder_last_pipeline_num_layers": last}
    m = re.fullmatch(r"split\+(emb)?(loss)?", word)
    if m and any(m.groups()):
        return {"account_for_embedding_in_pipeline_split": bool(m.group(1)),
                "account_for_loss_in_pipeline_split": bool(m.group(2))}
    return None


def candidates(text: str, model, hw, world: int, gpus_per_node: int, seq: int, global_batch: int, precision: str,
               micro_batches: tuple[int, ...], mem, ta, grad_reduce_in_bf16: bool = False,
               dp_mode: str = "optim", space: SearchSpace = SearchSpace()) -> list[Candidate]:
    """The named layout evaluated: one Candidate per reading the description leaves open (the
    recompute modes when none is named, until one fits; the search's layer splits), fastest first,
    with the runtime switches of the search's `space` (overlaps, dispatcher, microbatch groups,
    Megatron-FSDP, fp8 recipe); UserError when the sizes do not make the GPU count."""
    d = parse(text)
    s = d["sizes"]
    tp, cp, pp, vpp = s.get("tp", 1), s.get("cp", 1), s.get("pp", 1), s.get("vpp", 1)
    if world % (tp * cp * pp):
        raise UserError(f"--compare {text!r}: TP*CP*PP = {tp * cp * pp} does not divide {world} GPUs")
    dp = world // (tp * cp * pp)
    if "dp" in s and s["dp"] != dp:
        raise UserError(f"--compare {text!r}: DP{s['dp']} with TP*CP*PP = {tp * cp * pp} makes "
                        f"{s['dp'] * tp * cp * pp} GPUs, not {world}; drop DP or fix it to DP{dp}")
    schedule = d["schedule"] or ("interleaved" if vpp > 1 else "1f1b")
    parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, context_parallel_size=cp,
                    cp_comm_type=d["cp_comm"], pipeline_model_parallel_size=pp, pipeline_schedule=schedule,
                    virtual_pipeline_model_parallel_size=vpp if schedule == "interleaved" else None,
                    microbatch_group_size_per_vp_stage=s.get("group"))
    absent = modules_not_in(model, d["modules"] or ())
    if absent:
        raise UserError(f"--compare {text!r}: recompute module {', '.join(absent)}: this model has none (no MoE "
                        "layer, MLA or shared expert to recompute); name the modules it has")
    if model.is_moe:
        parallel.update(expert_model_parallel_size=s.get("ep", 1), expert_tensor_parallel_size=s.get("etp", tp))
    elif "ep" in s or "etp" in s:
        raise UserError(f"--compare {text!r}: EP/ETP apply to MoE models only")
    chunks = REGISTRY[schedule].chunks(parallel["virtual_pipeline_model_parallel_size"])
    if d.get("split") and pp == 1:
        raise UserError(f"--compare {text!r}: a layer split needs PP > 1")
    splits = [d["split"]] if d.get("split") else (layer_splits(
        model.num_layers, pp, chunks, explicit=True, last_extra=mtp_stage_layers(model)) if pp > 1 else None) or [{}]
    mbs = [s["mbs"]] if "mbs" in s else [min(micro_batches)]
    modes = [d["recompute"]] if d["recompute"] != "search" else [None, "selective", "full"]
    out = []
    for split in splits:
        for recompute in modes:
            cfg = make_config(model, world, gpus_per_node, seq, global_batch, precision, {**parallel, **split},
                              micro_batch=mbs[0], recompute=recompute, grad_reduce_in_bf16=grad_reduce_in_bf16,
                              recompute_modules=d["modules"], dp_mode=d["dp_mode"] or dp_mode,
                              a2a_overlap=space.a2a_overlap, dispatcher=space.dispatcher,
                              megatron_fsdp=space.megatron_fsdp, fp8_recipe=space.fp8_recipe,
                              tp_comm_overlap=space.tp_comm_overlap)
            c = evaluate(cfg if "group" in s else with_group(cfg, space.group_rule), hw, mem, ta)
            out.append(c)
            if c.estimate is not None:
                break
    fitting = sorted((c for c in out if c.estimate is not None), key=rank_key)
    return fitting or out[-1:]


def rank_of(cand: Candidate, ranked: list[Candidate]) -> int | None:
    """1 + the ranked layouts faster than `cand`; None when `cand` does not fit or breaks a rule."""
    if cand.estimate is None:
        return None
    return 1 + sum(rank_key(c) < rank_key(cand) for c in ranked)


LAYOUT_FIELDS = {
    "tp": lambda p: p.tp, "cp": lambda p: p.cp, "pp": lambda p: p.pp, "dp": lambda p: p.dp,
    "ep": lambda p: p.ep, "etp": lambda p: p.etp, "vpp": lambda p: p.vpp, "micro_batch": lambda p: p.mbs,
    "recompute": lambda p: (p.recompute, p.recompute_modules if p.recompute == "selective" else None),
    "fsdp": lambda p: p.config.training.data_parallel_sharding_strategy, "split": lambda p: tuple(p.rank_chunks)}
"""A layout's fields as gpu-runs.tsv's columns name them (a Plan -> the value)."""
HOLDABLE = ("tp", "cp", "pp", "vpp", "dp", "ep", "micro_batch", "recompute", "fsdp")
"""The fields `held_to` may hold (the split and expert TP follow from the others)."""


def held_to(cand: Candidate, ranked: list[Candidate], top: int = 5,
            most: int = 2) -> tuple[tuple[str, ...], int, int] | None:
    """The fewest (up to `most`) of `cand`'s `HOLDABLE` fields that, held to its values, put it in the
    first `top` and the faster half of the ranked layouts sharing them (a set only it or a few slower
    ones share says nothing): (the fields, its rank there, how many share them, itself included), the
    best rank among the smallest such sets; None when no set does (or it does not fit)."""
    if cand.estimate is None:
        return None
    mine = tuple(LAYOUT_FIELDS[f](cand.plan) for f in HOLDABLE)
    key = rank_key(cand)
    rows = [(tuple(LAYOUT_FIELDS[f](c.plan) for f in HOLDABLE), rank_key(c) < key) for c in ranked]
    for size in range(1, most + 1):
        found = []
        for fields in itertools.combinations(range(len(HOLDABLE)), size):
            same = [faster for values, faster in rows if all(values[i] == mine[i] for i in fields)]
            rank = 1 + sum(same)
            if rank <= top and 2 * rank <= len(same) + 1:  # in the better half, not alone or last
                found.append((rank, -len(same), fields))
        if found:
            rank, _, fields = min(found)
            same = [c for c, (values, _) in zip(ranked, rows) if all(values[i] == mine[i] for i in fields)]
            return tuple(HOLDABLE[i] for i in fields), rank, len(same) + all(c.label != cand.label for c in same)
    return None


def held_text(cand: Candidate, held: tuple[tuple[str, ...], int, int]) -> str:
    """`held_to`'s answer in words: "held to its PP1 and rc-full, it ranks 1 of 20"."""
    fields, rank, of = held
    words = {"tp": "TP{}", "cp": "CP{}", "pp": "PP{}", "vpp": "VPP{}", "dp": "DP{}", "ep": "EP{}",
             "micro_batch": "mbs{}"}
    named = []
    for f in fields:
        value = LAYOUT_FIELDS[f](cand.plan)
        if f == "recompute":
            named.append(recompute_label(*value))
        elif f == "fsdp":
            named.append(DP_MODE_LABEL.get(value) or value)
        else:
            named.append(words[f].format(value))
    return f"held to its {' and '.join(named)}, it ranks {rank} of the {of} layouts that share them"
