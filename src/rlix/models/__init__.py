"""Model presets (random-initialised Qwen2 shapes) and model path resolution; init.py (which
imports torch) draws a seeded preset's weights."""

from rlix.models.presets import (
    PRESETS,
    Preset,
    build_preset,
    is_seeded,
    preset_config,
    preset_names,
    resolve_model,
    shape_config,
)

__all__ = ["PRESETS", "Preset", "build_preset", "is_seeded", "preset_config", "preset_names", "resolve_model",
           "shape_config"]
