"""Async GRPO pipelines: the top of the stack, assembling training, inference and weight sync.

runner.py (PipelineRunner: one pipeline assembled), parts.py (its parts, and how each one
started is stopped), actor.py (its Ray shell, which the scheduler calls), hooks.py /
scheduler_hooks.py (the run mode as a strategy), coordinator.py (shards as the scheduler moves
them, and the versions they serve), async_grpo.py (the training loop), rollout/ (collector,
buffer, trajectory types), reporting/ (metrics.jsonl, trackers).
"""
