"""Issue 41, acceptance 5: vLLM's own load generator, `vllm bench serve` from the project's vLLM
environment (scripts/setup-vllm.sh), run as its users run it against `rlix serve`: every
request completes, none fails, and the figures it saves are those of real generation."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kit import KEY, need_vllm, shard_processes, vllm_command

pytestmark = pytest.mark.vllm

PROMPTS, OUTPUT_LEN = 16, 16


def test_vllm_bench_serve_completes_against_rlix_serve(tiny_model_dir, tmp_path):
    need_vllm()
    with shard_processes(tiny_model_dir) as (shard,):
        done = subprocess.run(
            [vllm_command(), "bench", "serve", "--backend", "openai", "--base-url", shard.url,
             "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", str(tiny_model_dir),
             "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", str(OUTPUT_LEN),
             "--num-prompts", str(PROMPTS), "--max-concurrency", "8", "--ignore-eos", "--seed", "0",
             "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"],
            capture_output=True, text=True, timeout=600, env={**os.environ, "OPENAI_API_KEY": KEY})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == PROMPTS and result["failed"] == 0, result
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN  # ignore_eos: every request its full length
    assert result["output_throughput"] > 0 and result["mean_ttft_ms"] > 0
