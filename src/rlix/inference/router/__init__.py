"""One pipeline's data plane: session-sticky routing over its shards, re-dispatch on preemption.

router.py (Router: shard table + relay; `generate` for in-process callers), relay.py (one request
forwarded and re-dispatched), attempts.py (what its attempts produced; the next one's body), shard_table.py (routing rules, no I/O), app.py (the HTTP face:
app, server, admin client), data_plane.py (the router on its own thread and loop).
"""
