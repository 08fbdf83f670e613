"""One pipeline's shards: start, place, preempt, sleep, wake; the client that fans control out.

api.py (the fleet's Protocols), fleet.py (ShardFleet), shard_process.py (one server process by
PID), backends.py (embedded | vllm command lines), actors.py (Ray shells), client.py
(RemoteInferenceClient).
"""
