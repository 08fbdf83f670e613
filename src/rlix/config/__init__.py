"""Typed configuration models and YAML loading (no torch or Ray imports here)."""

from rlix.config.loader import load_config, load_model
from rlix.config.models import ClusterConfig, PipelineConfig, RlixConfig, SchedulerConfig

__all__ = ["ClusterConfig", "PipelineConfig", "RlixConfig", "SchedulerConfig", "load_config", "load_model"]
