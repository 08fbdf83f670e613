"""bench/gpu2_pipelines.py's measurements: the shard-token sampler finds a real engine server by
its command line and counts what it generated in a window; train phases come from a timeline."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "inference"))
from gpu2_pipelines import ShardTokens, _at, train_windows  # noqa: E402
from kit import AUTH, shard_processes  # noqa: E402


def test_a_counter_is_read_between_samples_and_flat_outside_them():
    rows = [(10.0, 0.0), (12.0, 100.0), (14.0, 100.0)]
    assert _at(rows, 9.0) == 0.0 and _at(rows, 11.0) == 50.0 and _at(rows, 13.0) == 100.0
    assert _at(rows, 20.0) == 100.0 and _at([], 5.0) == 0.0


def test_the_sampler_counts_a_real_servers_generated_tokens_in_a_window(tiny_model_dir):
    with shard_processes(tiny_model_dir, 1) as (proc,), ShardTokens(period_s=0.05) as tokens:
        deadline = time.monotonic() + 30
        while not any(s[1] == proc.url for s in tokens.samples):
            assert time.monotonic() < deadline, "the sampler never found the server"
            time.sleep(0.05)
        time.sleep(0.2)
        t0 = time.time()
        body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 12, "ignore_eos": True}}
        for _ in range(3):
            r = httpx.post(proc.url + "/inference/v1/generate", json=body, headers=AUTH, timeout=60)
            assert len(r.json()["choices"][0]["token_ids"]) == 12
        t1 = time.time()
        time.sleep(0.3)  # a sample after the last request
        # counted once, though its guard process carries the same command line
        assert proc.url in ShardTokens.servers()
        visible = next(s[2] for s in tokens.samples if s[1] == proc.url)
        assert tokens.tokens(visible, t0 - 0.1, t1 + 0.2) == 36
        assert tokens.tokens(visible, t1 + 0.2, time.time()) == 0
        assert tokens.tokens("no such GPU", t0, t1) == 0


def test_train_windows_are_read_from_the_timeline_for_one_gpu(tmp_path):
    def span(gpu: int, role: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "gpu", "name": role, "ts": ts * 1e6, "dur": dur * 1e6,
                "args": {"gpu": gpu, "role": role}}

    events = [span(0, "p/generate#1", 0, 2), span(0, "p/train", 2, 1), span(1, "p/train", 2, 1),
              span(0, "p/train", 4, 0.5), {"ph": "M", "name": "thread_name", "args": {}}]
    (tmp_path / "timeline.json").write_text(json.dumps({"traceEvents": events, "otherData": {"started_at": 100.0}}))
    assert train_windows(tmp_path, 0) == [(102.0, 103.0), (104.0, 104.5)]
    assert train_windows(tmp_path, 1) == [(102.0, 103.0)]
