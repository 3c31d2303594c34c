"""Validation: every problem of a config at once, each naming field, value, rule and a fix.

(Placeholder interface; the foundation work fills in the rules.)
"""
from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.schema import Config
from fivefold.errors import UserError
from fivefold.topology import Layout


@dataclass(frozen=True)
class Problem:
    field: str
    """Dotted canonical field name, e.g. parallel.tensor_model_parallel_size."""
    value: object
    rule: str
    fix: str
    """A value that would work, e.g. 'tensor_model_parallel_size=2'."""
    severity: str = "error"
    """error, or warning (the config was adjusted or is legal but slow)."""

    def __str__(self) -> str:
        return f"{self.severity}: {self.field}={self.value!r}: {self.rule} (fix: {self.fix})"


class ConfigError(UserError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def validate(config: Config, dialect: str = "fivefold") -> list[Problem]:
    """All problems (errors and warnings); adjustments a dialect makes are applied to `config`."""
    raise NotImplementedError


def layout_of(config: Config) -> Layout:
    """The dense + expert grids a (valid) config asks for."""
    p, world = config.parallel, config.cluster.resolved_world_size
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    etp = p.expert_tensor_parallel_size if p.expert_tensor_parallel_size is not None else tp
    return Layout(tp=tp, cp=cp, pp=pp, dp=world // (tp * cp * pp), ep=p.expert_model_parallel_size, etp=etp, order=p.order)
