"""The pipeline's validation rules: decoder layers per (virtual) stage, Megatron's layout string
(pipeline_model_parallel_layout), and the schedule's microbatch rules; over the flat sizes of knobs.py."""
from __future__ import annotations

from fivefold.config.knobs import KNOB_FIELDS, Rule
from fivefold.config.pipeline_layout import parse_layout
from fivefold.config.split import layers_per_stage
from fivefold.errors import UserError
from fivefold.pipeline.schedules import REGISTRY, microbatch_problem


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


def layout_of(s: dict):
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


def pipeline_rules(s: dict, dp: int) -> list[Rule]:
    out = []
    _, problem = layout_of(s)
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
