"""What a pipeline schedule needs of (pp, vpp, microbatches): one rule, shared by config validation
and the schedule generators, so that the validator accepts exactly what the generators build."""
from __future__ import annotations


def microbatch_problem(schedule: str, pp: int, vpp: int | None, num_microbatches: int) -> str | None:
    """None when `schedule` can run `num_microbatches` on `pp` ranks with `vpp` chunks each, else the rule broken."""
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
    return None
