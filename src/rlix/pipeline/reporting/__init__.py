"""What a pipeline records of its steps: metrics.jsonl and the experiment trackers."""
