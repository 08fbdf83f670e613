"""Experiment logging: a pipeline's per-step metrics (the rows of metrics.jsonl) to trackers, as the
config's `logging:` section chooses: TensorBoard event files (run_dir/<name>/tensorboard/) and
Weights & Biases (run_dir/<name>/wandb/; offline by default, so no network is needed); and
each step's readable samples as a text table (TensorBoard) or a wandb.Table.

`open_experiment_log` builds an `ExperimentLog`, the fan-out the runner calls once per step
(`log(row)`) and closes at shutdown. A tracker that fails is dropped with a warning: a metrics
sink never fails training. Each tracker is imported only when chosen (wandb takes seconds).

Resume: the steps after the checkpoint are trained again. TensorBoard is opened with a purge
step (the first step this start will write), so readers drop what an earlier start wrote from
there on: every step once, the newest values. wandb continues the same wandb run (its id is kept
in run_dir/<name>/wandb/rlix_run.json) and accepts a step once, so the steps trained again are
skipped until the run passes the last step it holds.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rlix.config.models import LoggingConfig, WandbConfig
from rlix.errors import ConfigError, one_line
from rlix.pipeline.reporting.samples import COLUMNS, SampleRow, markdown_table

log = logging.getLogger("rlix.pipeline")

#: fields of a step row that are not metrics
NOT_SCALARS = ("step", "finished_at")


class ExperimentLogger(Protocol):
    """One tracker: a step's scalars in, closed once at the end."""

    name: str

    def log(self, step: int, scalars: Mapping[str, float], walltime: float | None = None) -> None: ...

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None: ...

    def close(self) -> None: ...


