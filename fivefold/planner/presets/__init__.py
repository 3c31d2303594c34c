"""Model and hardware presets (models.py, hardware.py), and the `--model` argument resolved to a model
(model_spec.py: a preset name, a Hugging Face config.json or a fivefold YAML). A new model or GPU
goes in models.py or hardware.py."""
from fivefold.planner.presets.hardware import HARDWARE_PRESETS, Hardware, hardware
from fivefold.planner.presets.models import MODEL_PRESETS, ModelPreset, model_preset

__all__ = ["HARDWARE_PRESETS", "Hardware", "hardware", "MODEL_PRESETS", "ModelPreset", "model_preset"]
