"""Config values that used to pass `rlix check` and then failed or misbehaved after start (issue 38),
and YAML that used to cost gigabytes: each is now refused by `rlix check` (and so by `rlix run`,
which runs the same checks first) with one short line naming the field, exit code 2.

The bounds are listed in docs/CONFIG.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from rlix.cli import main
from rlix.config import load_config
from rlix.safe_yaml import MAX_ALIASES, MAX_DEPTH, MAX_FILE_BYTES
from rlix.config.models import MAX_SEED
from rlix.config.preflight import preflight, previous_run
from rlix.errors import MAX_MESSAGE, ConfigError

ROOT = Path(__file__).resolve().parents[2]


def config(tmp: Path, text: str | None = None, **top: object) -> Path:
    """A good config (1 node x 2 GPUs, one pipeline `p`) with `top` changed (`p_KEY`: the
    pipeline's), or `text` as it is."""
    if text is None:
        data: dict = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "run_dir": str(tmp / "run"),
                      "pipelines": [{"name": "p", "steps": 2}]}
        for key, value in top.items():
            if key.startswith("p_"):
                data["pipelines"][0][key[2:]] = value
            else:
                data[key] = value
        text = yaml.safe_dump(data)
    path = tmp / "cfg.yaml"
    path.write_text(text)
    return path


def refused(path: Path) -> str:
    """What `rlix check` says of `path` (schema, then preflight): one line, short."""
    with pytest.raises(ConfigError) as exc:
        preflight(load_config(path), str(path))
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) <= MAX_MESSAGE, msg
    return msg


