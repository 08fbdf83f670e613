"""`rlix eval CONFIG|CHECKPOINT`: the held-out evaluation alone, on an embedded engine in this
process (no Ray, no scheduler; CPU unless --device cuda).

With a CONFIG, each pipeline's model (or, with `--checkpoint latest`, the newest checkpoint its
run left in run_dir) is scored on its `eval.task` with its `eval:` settings; with a CHECKPOINT
(a Hugging Face model folder, e.g. a run's `checkpoint/.../model`), on the task of `--task`
(a YAML task config) or of a config's pipeline (`--config`). The scoring is the pipeline's own
(rlix.pipeline.evaluation.Evaluator); the prompts go to the engine directly instead of through
a router. Prints one line per pipeline, then one JSON line; every error is one ConfigError line.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlix.config import load_config
from rlix.config.loader import load_model
from rlix.config.models import EvalConfig, PipelineConfig, RlixConfig, RolloutConfig
from rlix.config.preflight import anchor_task, task_problems
from rlix.envs import TaskConfig, make_task
from rlix.errors import ConfigError, InvalidRequestError, format_validation_error, one_line, problems_line
from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.server.openai_schema import GenerateSamplingParams
from rlix.inference.router.router import Generation
from rlix.pipeline.evaluation import EvalResult, Evaluator

#: a checkpoint of a run: a `model` folder (servable, config.json in it) beside the trainer's `trainer.json`
CHECKPOINT_STATE = "trainer.json"


@dataclass(frozen=True)
class EvalTarget:
    """One evaluation to run: a model folder (or preset), its held-out task and settings."""

    name: str  # the pipeline's name, or the checkpoint folder's
    model: str
    evaluation: EvalConfig  # its task is set
    rollout: RolloutConfig  # max_new_tokens, stop, max_model_len
    seed: int = 0
    checkpoint_step: int | None = None  # the run's step of a checkpoint found with --checkpoint latest


@dataclass(frozen=True)
class Overrides:
    """The command line's settings over the config's `eval:` (None: the config's)."""

    samples: int | None = None
    k: int | None = None
    temperature: float | None = None
    threshold: float | None = None
    max_new_tokens: int | None = None

    def apply(self, evaluation: EvalConfig, rollout: RolloutConfig, source: str) -> tuple[EvalConfig, RolloutConfig]:
        """The settings with the overrides, checked as the config's fields are (a bad one is a
        ConfigError naming the flag's field)."""
        changes = {k: v for k, v in (("samples", self.samples), ("k", self.k), ("temperature", self.temperature),
                                     ("threshold", self.threshold)) if v is not None}
        try:
            evaluation = EvalConfig.model_validate({**evaluation.model_dump(), **changes})
            if self.max_new_tokens is not None:
                rollout = RolloutConfig.model_validate({**rollout.model_dump(), "max_new_tokens": self.max_new_tokens})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(source, exc)) from None
        return evaluation, rollout


