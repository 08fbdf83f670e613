"""rlix: time-share one GPU cluster across many LLM reinforcement-learning pipelines."""

__version__ = "0.1.0"
