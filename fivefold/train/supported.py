"""What the training runtime builds today: the ONE place that refuses the rest.

Every knob the config accepts but the runtime does not run yet is one row of `RUNTIME_KNOBS`: the
field, the test "this value runs", and what it is. Work that builds a dimension flips its row (or
deletes it). `check_supported` refuses all unsupported values at once with "not implemented yet",
before any rank starts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fivefold.config.schema import Config
from fivefold.errors import NotImplementedYet


@dataclass(frozen=True)
class Knob:
    field: str
    """Dotted canonical field, e.g. parallel.tensor_model_parallel_size."""
    runs: Callable[[object], bool]
    """True for the values the runtime runs."""
    what: str


def _is(*ok):
    return lambda v: v in ok


RUNTIME_KNOBS: list[Knob] = [
    Knob("parallel.expert_model_parallel_size", _is(1), "expert parallelism (EP > 1)"),
    Knob("parallel.expert_tensor_parallel_size", _is(None, 1), "expert tensor parallelism (ETP > 1)"),
    Knob("model.num_experts", _is(None, 0), "Mixture-of-Experts layers"),
    Knob("training.precision", _is("fp32", "bf16"), "precisions other than fp32 and bf16"),
    Knob("training.optimizer", _is("adamw"), "optimizers other than adamw"),
]


def _get(config: Config, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def unsupported(config: Config) -> list[str]:
    """One line per knob set to a value the runtime does not run."""
    return [f"{k.field}={_get(config, k.field)!r} ({k.what})" for k in RUNTIME_KNOBS if not k.runs(_get(config, k.field))]


def check_supported(config: Config) -> None:
    """Raise NotImplementedYet (CLI: exit 2, no traceback) naming every unsupported knob."""
    problems = unsupported(config)
    if problems:
        raise NotImplementedYet("training with " + "; ".join(problems) +
                                " — this runtime trains data, tensor, sequence, context and pipeline "
                                "parallelism (DP, TP, SP, CP, PP, in any combination) so far")