def scalars_of(row: Mapping[str, Any]) -> dict[str, float]:
    """A step row as tagged scalars: numbers only (a metric without a value, such as `kl` with
    no reference model, is left out); keys that name their group (`eval/pass@1`) as they are,
    timings (`*_s`) under `time/`, the rest under `train/` (reward, loss, entropy, response
    lengths, rates `*_per_s`, ...)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        timing = key.endswith("_s") and not key.endswith("_per_s")  # rates are not timings
        out[key if "/" in key else f"time/{key}" if timing else f"train/{key}"] = float(value)
    return out


class TensorBoardLogger:
    """Event files through torch's SummaryWriter, flushed every step (a killed pipeline keeps
    what it logged). `start_step`: the last step already done; what an earlier start wrote
    after it is purged for readers."""

    name = "tensorboard"

    def __init__(self, logdir: Path, start_step: int = 0) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # deferred: imported only when chosen
        except ImportError as exc:
            raise ConfigError(f"logging.tensorboard: cannot import tensorboard ({one_line(exc)}); "
                              "pip install tensorboard") from None
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self.writer = SummaryWriter(str(logdir), purge_step=start_step + 1)

    def log(self, step: int, scalars: Mapping[str, float], walltime: float | None = None) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step, walltime=walltime)
        self.writer.flush()

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        """A Markdown table under the tag `samples` (TensorBoard's Text tab), flushed with the
        step's scalars that follow."""
        self.writer.add_text("samples", markdown_table(rows), step)

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """One wandb run per pipeline, in `root`/wandb/. Its mode goes to wandb through its settings
    (nothing here reads or sets WANDB_* variables)."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, *, pipeline: str, root: Path, group: str,
                 config: Mapping[str, Any] | None = None, start_step: int = 0) -> None:
        try:
            import wandb  # deferred: imported only when chosen (seconds), optional dependency
        except ImportError as exc:
            raise ConfigError(f"logging.wandb: cannot import wandb ({one_line(exc)}); pip install wandb, "
                              "or pip install 'rlix[wandb]'") from None
        root.mkdir(parents=True, exist_ok=True)
        self.state_path = root / "wandb" / "rlix_run.json"
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        state = self._state() if start_step > 0 else {}  # a start from step 0 is a new wandb run
        self.run_id: str = state.get("id") or secrets.token_hex(6)
        self.last_step: int = int(state.get("last_step", 0))
        settings = wandb.Settings(mode=cfg.mode, silent=True, console="off", disable_git=True,
                                  save_code=False, x_disable_stats=True)
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=pipeline, group=group,
                              tags=list(cfg.tags) or None, config=dict(config or {}), dir=str(root),
                              id=self.run_id, resume="allow", reinit="create_new", settings=settings)
        self._save_state()

    @property
    def run_dir(self) -> Path:
        """Where wandb writes this run (offline: the folder `wandb sync` uploads)."""
        return Path(self.run.dir).parent

    def _state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.run_id, "last_step": self.last_step}))
        tmp.replace(self.state_path)

    def log(self, step: int, scalars: Mapping[str, float], walltime: float | None = None) -> None:
        if step <= self.last_step:  # trained again after a resume: wandb holds this step already
            return
        self.run.log(dict(scalars), step=step)
        self.last_step = step
        self._save_state()

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        """A wandb.Table under `samples`, at the step whose scalars follow (the same wandb step)."""
        if step <= self.last_step:
            return
        import wandb  # deferred: imported by __init__ already

        table = wandb.Table(columns=list(COLUMNS))
        for r in rows:
            table.add_data(r.step, r.prompt, r.response, r.reward, r.advantage, r.response_tokens, r.finish_reason)
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class ExperimentLog:
    """The chosen trackers, fed together. A tracker that raises is dropped (with a warning)."""

    def __init__(self, loggers: list[ExperimentLogger]) -> None:
        self.loggers = list(loggers)

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def log(self, row: Mapping[str, Any]) -> None:
        """One metrics.jsonl row (its `step`, its `finished_at` as the wall time)."""
        scalars = scalars_of(row)
        walltime = row.get("finished_at")
        for logger in list(self.loggers):
            try:
                logger.log(int(row["step"]), scalars, walltime)
            except Exception as exc:  # noqa: BLE001 - a metrics sink must not fail training
                log.warning("experiment log: %s failed, no more steps go to it: %s", logger.name, one_line(exc))
                self.loggers.remove(logger)

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        """A step's readable samples (before its row: trackers that take a step once see both)."""
        if not rows:
            return
        for logger in list(self.loggers):
            try:
                logger.log_samples(step, rows)
            except Exception as exc:  # noqa: BLE001 - a metrics sink must not fail training
                log.warning("experiment log: %s failed on samples, no more steps go to it: %s",
                            logger.name, one_line(exc))
                self.loggers.remove(logger)

    def close(self) -> None:
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:  # noqa: BLE001 - close the others all the same
                log.warning("experiment log: closing %s failed: %s", logger.name, one_line(exc))
        self.loggers = []


def open_experiment_log(cfg: LoggingConfig | None, *, pipeline: str, pipeline_dir: Path, start_step: int = 0,
                        config: Mapping[str, Any] | None = None) -> ExperimentLog:
    """The trackers `cfg` chooses for one pipeline whose files go to `pipeline_dir`
    (run_dir/<name>); `start_step`: the step it starts after (a resume's checkpoint)."""
    chosen: list[tuple[str, Callable[[], ExperimentLogger]]] = []
    if cfg is not None and cfg.tensorboard:
        chosen.append(("tensorboard", lambda: TensorBoardLogger(pipeline_dir / "tensorboard", start_step)))
    if cfg is not None and cfg.wandb is not None and cfg.wandb.mode != "disabled":
        wb = cfg.wandb
        group = wb.group or pipeline_dir.resolve().parent.name
        chosen.append(("wandb", lambda: WandbLogger(wb, pipeline=pipeline, root=pipeline_dir, group=group,
                                                    config=config, start_step=start_step)))
    out = ExperimentLog([])
    for name, make in chosen:
        try:
            out.loggers.append(make())
        except ConfigError:  # not installed: the config asks for what cannot be
            out.close()
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. wandb online without a network: train anyway
            log.warning("%s: experiment log: %s could not start, the run goes on without it: %s",
                        pipeline, name, one_line(exc))
    return out
