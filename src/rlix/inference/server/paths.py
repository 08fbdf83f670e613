"""The engine server's routes that other layers name (the router relays them, auth guards them)."""

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"  # translated to a chat completion (server/responses_api.py)
GENERATE = "/inference/v1/generate"

#: every route under these needs the bearer token (as in vLLM)
PROTECTED_PREFIXES = ("/v1/", "/inference/")
#: the control plane: always needs the bearer token (vLLM leaves its dev endpoints open)
CONTROL_PATHS = frozenset({
    "/pause", "/resume", "/is_paused", "/sleep", "/wake_up", "/is_sleeping", "/abort_requests",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
    "/finish_weight_update", "/abort_weight_update", "/weight_transfer_status", "/weight_info",
    "/sync_weights", "/weight_checksums",
})
#: the data plane's POST routes: bodies are size-limited there and a caller that leaves aborts
#: its request (the control plane carries weights and must not be cut by a caller's timeout)
DATA_PLANE_PREFIXES = ("/v1/", "/inference/", "/tokenize", "/detokenize")
#: the control path that carries weights themselves (a safetensors body): a body bound of its own
WEIGHTS_PATH = "/update_weights"
#: control paths whose JSON carries a bucket layout or every bucket's message (larger than the
#: rest of the control plane's bodies)
TRANSFER_PATHS = frozenset({"/init_weight_transfer_engine", "/sync_weights"})
