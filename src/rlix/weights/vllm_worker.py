"""rlix's worker extension for a real vLLM server: loads a version from rlix's bucket cache.

vLLM loads this class into each of its workers (`--worker-extension-cls`); rlix calls its methods
through vLLM's dev-mode `POST /collective_rpc`, whose arguments must be strings, so every call
takes and answers one JSON string. The buckets are read where they lie (the trainer's
shared-memory cache), rebuilt into named tensors by wire.py, and handed to vLLM's
`reload_weights`, which handles vLLM's own fused and repacked layouts.

An update is all or nothing: every bucket is read and checked before vLLM's weights are
touched, so a missing segment, a bad checksum or an incomplete update leaves the old weights
serving. Like wire.py, this module is imported inside vLLM's environment, where rlix is not
installed: torch, the standard library and its sibling `wire` only (rlix.inference.fleet.backends
stages both into a package of their own for the server's PYTHONPATH).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from . import wire


class RlixWorkerExtension:
    """Mixed into vLLM's worker class; state lives in attributes prefixed `rlix_`."""

    rlix_layout: wire.Layout | None = None
    rlix_mapper: wire.ShmMapper | None = None
    rlix_verify: bool = False
    rlix_version: int = 0

    def rlix_init_transfer(self, payload: str) -> str:
        """Take the layout (sent once per layout) and the transport kind."""
        info = json.loads(payload)
        if info.get("transport", "shm") != "shm":
            raise ValueError(f"rlix's vLLM extension reads shared memory only, not {info.get('transport')!r}")
        layout = wire.Layout.from_json(info["layout"])
        names = set(self._rlix_param_names())
        if names and not any(_loadable(e.name, names) for e in layout.entries):
            raise ValueError("layout does not fit the served model: none of its tensors is one of the "
                             f"model's parameters (first: {layout.entries[0].name!r})")
        self.rlix_layout = layout
        self.rlix_verify = bool(info.get("verify", False))
        if self.rlix_mapper is None:
            self.rlix_mapper = wire.ShmMapper()
        return json.dumps({"layout_id": layout.layout_id})

    def rlix_sync(self, payload: str) -> str:
        """Apply one version: every bucket read and checked first, then one reload."""
        job = json.loads(payload)
        layout, mapper = self.rlix_layout, self.rlix_mapper
        if layout is None or mapper is None:
            raise ValueError("no transfer layout yet: rlix_init_transfer first")
        if job.get("layout_id") != layout.layout_id:
            raise ValueError(f"update for layout {job.get('layout_id')!r}; this worker holds {layout.layout_id!r}")
        version = int(job["weight_version"])
        t0 = time.perf_counter()
        session = wire.ReceiveSession(wire.BucketAssembler(layout), version, verify=self.rlix_verify)
        named: list[tuple[str, torch.Tensor]] = []
        for message in job["updates"]:
            bucket = mapper.bucket(str(message["shm"]), int(message["offset"]), int(message["nbytes"]))
            named.extend(session.accept(message, bucket))
        session.close()  # raises if any bucket or tensor never arrived
        t1 = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=iter(named))
        self.rlix_version = version
        return json.dumps({"weight_version": version, "tensors": len(named),
                           "read_s": round(t1 - t0, 6), "reload_s": round(time.perf_counter() - t1, 6)})

    def rlix_weight_version(self, payload: str = "{}") -> str:
        return json.dumps({"weight_version": self.rlix_version})

    def _rlix_named_parameters(self) -> list[tuple[str, Any]]:
        return list(self.model_runner.get_model().named_parameters())

    def _rlix_param_names(self) -> list[str]:
        return [n for n, _ in self._rlix_named_parameters()]


def _loadable(name: str, params: set[str]) -> bool:
    """A checkpoint name vLLM can load: itself, or a part of one of its fused parameters."""
    if name in params:
        return True
    for part, fused in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj"),
                        ("gate_proj", "gate_up_proj"), ("up_proj", "gate_up_proj")):
        if f".{part}." in name and name.replace(f".{part}.", f".{fused}.") in params:
            return True
    return name == "lm_head.weight"  # tied to the embedding in small Qwen2 models
