"""The one canonical config: typed, keyword-only dataclasses, one per owner.

Every dialect (RLinf YAML, SkyRL / Megatron-Bridge overrides, Megatron-LM flags, AReaL allocation
modes, our own YAML and dotted overrides) is translated into these objects; nothing downstream reads
a dialect. Field names follow Megatron-Core where Megatron has one, so that its users recognise them.
Each field's docstring (the string under it) gives its unit and default.

Each section's dataclass lives in fivefold/config/sections/ (cluster, parallel, model, training, data,
checkpoint, logging), beside the values its choice fields take; `Config` joins them here, and this module
re-exports them, so `from fivefold.config.schema import ModelConfig` is the one way to name a section.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

from fivefold.config.sections.checkpoint import CheckpointConfig
from fivefold.config.sections.cluster import DEVICES, ClusterConfig
from fivefold.config.sections.data import DataConfig
from fivefold.config.sections.logging import LoggingConfig
from fivefold.config.sections.model import (ACTIVATIONS, DISPATCHERS, DROP_POLICIES, NORMALIZATIONS, POSITION_EMBEDDINGS,
                                            QK_NORM_SCOPES, ROUTER_DTYPES, ROUTER_SCORE_FUNCTIONS, ModelConfig,
                                            default_ffn_size)
from fivefold.config.sections.parallel import CP_COMM_SPELLINGS, CP_COMM_TYPES, DIM_NAMES, ParallelConfig, cp_comm_name
from fivefold.config.sections.training import FP8_FORMATS, FP8_RECIPES, TrainingConfig

__all__ = ["ACTIVATIONS", "CP_COMM_SPELLINGS", "CP_COMM_TYPES", "DEVICES", "DIM_NAMES", "DISPATCHERS", "DROP_POLICIES",
           "FP8_FORMATS", "FP8_RECIPES", "NORMALIZATIONS", "POSITION_EMBEDDINGS", "QK_NORM_SCOPES", "ROUTER_DTYPES",
           "ROUTER_SCORE_FUNCTIONS", "SECTIONS", "CheckpointConfig", "ClusterConfig", "Config", "DataConfig",
           "LoggingConfig", "ModelConfig", "ParallelConfig", "TrainingConfig", "config_from_dict", "cp_comm_name",
           "default_ffn_size", "to_dict"]


@dataclass(kw_only=True)
class Config:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS = {name: type(section) for name, section in vars(Config()).items()}
"""Section name -> its dataclass."""


def config_from_dict(d: dict) -> Config:
    """The Config `to_dict` wrote (a run spec, a checkpoint's metadata)."""
    return Config(**{name: cls(**d.get(name, {})) for name, cls in SECTIONS.items()})


def to_dict(obj) -> dict:
    """Nested plain dict of a config (for YAML output and comparisons)."""
    if is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj
