"""Weight sync into vLLM servers, on rlix's side: the shard endpoint that drives rlix's worker
extension over HTTP (endpoint.py), and vLLM's fused parameter names and digests (names.py).
The extension itself (../vllm_worker.py) lives beside wire.py: the two are staged together as a
package of their own into vLLM's environment."""
