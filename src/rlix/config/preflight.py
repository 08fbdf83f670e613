"""What `rlix check` (and `rlix run`, before Ray starts) checks beyond the schema: everything that
can be known without starting anything. Each problem names the file and the field path, and the
pipeline; all of them are reported together, on one line.

Relative paths in a config are read from the config's folder (task files, verifier modules,
model directories), so a config means the same from any working directory and in every Ray
worker; `run_dir` stays relative to where `rlix run` is started (outputs go where you run).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from rlix import env
from rlix.config.models import PYTHON_WORDS, ExternalConfig, PipelineConfig, RlixConfig
from rlix.envs import TaskConfig, make_task
from rlix.envs.errors import TaskFieldError
from rlix.envs.verifiers import anchor_function, anchor_verifier
from rlix.errors import ConfigError, problems_line
from rlix.models.presets import PRESETS, is_seeded

#: files a model directory must hold to be a checkpoint the trainer and shards can load
WEIGHT_SUFFIXES = (".safetensors", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def anchor(cfg: RlixConfig, base: Path) -> RlixConfig:
    """The config with its task files, verifier modules and model directories read from `base`
    (the config file's folder) as absolute paths."""
    pipelines = []
    for p in cfg.pipelines:
        model = p.model
        if model not in PRESETS and not Path(model).expanduser().is_absolute() and (base / model).is_dir():
            model = str((base / model).resolve())
        held_out = p.eval.task
        evaluation = p.eval.model_copy(update={"task": anchor_task(held_out, base)}) if held_out else p.eval
        pipelines.append(p.model_copy(update={"task": anchor_task(p.task, base), "model": model,
                                              "eval": evaluation}))
    return cfg.model_copy(update={"pipelines": pipelines})


def anchor_task(task: TaskConfig, base: Path) -> TaskConfig:
    """A task's file, verifier and reward function read from `base` as absolute paths."""
    update: dict = {}
    if task.path and not Path(task.path).expanduser().is_absolute():
        update["path"] = str((base / task.path).resolve())
    verifier = anchor_verifier(task.verifier, base)
    if verifier != task.verifier:
        update["verifier"] = verifier
    for field, spec in (("reward", task.reward), ("reward_batch", task.reward_batch)):
        if spec is not None and (anchored := anchor_function(spec, base)) != spec:
            update[field] = anchored
    return task.model_copy(update=update)


def problems(cfg: RlixConfig) -> list[str]:
    """Every problem found, each as `field.path: what is wrong`."""
    found: list[str] = []
    for i, p in enumerate(cfg.pipelines):
        where = f"pipelines[{i}] ({p.name})"
        found += [f"{where}.model: {m}" for m in _model(p.model)]
        if p.engine == "vllm" and _seeded(p.model):
            found.append(f"{where}.engine: vllm cannot load {p.model!r}, a seeded preset (no weight "
                         "files; rlix draws its weights at load): use engine: embedded")
        found += [f"{where}.rollout: {m}" for m in _context(p)]
        found += task_problems(p.task, f"{where}.task")
        if p.eval.task is not None:
            found += task_problems(p.eval.task, f"{where}.eval.task")
        found += [f"{where}.task.chat_template: {m}" for m in _chat_template(p)]
        found += [f"{where}: {m}" for m in _fits(cfg, p)]
        if p.external is not None:
            found += [f"{where}.external.{m}" for m in _program(p.external)]
        if p.env is not None:
            for field in ("resources", "agent"):
                problem = _importable(getattr(p.env, field))
                if problem:
                    found.append(f"{where}.env.{field}: {problem}")
    problem = _writable(Path(cfg.run_dir))
    if problem:
        found.append(f"run_dir: {problem}")
    users = [f"pipelines[{i}] ({p.name})" for i, p in enumerate(cfg.pipelines) if p.engine == "vllm"]
    problem = _vllm_python(cfg.vllm_python) if users else None
    if problem:
        found.append(f"vllm_python: {problem} (needed by {', '.join(users)}: engine: vllm)")
    found += _loggers(cfg)
    if cfg.device != "cpu":  # where shards run on real GPUs, `tp` splits the model
        found += [f"pipelines[{i}] ({p.name}).tp: {m}" for i, p in enumerate(cfg.pipelines)
                  for m in _tensor_parallel(p)]
    return found


def _tensor_parallel(p: PipelineConfig) -> list[str]:
    """A shard splits its model over `tp` GPUs (on CUDA; fake GPUs only schedule it): every rank
    must hold the same number of query heads, KV heads and MLP units."""
    if p.tp == 1:
        return []
    if p.model in PRESETS:
        preset = PRESETS[p.model]
        counts: dict[str, object] = {"num_attention_heads": preset.num_attention_heads,
                                     "num_key_value_heads": preset.num_key_value_heads,
                                     "intermediate_size": preset.intermediate_size}
    else:
        try:
            config = json.loads((Path(p.model).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return []  # no readable config.json: _model says what is wrong
        heads = config.get("num_attention_heads")
        counts = {"num_attention_heads": heads, "num_key_value_heads": config.get("num_key_value_heads") or heads,
                  "intermediate_size": config.get("intermediate_size")}
    return [f"{p.tp} does not divide the model's {name} ({count}): every GPU of a shard must hold "
            f"the same number" for name, count in counts.items()
            if isinstance(count, int) and count % p.tp]


def task_problems(task: TaskConfig, where: str) -> list[str]:
    """What making the task finds wrong (it reads a task file line by line, imports the verifier
    or reward function), as `where.field: what` lines."""
    try:
        make_task(task)
    except TaskFieldError as exc:
        return [f"{where}.{exc.field}: {exc}"]
    except ConfigError as exc:
        field = ".verifier" if "verifier" in str(exc) else ".path" if task.path else ""
        return [f"{where}{field}: {exc}"]
    return []


def _loggers(cfg: RlixConfig) -> list[str]:
    """The experiment trackers chosen in `logging:` are installed (found, not imported: slow)."""
    found = []
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        found.append("logging.tensorboard: the tensorboard package is not installed (pip install tensorboard)")
    wandb = cfg.logging.wandb
    if wandb is not None and wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        found.append("logging.wandb: the wandb package is not installed (pip install wandb, or "
                     "pip install 'rlix[wandb]'; or remove the section)")
    return found


def _importable(target: str) -> str | None:
    """`module:Class` of an environment server: the module imports and has the class."""
    module, _, name = target.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's module: any error is the problem
        return f"cannot import {module}: {type(exc).__name__}: {exc}"
    if not isinstance(getattr(obj, name, None), type):
        return f"{module} has no class {name}"
    return None


def preflight(cfg: RlixConfig, source: str) -> None:
    """Raise one ConfigError naming `source` and every problem; nothing is created."""
    found = problems(cfg)
    if found:
        raise ConfigError(problems_line(source, found))


#: what `rlix run` writes in run_dir, besides each pipeline's folder, once Ray has started (its
#: run.log is appended to, never replaced: a start that failed before Ray leaves only that)
RUN_FILES = ("summary.json",)


def previous_run(cfg: RlixConfig) -> list[str]:
    """What a previous run left in run_dir that a new one would overwrite or mix with: its
    summary, and the folder (metrics, checkpoint) of each pipeline of this config."""
    run_dir = Path(cfg.run_dir).expanduser()
    if not run_dir.is_dir():
        return []
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    return found + [f"{p.name}/" for p in cfg.pipelines if (run_dir / p.name).exists()]


def refuse_reused_run_dir(cfg: RlixConfig, source: str) -> None:
    """`rlix run` without --resume or --overwrite: a run_dir with a previous run's outputs is
    refused, rather than its metrics and checkpoints silently replaced."""
    found = previous_run(cfg)
    if found:
        raise ConfigError(problems_line(source, [
            f"run_dir: {cfg.run_dir} holds a previous run ({', '.join(found[:4])}"
            f"{', ...' if len(found) > 4 else ''}); give --resume to continue it, --overwrite to replace it, "
            f"or another run_dir"]))


def _vllm_python(python: str | None) -> str | None:
    """What is wrong with the Python that would run vLLM servers, or None. Finds the package
    without importing it (a vLLM import takes seconds)."""
    python = python or env.vllm_python()
    if not python:
        return "no Python with vLLM: run scripts/setup-vllm.sh, or set vllm_python or RLIX_VLLM_PYTHON"
    if not os.access(python, os.X_OK):
        return f"{python} is not an executable"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{python} did not run: {exc}"
    return None if ok else f"{python} has no vllm package"


def _program(ext: ExternalConfig) -> list[str]:
    """An external pipeline's program that cannot start: its cwd missing, its command not found
    (on PATH or from the cwd), a Python script that is not there. Relative paths are read from
    `cwd`, else from where rlix runs."""
    base = Path(ext.cwd).expanduser() if ext.cwd else Path.cwd()
    if not base.is_dir():
        return [f"cwd: {ext.cwd!r} is not a directory"]
    first = ext.command[0]
    if first in PYTHON_WORDS:
        script = next((a for a in ext.command[1:] if not a.startswith("-")), None)
        if script is not None and script.endswith(".py") and not (base / Path(script).expanduser()).is_file():
            return [f"command: no Python script {script!r} (from {base})"]
        return []
    if "/" in first:
        path = base / Path(first).expanduser()
        return [] if path.is_file() and os.access(path, os.X_OK) else [f"command: {first!r} is not an executable file"]
    return [] if shutil.which(first) else [f"command: {first!r} is not on PATH"]


def _seeded(model: str) -> bool:
    """A seeded preset, by name or as a folder (models/init.py draws its weights)."""
    if model in PRESETS:
        return PRESETS[model].weights == "seeded"
    path = Path(model).expanduser()
    return path.is_dir() and is_seeded(path)


def _model(model: str) -> list[str]:
    if model in PRESETS:
        return []
    path = Path(model).expanduser()
    if not path.exists():
        return [f"{model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a directory"]
    if not path.is_dir():
        return [f"{model!r} is a file; give a checkpoint directory or a preset"]
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not is_seeded(path) and not any(f.name.endswith(WEIGHT_SUFFIXES) for f in path.iterdir()):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append("a tokenizer (tokenizer.json or tokenizer_config.json)")
    return [f"{model!r} is not a checkpoint: no {', no '.join(missing)}"] if missing else []


def _chat_template(p: PipelineConfig) -> list[str]:
    """A task that renders prompts with the chat template needs a model folder that has one
    (tokenizer_config.json's `chat_template`, or chat_template.jinja / .json beside it); the
    presets have theirs."""
    uses = p.task.name in ("dataset", "reasoning_gym") and p.task.chat_template and p.env is None
    path = Path(p.model).expanduser()
    if not uses or p.model in PRESETS or not path.is_dir():
        return []
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return []
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and config.get("chat_template"):
        return []
    return [f"the model {p.model!r} has no chat template (tokenizer_config.json's chat_template, or "
            f"chat_template.jinja); give one, or set chat_template: false for plain-text prompts"]


def _context(p: PipelineConfig) -> list[str]:
    """The rollout's context: room for a prompt besides max_new_tokens (else every request is
    refused, and the pipeline stalls after max_failed_groups), and within the model's own
    context, its max_position_embeddings (else the shards fail to start, after Ray)."""
    found = []
    rollout = p.rollout
    if rollout.max_new_tokens >= rollout.max_model_len:
        found.append(f"max_new_tokens ({rollout.max_new_tokens}) must be below max_model_len "
                     f"({rollout.max_model_len}): a prompt and its response share the context")
    if p.model in PRESETS:
        limit: object = PRESETS[p.model].max_position_embeddings
    else:
        try:
            limit = json.loads((Path(p.model).expanduser() / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            limit = None  # no readable config.json: _model says what is wrong
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < rollout.max_model_len:
        found.append(f"max_model_len ({rollout.max_model_len}) exceeds the model's context "
                     f"(max_position_embeddings {limit})")
    return found


def _fits(cfg: RlixConfig, p: PipelineConfig) -> list[str]:
    """Its floor of shards (and its trainer, without partial overlap) must fit the cluster, and
    so must its most shards (more could never run: the config would promise what it cannot do)."""
    if cfg.cluster.is_auto:
        return []
    total = cfg.cluster.scheduled_gpus
    need = p.min_shards * p.tp + (0 if p.partial_overlap else p.train_gpus)
    if need <= total:
        if p.max_shards * p.tp > total:
            return [f"max_shards={p.max_shards} x tp={p.tp} needs {p.max_shards * p.tp} GPUs but the cluster "
                    f"has {total} (lower max_shards)"]
        return []
    how = f"min_shards={p.min_shards} x tp={p.tp}" + ("" if p.partial_overlap else
                                                       f" + train_gpus={p.train_gpus} (partial_overlap off)")
    return [f"{how} needs {need} GPUs but the cluster has {total}"]


def _writable(run_dir: Path) -> str | None:
    """What stops `rlix run` from writing in run_dir (or creating it), or None. Tried for real,
    with a probe made and removed at once (permission bits say nothing to root, nor about
    read-only mounts or /proc): check leaves nothing behind."""
    path = run_dir.expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{run_dir} exists and is not a directory"
        return None if _can_write_in(path) else f"{run_dir} is not writable"
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create {run_dir}: {parent} is not a directory"
    if not _can_write_in(parent):
        return f"cannot create {run_dir}: {parent} is not writable"
    return None


def _can_write_in(folder: Path) -> bool:
    """A folder can be made in `folder` (then removed): what `rlix run` does first."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rlix-check-", dir=folder))
    except OSError:
        return False
    return True
