"""What a pipeline schedule needs of (pp, vpp, microbatches): one rule, shared by config validation
and the schedule generators, so that the validator accepts exactly what the generators build."""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")
"""The schedule names the generators build (fivefold.pipeline.generators.build_schedule)."""


def microbatch_problem(schedule: str, pp: int, vpp: int | None, num_microbatches: int) -> str | None:
    """None when `schedule` can run `num_microbatches` on `pp` ranks with `vpp` chunks each, else the rule broken."""
    if schedule not in SCHEDULES:
        return f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
    if pp < 1:
        return f"needs pipeline_model_parallel_size >= 1, got {pp}"
    if num_microbatches < 1:
        return f"needs at least 1 microbatch, got {num_microbatches}"
    if schedule == "interleaved":
        if pp < 2:
            return "interleaving (virtual pipeline stages) needs pipeline_model_parallel_size > 1"
        if not vpp or vpp < 2:
            return "interleaving needs virtual_pipeline_model_parallel_size >= 2"
        if num_microbatches % pp:
            return (f"interleaving needs the number of microbatches ({num_microbatches}) to be a "
                    f"multiple of pipeline_model_parallel_size={pp}")
    elif schedule == "dualpipev":
        if vpp not in (None, 2):
            return ("dualpipev always holds 2 stages per rank (V shape); leave "
                    f"virtual_pipeline_model_parallel_size unset or 2, got {vpp}")
        if num_microbatches < 2 * pp:
            return (f"dualpipev needs at least 2*pipeline_model_parallel_size = {2 * pp} microbatches, "
                    f"got {num_microbatches}")
    elif vpp not in (None, 1):
        return (f"virtual_pipeline_model_parallel_size={vpp} applies only to the interleaved schedule, "
                f"not {schedule}")
    return None
