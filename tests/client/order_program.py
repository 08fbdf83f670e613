"""An external pipeline's program that calls rlix.client's hooks out of order on purpose, then
runs one real step; it writes what each call answered to the JSON file named by argv[1]
(test_client_calls.py reads it). Run by rlix as the pipeline's `external.command`."""

from __future__ import annotations

import json
import sys

import httpx
import torch
from transformers import AutoModelForCausalLM

import rlix.client


def answer(call) -> dict:  # type: ignore[no-untyped-def]
    try:
        value = call()
    except rlix.client.ClientError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"ok": repr(value)}


def main() -> None:
    out: dict = {}
    client = rlix.client.connect()
    info = client.info
    model = AutoModelForCausalLM.from_pretrained(info.model_path, dtype=torch.float32)
    out["before_start"] = answer(lambda: client.before_training(0))
    out["start"] = answer(lambda: client.start(model))
    out["second_start"] = answer(lambda: client.start(model))
    out["after_without_before"] = answer(lambda: client.after_training(0, model))
    out["wrong_step"] = answer(lambda: client.before_training(1))
    out["before"] = answer(lambda: client.before_training(0))
    out["before_again"] = answer(lambda: client.before_training(0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # a version the shards have not seen: the audit compares it
    out["after"] = answer(lambda: client.after_training(0, model, metrics={"reward": 0.5}))
    client.report_progress(0, 4)  # demand: the scheduler places a shard to serve it
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}
    with httpx.Client(base_url=info.base_url, timeout=120) as http:
        served = http.post("/inference/v1/generate", json=body, headers={"Authorization": f"Bearer {info.api_key}"})
        out["generate_status"] = served.status_code
        out["generate_versions"] = served.json()["choices"][0]["weight_versions"] if served.status_code == 200 else None
    client.close()
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
