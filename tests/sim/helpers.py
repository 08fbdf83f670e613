"""Small scenarios for the simulator's tests (tests/sim/)."""

from __future__ import annotations

from rlix.sim.scenario import ScenarioModel, build_scenario
from rlix.sim.workload import TrajectorySpec


def pipe(name: str = "p", **over) -> dict:
    d = {
        "name": name, "steps": 3, "train_gpus": 2, "train_gpu_seconds": 20.0, "max_shards": 4,
        "max_staleness": 1, "seqs_per_shard": 2,
        "rollout": {"prompts": 2, "samples": 2, "extra_turns_mean": 2, "max_turns": 6,
                    "gen_tokens": {"median": 200, "sigma": 1.0, "max": 2000},
                    "tool_s": {"median": 2.0, "sigma": 1.0},
                    "prompt_tokens": 300, "obs_tokens": 100},
    }
    d.update(over)
    return d


def scenario_dict(nodes=1, gpus_per_node=4, pipelines=None, **top) -> dict:
    d = {"name": "tiny", "seed": 3, "cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node},
         "pipelines": pipelines if pipelines is not None else [pipe("a"), pipe("b")]}
    d.update(top)
    return d


def build(d: dict):
    return build_scenario(ScenarioModel.model_validate(d), "test.yaml")


def one_gpu_dict(steps: int = 2, staleness: int = 1, train_gpu_s: float = 4.0, gpus: int = 1) -> dict:
    """One pipeline, one GPU, one-turn trajectories of fixed length and no prompt: times by hand."""
    return scenario_dict(nodes=1, gpus_per_node=gpus, pipelines=[{
        "name": "p", "steps": steps, "train_gpus": 1, "train_gpu_seconds": train_gpu_s,
        "max_shards": 1, "max_staleness": staleness,
        "rollout": {"prompts": 1, "samples": 1, "gen_tokens": {"median": 10},
                    "prompt_tokens": 0, "obs_tokens": 0},
    }], engine={"max_seqs": 8, "decode_base_ms": 20, "decode_per_seq_ms": 0.3,
                "prefill_tokens_per_s": 20000},
        transitions={"sync_s": 5, "sleep_s": 2, "wake_s": 5})


def single_turn(*lengths: int, prompt: int = 0) -> tuple[TrajectorySpec, ...]:
    return tuple(TrajectorySpec(gen=(n,), tool=(), prompt_tokens=prompt, obs_tokens=0) for n in lengths)
