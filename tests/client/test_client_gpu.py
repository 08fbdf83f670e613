"""Issue 39 on a real GPU: an external program's state and weights change hands the way rlix's
own trainer's do. Its model and AdamW moments leave the GPU whenever it gives the GPU back and
return, bit for bit, when granted (TrainingState); the plain loop's versions reach the shard
asleep on its training GPU device to device (CUDA IPC) before its state leaves, audited equal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray
import torch
import yaml

from rlix.client.gpu_state import TrainingState
from rlix.run import run

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.gpu


def test_the_training_state_leaves_the_gpu_and_comes_back_unchanged():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024, device="cuda")).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    state = TrainingState.of(model, optimizer)
    assert state is not None and state.on_device
    allocated = torch.cuda.memory_allocated()
    released = state.release("0", "the test's program")
    assert not state.on_device and released.reserved < allocated
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    state.reload("0", "the test's program", timeout_s=10)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, optimizer.state.values()))
    optimizer.step()  # the optimizer still steps the same parameters
    assert TrainingState.of(torch.nn.Linear(2, 2), None) is None  # a model on the CPU: nothing to move


def test_the_plain_loop_on_a_gpu_refits_its_shard_by_cuda_ipc(tmp_path):
    cfg = yaml.safe_load((ROOT / "examples" / "external_loop" / "config.yaml").read_text())
    cfg["run_dir"] = str(tmp_path / "run")
    cfg["cluster"]["gpus_per_node"] = 1
    (pipe,) = cfg["pipelines"]
    pipe.update(steps=3, max_shards=1)
    pipe["external"]["command"] = [sys.executable, str(ROOT / "examples" / "external_loop" / "loop.py")]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ray.shutdown()
    try:
        summary = run(str(path))
    finally:
        ray.shutdown()
    result = summary["pipelines"]["plain-loop"]
    log = (tmp_path / "run" / "plain-loop" / "program.log").read_text()
    assert result["state"] == "done" and result["steps"] == 3, log[-2000:]
    assert result["published"] == [0, 1, 2, 3]
    beside = [e for e in result["events"] if e[1] == "device_sync"]
    assert {e[3] for e in beside} == {1, 2, 3}, result["events"]  # every step's version, by CUDA IPC
    handoffs = [m for m in result["gpu_memory"] if m["holder"] == "program of plain-loop"]
    assert len(handoffs) == 3 and all(m["device_free"] > 0 and m["release_s"] > 0 for m in handoffs), handoffs
    assert all(m["reload_s"] > 0 for m in handoffs), handoffs
    assert result["checksum_checks"] >= 3 and result["checksum_mismatches"] == [], result
