"""A pipeline's rollouts: the collector that keeps its shards busy, the buffer of versioned GRPO
groups with its accounting, and the trajectory types they share with the loop."""
