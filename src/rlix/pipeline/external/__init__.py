"""External pipelines: a training loop that is another program (rlix.client), with rlix running
its shards, router, weight path and GPUs (runner.py); the program's process (program.py); the
versions it builds in its own cache (publisher.py)."""