def latest_checkpoint(pipeline_dir: Path) -> tuple[Path, int]:
    """The newest checkpoint a run left for one pipeline: of the `model` folders under its
    `checkpoint/` that sit beside a `trainer.json`, the one of the highest step (then the most
    recent); the model folder and its step."""
    root = pipeline_dir / "checkpoint"
    found: list[tuple[int, float, str]] = []
    for state in root.rglob(CHECKPOINT_STATE) if root.is_dir() else []:
        model = state.parent / "model"
        try:
            step = int(json.loads(state.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (model / "config.json").is_file():
            found.append((step, state.stat().st_mtime, str(model)))
    if not found:
        raise ConfigError(f"{root}: no checkpoint (a model/ folder beside a {CHECKPOINT_STATE}); evaluate the "
                          "config's model without --checkpoint, or a model folder")
    step, _, model = max(found)
    return Path(model), step


def _pipelines(config: RlixConfig, source: str, only: str | None) -> list[PipelineConfig]:
    pipelines = [p for p in config.pipelines if only is None or p.name == only]
    if not pipelines:
        names = ", ".join(p.name for p in config.pipelines)
        raise ConfigError(f"{source}: no pipeline {only!r} (its pipelines: {names})")
    return pipelines


def _task_file(path: str) -> TaskConfig:
    """A task config from its own YAML file (a pipeline's `task:` mapping), its paths read from its folder."""
    if not Path(path).is_file():
        raise ConfigError(f"--task {path}: no such file (a YAML task config: name, path, reward, ...)")
    return anchor_task(load_model(TaskConfig, path), Path(path).expanduser().resolve().parent)


def targets(target: str, *, task: str | None = None, config: str | None = None, checkpoint: str | None = None,
            pipeline: str | None = None, overrides: Overrides = Overrides()) -> list[EvalTarget]:
    """What `rlix eval TARGET ...` evaluates; a ConfigError (one line) when the arguments or the
    files they name cannot work."""
    path = Path(target).expanduser()
    if checkpoint not in (None, "latest"):
        raise ConfigError(f"--checkpoint {checkpoint!r}: only 'latest' (the newest checkpoint in run_dir) is "
                          "known; to evaluate another, give its model folder as the target")
    found: list[EvalTarget] = []
    if path.is_file():  # a run config
        if config is not None:
            raise ConfigError("--config is for a checkpoint folder: the target is a config already")
        cfg = load_config(path)
        for p in _pipelines(cfg, target, pipeline):
            held_out = _task_file(task) if task else p.eval.task
            if held_out is None:
                raise ConfigError(f"{target}: pipeline {p.name} has no eval.task (the held-out set); add one, "
                                  "or give --task TASK.yaml")
            model, step = p.model, None
            if checkpoint == "latest":
                model_dir, step = latest_checkpoint(Path(cfg.run_dir).expanduser() / p.name)
                model = str(model_dir)
            evaluation, rollout = overrides.apply(p.eval.model_copy(update={"task": held_out}), p.rollout, target)
            found.append(EvalTarget(p.name, model, evaluation, rollout, p.seed, step))
    elif path.is_dir():  # a model folder
        if checkpoint is not None:
            raise ConfigError("--checkpoint is for a config: the target is a model folder already")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{target}: not a model folder (no config.json); give a Hugging Face model folder "
                              "or a run config")
        if (task is None) == (config is None):
            raise ConfigError(f"{target}: a model folder needs the held-out task: --task TASK.yaml, or --config "
                              "CONFIG.yaml (its pipeline's eval.task)")
        evaluation, rollout, seed = EvalConfig(), RolloutConfig(), 0
        if config is not None:
            cfg = load_config(config)
            chosen = _pipelines(cfg, config, pipeline)
            if len(chosen) > 1:
                raise ConfigError(f"{config}: {len(chosen)} pipelines; choose one with --pipeline NAME")
            p = chosen[0]
            if p.eval.task is None:
                raise ConfigError(f"{config}: pipeline {p.name} has no eval.task (the held-out set)")
            evaluation, rollout, seed = p.eval, p.rollout, p.seed
        else:
            evaluation = evaluation.model_copy(update={"task": _task_file(str(task))})
        evaluation, rollout = overrides.apply(evaluation, rollout, target)
        found.append(EvalTarget(path.resolve().name if path.name != "model" else path.resolve().parent.name,
                                str(path.resolve()), evaluation, rollout, seed))
    else:
        raise ConfigError(f"{target}: no such file or folder (give a run config YAML or a model folder)")
    problems = [line for t in found if t.evaluation.task is not None
                for line in task_problems(t.evaluation.task, f"{t.name}: eval.task")]
    if problems:
        raise ConfigError(problems_line(target, problems))
    return found


class EngineGenerate:
    """The collector's generate function over an embedded engine in this process: a request's
    sampling settings as the engine server would take them (max_tokens capped to the context
    left), the answer as the router gives it."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.count = 0

    async def __call__(self, ids: list[int], params: GenerateSamplingParams, session: str | None) -> Generation:
        room = self.engine.max_model_len - len(ids)
        if room < 1:
            raise InvalidRequestError(f"the prompt ({len(ids)} tokens) leaves no room in the context "
                                      f"({self.engine.max_model_len} tokens: rollout.max_model_len)")
        self.count += 1
        sampling = SamplingParams(max_tokens=min(params.max_tokens or room, room), temperature=params.temperature,
                                  seed=params.seed, stop=tuple(params.stop or ()), logprobs=False)
        last = None
        async for out in self.engine.generate(f"eval-{self.count}", ids, sampling, final_only=True):
            last = out
        if last is None:
            raise InvalidRequestError("the engine answered nothing")
        return Generation(list(last.token_ids), [], [], str(last.finish_reason), len(ids))


def evaluate_target(t: EvalTarget, *, device: str = "cpu", max_num_seqs: int = 32) -> EvalResult:
    """One target's EvalResult, its model loaded into an embedded engine for the time of it."""
    assert t.evaluation.task is not None
    task = make_task(t.evaluation.task)
    engine = TorchEngine.from_pretrained(t.model, device=device, max_num_seqs=max_num_seqs,
                                         max_model_len=t.rollout.max_model_len)
    try:
        evaluator = Evaluator(t.evaluation, task, EngineGenerate(engine), engine.tokenizer,
                              max_new_tokens=t.rollout.max_new_tokens, stop=t.rollout.stop, seed=t.seed,
                              concurrency=max(1, max_num_seqs // (t.evaluation.k + 1)))
        return asyncio.run(evaluator.evaluate(t.checkpoint_step or 0))
    finally:
        engine.close()


def run_eval(target: str, *, task: str | None = None, config: str | None = None, checkpoint: str | None = None,
             pipeline: str | None = None, overrides: Overrides = Overrides(), device: str = "cpu",
             max_num_seqs: int = 32) -> list[dict[str, Any]]:
    """`rlix eval`: prints a line per target and the JSON line; returns the JSON's rows."""
    rows = []
    for t in targets(target, task=task, config=config, checkpoint=checkpoint, pipeline=pipeline,
                     overrides=overrides):
        try:
            result = evaluate_target(t, device=device, max_num_seqs=max_num_seqs)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model folder, the engine: one line naming the model
            raise ConfigError(f"{t.name}: evaluating {t.model}: {one_line(exc)}") from None
        if result.prompts == 0:
            raise ConfigError(f"{t.name}: every held-out prompt failed ({result.failed}); the first: "
                              f"{result.errors[0] if result.errors else '?'}")
        at = f" (checkpoint step {t.checkpoint_step})" if t.checkpoint_step is not None else ""
        print(f"{t.name}: {result.line()}{at}", flush=True)
        rows.append({"pipeline": t.name, "model": t.model, "checkpoint_step": t.checkpoint_step,
                     "pass@1": result.pass_at_1, "pass@k": result.pass_at_k, "k": result.k,
                     "reward_mean": result.reward_mean, "sampled_pass@1": result.sampled_pass_at_1,
                     "sampled_reward_mean": result.sampled_reward_mean, "threshold": result.threshold,
                     "prompts": result.prompts, "failed": result.failed, "seconds": round(result.seconds, 3)})
    print(json.dumps({"eval": rows}), flush=True)
    return rows
