"""A whole `rlix run` (tiny model, CPU) as a researcher reads it: the console has every step's
line exactly once and in order, the last step's included, and a resume does not print the
checkpoint's step again; samples.jsonl holds readable samples; metrics.jsonl and TensorBoard
have the RL metrics with sane values."""

from __future__ import annotations

import io
import json
import re

import pytest
import ray
import yaml

from rlix.run import run

STEPS = 25
MAX_NEW_TOKENS = 6


def step_lines(text: str, name: str) -> list[int]:
    return [int(m) for m in re.findall(rf"\] {name}: step (\d+)/\d+ reward", text)]


def run_config(tmp_path, steps: int) -> str:  # type: ignore[no-untyped-def]
    pipe = {"name": "pa", "model": "tiny", "steps": steps, "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 2, "group_size": 2, "max_new_tokens": MAX_NEW_TOKENS,
                        "concurrency": 4}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 1}, "run_dir": str(tmp_path / "run"), "pipelines": [pipe],
           "logging": {"tensorboard": True, "samples_per_step": 3, "console_samples_every": 5}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_a_run_prints_every_step_once_and_records_samples_and_rl_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # deferred: slow

    out = io.StringIO()
    ray.shutdown()
    try:
        summary = run(run_config(tmp_path, STEPS), out=out)
    finally:
        ray.shutdown()
    printed = out.getvalue()
    assert summary["pipelines"]["pa"]["steps"] == STEPS
    assert step_lines(printed, "pa") == list(range(1, STEPS + 1)), printed
    # the samples table under every 5th step's line
    assert printed.count("reward     adv   tokens") == STEPS // 5

    pdir = tmp_path / "run" / "pa"
    samples = [json.loads(line) for line in (pdir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [s for s in range(1, STEPS + 1) for _ in range(3)]
    for s in samples:
        assert isinstance(s["prompt"], str) and s["prompt"] and isinstance(s["response"], str)
        assert 0.0 <= s["reward"] <= 1.0 and 1 <= s["response_tokens"] <= MAX_NEW_TOKENS

    rows = [json.loads(line) for line in (pdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["entropy"] > 0 and r["kl"] is None  # no KL term: no reference model
        assert 1 <= r["response_len_mean"] <= r["response_len_max"] <= MAX_NEW_TOKENS
        assert 0.0 <= r["response_truncated_frac"] <= 1.0 and 0.0 <= r["clip_fraction"] <= 1.0
        assert r["reward_min"] <= r["reward"] <= r["reward_max"]
        assert r["advantage_min"] <= r["advantage_mean"] <= r["advantage_max"] and r["advantage_std"] >= 0
        assert 0 <= r["staleness_mean"] <= r["staleness_max"] <= 1  # max_staleness 1 (the default)
        assert r["grad_norm"] >= 0 and r["tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0

    acc = EventAccumulator(str(pdir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    for tag in ("train/entropy", "train/response_len_mean", "train/grad_norm", "train/staleness_max",
                "train/tokens_per_s"):
        assert [e.step for e in acc.Scalars(tag)] == list(range(1, STEPS + 1)), tag
    texts = acc.Tensors("samples/text_summary")
    assert len(texts) == STEPS and "| reward |" in texts[-1].tensor_proto.string_val[0].decode()

    # resumed for two more steps: the checkpoint's step is not printed again, the new ones are
    out = io.StringIO()
    try:
        summary = run(run_config(tmp_path, STEPS + 2), resume=True, out=out)
    finally:
        ray.shutdown()
    assert step_lines(out.getvalue(), "pa") == [STEPS + 1, STEPS + 2], out.getvalue()
    samples = [json.loads(line) for line in (pdir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples][-7:] == [STEPS] + [STEPS + 1] * 3 + [STEPS + 2] * 3
