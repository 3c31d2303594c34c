"""Model and hardware presets."""
from fivefold.planner.presets.hardware import HARDWARE_PRESETS, Hardware, hardware
from fivefold.planner.presets.models import MODEL_PRESETS, ModelPreset, model_preset

__all__ = ["HARDWARE_PRESETS", "Hardware", "hardware", "MODEL_PRESETS", "ModelPreset", "model_preset"]
