"""Inference, in four layers, each importing only the layers below it:

engine/  the embedded continuous-batching engine behind `EngineAPI`
server/  the engine server: vLLM's HTTP API (data plane + control plane) around one engine
router/  one pipeline's data plane: routes requests to its shards, re-dispatches preempted ones
fleet/   one pipeline's shards: processes, backends, preemption, the control-plane client
"""
