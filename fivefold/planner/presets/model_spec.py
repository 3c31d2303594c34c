"""MODEL on the command line: a preset name, a Hugging Face config.json, or one of our configs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fivefold.config.schema import Config, ModelConfig
from fivefold.errors import UserError
from fivefold.config.hf import load_hf_config
from fivefold.planner.presets.models import MODEL_PRESETS, model_preset


@dataclass
class ModelSpec:
    model: ModelConfig
    preset: str | None
    """Preset name, when MODEL was one."""
    config: Config | None = None
    """The whole config, when MODEL was one of our config files."""


def resolve_model(spec: str) -> ModelSpec:
    p = Path(spec)
    if p.suffix == ".json" or p.is_dir():
        return ModelSpec(load_hf_config(p), None)
    if p.suffix in (".yaml", ".yml", ".txt"):
        from fivefold.config.load import load_config
        loaded = load_config(str(p))
        if not any(k.startswith("model.") for k in loaded.explicit):  # else the schema's 2-layer default
            raise UserError(f"{spec}: sets no model field (num_layers, hidden_size, ...): give a config with "
                            "the model, a preset name or a config.json")
        return ModelSpec(loaded.config.model, None, loaded.config)
    if spec.lower() in MODEL_PRESETS or not p.exists():
        preset = model_preset(spec)
        return ModelSpec(preset.model, preset.name)
    raise UserError(f"{spec}: not a preset, a config.json or a .yaml config")
