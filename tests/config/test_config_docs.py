"""docs/CONFIG.md's field reference is generated from the config models: a field added to a model
without regenerating it (python -m rlix.config.docs) fails here."""

from __future__ import annotations

from rlix.config import docs
from rlix.config.models import RlixConfig


def test_config_md_is_current():
    current = docs.DOC_PATH.read_text()
    assert docs.BEGIN in current and docs.END in current
    assert docs.render(current) == current, "docs/CONFIG.md is not current: run python -m rlix.config.docs"


def test_every_field_of_every_section_is_in_the_reference():
    text = docs.reference()
    for path in ("pipelines[].checkpoint_keep_last", "pipelines[].rollout.temperature", "pipelines[].task.name",
                 "pipelines[].env.max_turns", "scheduler.move_costs.margin", "logging.wandb.project", "run_dir"):
        assert f"| `{path}` |" in text, path
    assert len([line for line in text.splitlines() if line.startswith("| `")]) == len(list(docs.rows(RlixConfig)))
    row = next(line for line in text.splitlines() if line.startswith("| `pipelines[].rollout.temperature` |"))
    assert "| number | `1.0` | > 0, <= 100 | sampling temperature" in row


def test_the_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "CONFIG.md"
    stale.write_text("# Config\n\n" + docs.BEGIN + "\n| old |\n" + docs.END + "\n")
    assert docs.main(["--check", "--path", str(stale)]) == 1
    assert docs.main(["--path", str(stale)]) == 0 and docs.main(["--check", "--path", str(stale)]) == 0
    assert stale.read_text().startswith("# Config\n\n" + docs.BEGIN)
