"""`cluster.gpu_slices`: one GPU scheduled as several, so several pipelines' shards and trainers
sit on it at once, each process capped at its share of the GPU's memory.

On CPU with Ray's fake GPUs: the config and the check, the reservation's mapping of slices onto
one bundle, what a placed process is started with (read back from /proc), and a two-pipeline run
on one GPU in which both pipelines generate at the same time. On CUDA: the cap holds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray
import yaml

from rlix import env
from rlix.config.models import RlixConfig
from rlix.config.preflight import preflight
from rlix.errors import ConfigError
from rlix.devices import cap_process_memory
from rlix.pipeline.device_plan import DevicePlan
from rlix.placement import GpuReservation
from rlix.scheduler.types import Topology


def _cfg(slices: int, **pipe) -> dict:
    base = {"name": "p", "model": "tiny", "min_shards": 1, "max_shards": 1}
    return {"cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_slices": slices},
            "pipelines": [{**base, **pipe}, {**base, **pipe, "name": "q"}]}


def test_slices_multiply_the_gpus_the_scheduler_sees_and_refuse_tp():
    cfg = RlixConfig.model_validate(_cfg(2))
    assert cfg.cluster.physical_gpus == 1 and cfg.cluster.scheduled_gpus == 2
    assert cfg.cluster.topology() == Topology((2,), slices=2)
    assert cfg.cluster.physical_topology() == Topology((1,))
    with pytest.raises(ValueError, match="tp > 1 with gpu_slices > 1"):
        RlixConfig.model_validate({**_cfg(4, tp=2)})
    with pytest.raises(ValueError, match="gpu_slices"):
        RlixConfig.model_validate(_cfg(0))


def test_check_counts_slices_when_fitting_shard_floors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**_cfg(2, min_shards=2, max_shards=2), "run_dir": str(tmp_path / "r")}))
    preflight(RlixConfig.model_validate(yaml.safe_load(path.read_text())), str(path))  # 2 slices: fits
    cfg = RlixConfig.model_validate({**_cfg(1, min_shards=2, max_shards=2), "run_dir": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match="needs 2 GPUs but the cluster has 1"):
        preflight(cfg, str(path))


def test_memory_share_from_the_environment_is_checked(monkeypatch):
    monkeypatch.delenv(env.GPU_MEMORY_SHARE_VAR, raising=False)
    assert env.gpu_memory_share() == 1.0
    monkeypatch.setenv(env.GPU_MEMORY_SHARE_VAR, "0.25")
    assert env.gpu_memory_share() == 0.25
    for bad in ("0", "1.5", "half"):
        monkeypatch.setenv(env.GPU_MEMORY_SHARE_VAR, bad)
        with pytest.raises(ValueError, match=env.GPU_MEMORY_SHARE_VAR):
            env.gpu_memory_share()
    with pytest.raises(ConfigError, match="share"):
        cap_process_memory("cpu", 0.0)
    cap_process_memory("cpu", 0.5)  # nothing to cap on CPU


@pytest.fixture(scope="module")
def ray_one_gpu():
    ray.shutdown()
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    def visible(self) -> str | None:
        return env.visible_devices()


def test_slices_of_a_gpu_are_its_one_bundle(ray_one_gpu):
    reservation = GpuReservation.reserve(Topology((1,)), slices=4)
    try:
        assert [s.gpu for s in reservation.slots] == [0, 1, 2, 3]
        assert {(s.physical, s.bundle) for s in reservation.slots} == {(reservation.slot(0).physical, 0)}
        assert reservation.memory_share == 0.25
        # two actors on two slices of the one GPU both run (Ray's fraction is only a ticket)
        probes = [Probe.options(**reservation.actor_options([g])).remote() for g in (1, 3)]
        assert ray.get([p.visible.remote() for p in probes], timeout=60) == [reservation.slot(0).physical] * 2
        for p in probes:
            ray.kill(p)
        devices = DevicePlan(reservation=reservation)
        assert devices.visible_devices_env([2]) == {env.VISIBLE_DEVICES_VAR: reservation.slot(0).physical,
                                                    env.GPU_MEMORY_SHARE_VAR: "0.25"}
        with pytest.raises(ConfigError, match="slices of the same device"):
            reservation.visible_devices([0, 1])
    finally:
        reservation.release()


@pytest.mark.slow
def test_two_pipelines_generate_on_one_gpu_at_once(tmp_path):
    """Two pipelines on one fake GPU in 2 slices: both finish; at some moment both hold a
    generating shard; every process was started on the one device with half its memory. (Each is
    planned for from its own set-up's end: enough steps that the first one set up is still
    running when the other is, whatever the skew of their set-ups.)"""
    from rlix.run import run

    ray.shutdown()
    pipe = {"model": "tiny", "min_shards": 1, "max_shards": 1, "steps": 20,
            "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 4, "group_size": 4, "max_new_tokens": 8, "concurrency": 4}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_slices": 2},
           "scheduler": {"dwell_s": 0.2, "aging_s": 5}, "run_dir": str(tmp_path / "run"),
           "pipelines": [{**pipe, "name": "pa", "seed": 1}, {**pipe, "name": "pb", "seed": 2}]}
    path = tmp_path / "slices.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        summary = run(str(path), mode="rlix")
    finally:
        ray.shutdown()
    holders: dict[int, str] = {}
    both_generating = False
    for change in summary["role_changes"]:
        holders[change["gpu"]] = change["after"]
        generating = {h.split("/")[0] for h in holders.values() if "/generate" in h}
        both_generating |= generating == {"pa", "pb"}
    assert both_generating, summary["role_changes"]
    assert {c["gpu"] for c in summary["role_changes"]} <= {0, 1}
    for name, p in summary["pipelines"].items():
        assert p["steps"] == 20, name
        assert p["trainer_placement"]["visible_devices"] == "0"
        assert p["shard_placements"], name
        for start in p["shard_placements"]:
            assert (start["visible_devices"], start["memory_share"]) == ("0", "0.5"), start
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["ending"] == "finished"


@pytest.mark.gpu
def test_a_process_capped_at_its_share_cannot_take_more():
    """On CUDA the share is enforced by the allocator: past it, this process gets an
    out-of-memory error (its neighbours on the GPU keep theirs)."""
    script = (
        "import torch; from rlix.devices import cap_process_memory\n"
        "cap_process_memory('cuda', 0.25)\n"
        "total = torch.cuda.mem_get_info()[1]\n"
        "ok = torch.empty(int(total * 0.15), dtype=torch.uint8, device='cuda'); del ok\n"
        "try:\n"
        "    torch.empty(int(total * 0.35), dtype=torch.uint8, device='cuda'); print('allocated')\n"
        "except torch.OutOfMemoryError:\n"
        "    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "refused"
