"""Model presets (random-initialised Qwen2 shapes) and model path resolution."""

from rlix.models.presets import (
    PRESETS,
    Preset,
    build_preset,
    preset_config,
    preset_names,
    resolve_model,
)

__all__ = ["PRESETS", "Preset", "build_preset", "preset_config", "preset_names", "resolve_model"]