def bomb(levels: int, width: int = 10) -> str:
    """The billion laughs: `width`**`levels` strings from a few hundred bytes of aliases."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "\n".join(lines) + f"\npipelines: *l{levels - 1}\n"


# ---------------------------------------------------------------- values: one line naming the field

PATH_NAME = "x" * 300
VALUE_CASES = [
    # pipeline names are folders under run_dir: "..", "." and 300 characters wrote outside it or failed
    ("name ..", dict(p_name=".."), "pipelines[0].name", "must not be '.' or '..'"),
    ("name .", dict(p_name="."), "pipelines[0].name", "must not be '.' or '..'"),
    ("name of 300 characters", dict(p_name=PATH_NAME), "pipelines[0].name", "at most 64 characters"),
    ("name with a slash", dict(p_name="a/b"), "pipelines[0].name", "String should match pattern"),
    # integer ranges
    ("seed 2**70", dict(p_seed=2**70), "pipelines[0].seed", f"less than or equal to {MAX_SEED}"),
    ("negative seed", dict(p_seed=-1), "pipelines[0].seed", "greater than or equal to 0"),
    ("steps 2**40", dict(p_steps=2**40), "pipelines[0].steps", "less than or equal to 2147483647"),
    ("steps: yes (a boolean)", dict(p_steps=True), "pipelines[0].steps", "got a boolean"),
    ("priority 2**40", dict(p_priority=2**40), "pipelines[0].priority", "less than or equal to"),
    ("group_size 2**20", dict(p_rollout={"group_size": 2**20}), "pipelines[0].rollout.group_size",
     "less than or equal to 65536"),
    ("max_model_len 2**30", dict(p_rollout={"max_model_len": 2**30}), "pipelines[0].rollout.max_model_len",
     "less than or equal to 1048576"),
    ("bucket_mib 2**40", dict(p_train={"bucket_mib": 2**40}), "pipelines[0].train.bucket_mib", "less than or equal"),
    ("activation_checkpointing without fsdp", dict(p_train={"activation_checkpointing": True}),
     "pipelines[0].train", "fsdp: true only"),
    ("a negative standalone GPU", dict(p_gpus=[-1]), "pipelines[0].gpus[0]", "greater than or equal to 0"),
    ("cpu_threads 10**6", dict(p_cpu_threads=10**6), "pipelines[0].cpu_threads", "less than or equal to 1024"),
    ("10**6 nodes", dict(cluster={"nodes": 10**6, "gpus_per_node": 2}), "cluster", "nodes must be <= 1024"),
    ("1000 GPUs per node", dict(cluster={"nodes": 1, "gpus_per_node": 1000}), "cluster",
     "gpus_per_node must be <= 64"),
    ("metrics_port -1", dict(scheduler={"metrics_port": -1}), "scheduler.metrics_port", "greater than or equal to 0"),
    ("task length 10**12", dict(p_task={"name": "pattern", "length": 10**12}), "pipelines[0].task",
     "length must be <= 1048576"),
    ("env max_turns 10**9", dict(p_env={"max_turns": 10**9}), "pipelines[0].env", "max_turns must be <= 1000"),
    # finite floats everywhere
    ("temperature .inf", dict(p_rollout={"temperature": float("inf")}), "pipelines[0].rollout.temperature",
     "finite number"),
    ("temperature .nan", dict(p_rollout={"temperature": float("nan")}), "pipelines[0].rollout.temperature",
     "finite number"),
    ("temperature 1e-9", dict(p_rollout={"temperature": 1e-9}), "pipelines[0].rollout.temperature",
     "at least 0.001"),
    ("lr .inf", dict(p_train={"lr": float("inf")}), "pipelines[0].train.lr", "finite number"),
    ("weight .nan", dict(p_weight=float("nan")), "pipelines[0].weight", "finite number"),
    ("dwell_s .inf", dict(scheduler={"dwell_s": float("inf")}), "scheduler.dwell_s", "finite number"),
    ("setup_timeout_s 1e300", dict(setup_timeout_s=1e300), "setup_timeout_s", "less than or equal to 10000000"),
    ("move_costs sleep_s .inf", dict(scheduler={"move_costs": {"sleep_s": float("inf")}}),
     "scheduler.move_costs.sleep_s", "finite number"),
    ("vllm startup_timeout_s .nan", dict(p_vllm={"startup_timeout_s": float("nan")}),
     "pipelines[0].vllm.startup_timeout_s", "finite number"),
    ("env tool_latency_s .inf", dict(p_env={"tool_latency_s": float("inf")}), "pipelines[0].env",
     "tool_latency_s must be a finite number"),
    ("length_tail sigma 1000", dict(p_rollout={"max_new_tokens": 64, "length_tail":
                                               {"dist": "lognormal", "median": 8, "sigma": 1000}}),
     "pipelines[0].rollout.length_tail.sigma", "less than or equal to 10"),
    ("length_tail alpha 0.001", dict(p_rollout={"max_new_tokens": 64, "length_tail":
                                                {"dist": "pareto", "median": 8, "alpha": 0.001}}),
     "pipelines[0].rollout.length_tail.alpha", "at least 0.1"),
    # paths
    ("run_dir ''", dict(run_dir=""), "run_dir", "must not be empty"),
    ("run_dir of spaces", dict(run_dir="   "), "run_dir", "must not be empty"),
    ("run_dir with a NUL", dict(run_dir="runs/a\0b"), "run_dir", "NUL"),
    ("model ''", dict(p_model=""), "pipelines[0].model", "must not be empty"),
    ("wandb project with a slash", dict(logging={"wandb": {"project": "team/proj"}}), "logging.wandb.project",
     "String should match pattern"),
    ("vllm extra_args with a NUL", dict(p_vllm={"extra_args": ["--x\0"]}), "pipelines[0].vllm.extra_args[0]", "NUL"),
]


@pytest.mark.parametrize("top, field, reason", [c[1:] for c in VALUE_CASES], ids=[c[0] for c in VALUE_CASES])
def test_bad_value_is_refused_naming_its_field(tmp_path, top, field, reason):
    path = config(tmp_path, **top)
    msg = refused(path)
    assert msg.startswith(str(path)) and f"{field}:" in msg and reason in msg, msg


def test_values_at_the_bounds_are_accepted(tmp_path):
    """The edges of each new bound are values rlix runs with."""
    path = config(tmp_path, p_name="n" * 64, p_seed=MAX_SEED, p_max_shards=2,
                  p_rollout={"temperature": 0.001, "max_new_tokens": 255, "max_model_len": 256},
                  run_dir=".", cluster={"nodes": 1, "gpus_per_node": 2})
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        cfg = load_config(path)
        preflight(cfg, str(path))
    finally:
        os.chdir(cwd)
    assert cfg.pipelines[0].seed == MAX_SEED and cfg.run_dir == "."


# ---------------------------------------------------------------- what only preflight can know


def test_max_shards_above_the_clusters_gpus(tmp_path):
    msg = refused(config(tmp_path, p_max_shards=3))
    assert "pipelines[0] (p): max_shards=3 x tp=1 needs 3 GPUs but the cluster has 2" in msg
    msg = refused(config(tmp_path, p_tp=2, p_max_shards=2))  # counted in GPUs: shards x tp
    assert "max_shards=2 x tp=2 needs 4 GPUs but the cluster has 2" in msg
    # an auto cluster's size is not known before Ray: nothing to compare with
    preflight(load_config(config(tmp_path, p_max_shards=64, cluster={"nodes": "auto"})), "auto.yaml")
    # real GPUs: a shard splits its model over its tp GPUs, so tp must divide the model's heads
    preflight(load_config(config(tmp_path, device="cuda", p_tp=2)), "tp2.yaml")  # tiny: 4 heads, 2 KV heads
    four = {"nodes": 1, "gpus_per_node": 4}
    msg = refused(config(tmp_path, device="cuda", p_tp=4, cluster=four))
    assert "pipelines[0] (p).tp: 4 does not divide the model's num_key_value_heads (2)" in msg, msg
    assert "num_attention_heads" not in msg and "intermediate_size" not in msg, msg
    preflight(load_config(config(tmp_path, device="cpu", p_tp=4, cluster=four)), "cpu.yaml")  # fake GPUs: scheduled only


def test_a_response_that_leaves_no_room_for_the_prompt(tmp_path):
    msg = refused(config(tmp_path, p_rollout={"max_new_tokens": 256, "max_model_len": 256}))
    assert "pipelines[0] (p).rollout: max_new_tokens (256) must be below max_model_len (256)" in msg


def test_a_context_longer_than_the_models(tmp_path):
    msg = refused(config(tmp_path, p_rollout={"max_model_len": 4096}))
    assert "rollout: max_model_len (4096) exceeds the model's context (max_position_embeddings 2048)" in msg


def test_run_dir_that_cannot_be_written_is_refused_and_check_leaves_nothing(tmp_path):
    if os.geteuid() == 0:  # permission bits say nothing to root: a folder of /proc cannot be made either
        existing, missing = Path("/proc/self"), Path("/proc/rlix-run")
        if not existing.is_dir():
            pytest.skip("no /proc here")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        existing, missing = locked, locked / "run"
    assert f"run_dir: {existing} is not writable" in refused(config(tmp_path, run_dir=str(existing)))
    assert f"run_dir: cannot create {missing}" in refused(config(tmp_path, run_dir=str(missing)))
    ok = tmp_path / "ok"
    ok.mkdir()
    preflight(load_config(config(tmp_path, run_dir=str(ok / "a" / "b"))), "ok.yaml")
    assert list(ok.iterdir()) == []  # the probe made and removed: nothing left behind


def test_many_problems_make_one_short_line(tmp_path):
    pipes = [{"name": f"p{i}", "steps": 0, "seed": -1} for i in range(200)]
    msg = refused(config(tmp_path, pipelines=pipes))
    assert "pipelines[0].steps" in msg and msg.endswith("more problems)"), msg


def test_a_huge_value_is_shortened_in_the_line(tmp_path):
    msg = refused(config(tmp_path, p_name="y" * 200_000))
    assert "pipelines[0].name: String should have at most 64 characters (got 'yyy" in msg and "..." in msg


# ---------------------------------------------------------------- the YAML itself


def test_alias_bomb_is_refused_fast_and_small(tmp_path):
    """Under 1 KB that expands to 10**9 strings (the issue's 676-byte one cost 3.7 GB and 19 s)."""
    text = bomb(9)
    assert len(text) < 1024
    path = config(tmp_path, text)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ConfigError) as exc:
            load_config(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0
    assert peak < 100 * 2**20, peak
    msg = str(exc.value)
    assert "refused: more than 100000 nodes once its aliases are expanded" in msg and len(msg) <= MAX_MESSAGE


@pytest.mark.parametrize("levels", [8, 6])
def test_smaller_alias_bombs_are_refused_too(tmp_path, levels):
    """One level less (10**8) printed a 34.7 MB line; 10**6 nodes is still far above any config."""
    t0 = time.perf_counter()
    msg = refused(config(tmp_path, bomb(levels)))
    assert time.perf_counter() - t0 < 2.0 and "once its aliases are expanded" in msg


def test_a_big_string_aliased_many_times_is_refused(tmp_path):
    text = f"big: &big \"{'x' * 200_000}\"\nalso: [{', '.join(['*big'] * 50)}]\npipelines: [{{name: p}}]\n"
    assert "more than 4194304 characters once its aliases are expanded" in refused(config(tmp_path, text))


def test_an_alias_bomb_in_a_cost_table_is_refused_too(tmp_path):
    """scheduler.move_costs may name a table file: it is read by the same bounded loader."""
    (tmp_path / "costs.yaml").write_text(bomb(9).replace("pipelines:", "costs:"))
    msg = refused(config(tmp_path, scheduler={"move_costs": str(tmp_path / "costs.yaml")}))
    assert "scheduler.move_costs: " in msg and "once its aliases are expanded" in msg


def test_recursive_alias_is_refused(tmp_path):
    assert "line 1 refused: a recursive alias" in refused(config(tmp_path, "a: &a [1, *a]\npipelines: [{name: p}]\n"))


def test_too_many_aliases_are_refused(tmp_path):
    text = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\npipelines: [{name: p}]\n"
    assert f"refused: more than {MAX_ALIASES} aliases" in refused(config(tmp_path, text))


def test_deep_nesting_is_refused(tmp_path):
    text = "x: " + "[" * 5000 + "]" * 5000 + "\npipelines: [{name: p}]\n"
    assert f"refused: nested more than {MAX_DEPTH} deep" in refused(config(tmp_path, text))


def test_a_file_too_big_is_refused_unread(tmp_path):
    text = "pipelines: [{name: p}]\n" + "#" * MAX_FILE_BYTES + "\n"
    assert f"a config file may have {MAX_FILE_BYTES} at most" in refused(config(tmp_path, text))


@pytest.mark.parametrize("text, line, key", [
    ("run_dir: a\nrun_dir: b\npipelines: [{name: p}]\n", 2, "run_dir"),
    ("pipelines:\n  - name: p\n    steps: 2\n    steps: 3\n", 4, "steps"),
    ("pipelines: [{name: p, seed: 1, seed: 2}]\n", 1, "seed"),  # a flow mapping: one line
])
def test_duplicate_key_is_refused_naming_key_and_line(tmp_path, text, line, key):
    msg = refused(config(tmp_path, text))
    assert f"line {line} not valid YAML: duplicate key '{key}'" in msg, msg


def test_aliases_and_merge_keys_within_bounds_still_work(tmp_path):
    """Sharing settings by anchors, and `<<:` merges whose keys the mapping overrides (no duplicate)."""
    cfg = load_config(config(tmp_path, f"run_dir: {tmp_path / 'run'}\n"
                                       "pipelines:\n"
                                       "  - &a {name: a, steps: 3, seed: 5, rollout: &r {group_size: 4}}\n"
                                       "  - {<<: *a, name: b, seed: 6}\n"
                                       "  - {name: c, rollout: *r}\n"))
    assert [(p.name, p.steps, p.seed, p.rollout.group_size) for p in cfg.pipelines] == [
        ("a", 3, 5, 4), ("b", 3, 6, 4), ("c", 20, 0, 4)]


# ---------------------------------------------------------------- through the CLI, as a user runs it

CLI_CASES = [
    ("alias bomb", lambda tmp: config(tmp, bomb(9)), "nodes once its aliases are expanded (an alias bomb?)"),
    ("duplicate key", lambda tmp: config(tmp, "pipelines: [{name: p}]\npipelines: [{name: q}]\n"),
     "line 2 not valid YAML: duplicate key 'pipelines'"),
    ("name ..", lambda tmp: config(tmp, p_name=".."), "pipelines[0].name: must not be '.' or '..'"),
    ("seed 2**70", lambda tmp: config(tmp, p_seed=2**70), "pipelines[0].seed: Input should be less than"),
    ("temperature .inf", lambda tmp: config(tmp, p_rollout={"temperature": float("inf")}),
     "pipelines[0].rollout.temperature: Input should be a finite number"),
    ("run_dir ''", lambda tmp: config(tmp, run_dir=""), "run_dir: must not be empty"),
    ("max_shards above the cluster", lambda tmp: config(tmp, p_max_shards=5),
     "max_shards=5 x tp=1 needs 5 GPUs but the cluster has 2"),
    ("vllm with a seeded preset", lambda tmp: config(tmp, p_model="qwen2.5-7b-shape", p_engine="vllm"),
     "pipelines[0] (p).engine: vllm cannot load 'qwen2.5-7b-shape'"),
]


@pytest.mark.parametrize("make, expect", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_rlix_check_prints_one_short_line_and_exits_2(tmp_path, make, expect):
    path = make(tmp_path)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rlix.cli", "check", str(path)],
                         capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert expect in lines[0] and len(lines[0]) <= MAX_MESSAGE + len("rlix: error: "), lines[0]
    assert took < 30, took  # the bomb took 19 s (and 3.7 GB) before


# ---------------------------------------------------------------- seeded presets and vLLM


def test_vllm_with_a_seeded_preset_is_refused_naming_the_engine(tmp_path):
    assert "pipelines[0] (p).engine: vllm cannot load 'qwen2.5-7b-shape'" in refused(
        config(tmp_path, p_model="qwen2.5-7b-shape", p_engine="vllm"))


def test_vllm_with_a_seeded_folder_is_refused_and_the_embedded_engine_accepted(tmp_path, capsys):
    import dataclasses

    from rlix.models import PRESETS, build_preset

    folder = build_preset("s", tmp_path / "s", preset=dataclasses.replace(PRESETS["tiny"], weights="seeded"))
    msg = refused(config(tmp_path, p_model=str(folder), p_engine="vllm"))
    assert "engine: vllm cannot load" in msg and "a seeded preset" in msg and "not a checkpoint" not in msg
    assert main(["check", str(config(tmp_path, p_model=str(folder)))]) == 0, capsys.readouterr()


# ---------------------------------------------------------------- rlix run on a used run_dir


@pytest.fixture
def stub_run(monkeypatch):
    """`rlix run` up to the point it would start Ray: what it was asked to run."""
    import rlix.run

    calls: list[dict] = []

    def run(config_path, **kw):  # type: ignore[no-untyped-def]
        calls.append({"config": config_path, **kw})
        return {"pipelines": {}}

    monkeypatch.setattr(rlix.run, "run", run)
    monkeypatch.setattr("rlix.env.join_ray_with_token", lambda: None)
    return calls


def test_run_refuses_a_run_dir_holding_a_previous_run(tmp_path, stub_run, capsys):
    path = config(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["run", str(path)]) == 0 and len(stub_run) == 1  # a new run_dir: runs
    run_dir.mkdir()
    (run_dir / "run.log").write_text("a start that failed before Ray\n")  # appended to, never replaced
    assert main(["run", str(path)]) == 0 and len(stub_run) == 2
    (run_dir / "p").mkdir()  # a pipeline's metrics and checkpoint
    assert main(["run", str(path)]) == 2 and len(stub_run) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"run_dir: {run_dir} holds a previous run (p/)" in err[0]
    assert "--resume" in err[0] and "--overwrite" in err[0]
    assert main(["run", str(path), "--overwrite"]) == 0 and stub_run[-1]["resume"] is False
    assert main(["run", str(path), "--resume"]) == 0 and stub_run[-1]["resume"] is True
    (run_dir / "summary.json").write_text("{}")
    assert previous_run(load_config(path)) == ["summary.json", "p/"]


def test_submit_refuses_a_run_dir_holding_a_previous_run_before_reaching_the_cluster(tmp_path, capsys,
                                                                                      monkeypatch):
    """As `rlix run`: refused at once, with no cluster asked (the address answers nothing);
    --overwrite or --resume go on to the cluster (and here find none)."""
    # main() would set RAY_AUTH_MODE in this test process for every later test's Ray
    monkeypatch.setattr("rlix.env.join_ray_with_token", lambda: None)
    path = config(tmp_path)
    (tmp_path / "run" / "p").mkdir(parents=True)
    nowhere = ["--address", "127.0.0.1:9"]  # the discard port: nothing listens there
    assert main(["submit", str(path), *nowhere]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a previous run (p/)" in err[0] and "--overwrite" in err[0]
    for flag in ("--overwrite", "--resume"):
        assert main(["submit", str(path), flag, *nowhere]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "previous run" not in err[0] and "127.0.0.1:9" in err[0], err


def test_resume_and_overwrite_together_are_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", str(config(tmp_path)), "--resume", "--overwrite"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


# ---------------------------------------------------------------- the shipped examples


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_example_passes_rlix_check(example, capsys, monkeypatch):
    monkeypatch.setattr("rlix.env.join_ray_with_token", lambda: None)
    code = main(["check", str(ROOT / "examples" / example)])
    out = capsys.readouterr()
    if code and "vllm_python" in out.err and "vllm" in example:
        pytest.skip("no Python with vLLM here (scripts/setup-vllm.sh)")
    assert code == 0, out.err
