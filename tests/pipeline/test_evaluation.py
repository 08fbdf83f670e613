"""Held-out evaluation (pipeline/evaluation.py, `rlix eval`, the `eval:` section): pass@k
arithmetic, what is generated and scored, the loop's schedule, the command on a checkpoint
folder, and bad eval settings refused by `rlix check` naming the field."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
import yaml

from rlix.cli import main
from rlix.config.models import EvalConfig, PipelineConfig
from rlix.envs import JsonlTask, PatternTask, Prompt
from rlix.inference.router.router import Generation, VersionSpan
from rlix.pipeline.evaluation import (
    Evaluator, PeriodicEval, PromptScore, held_out_prompts, pass_at_k, summarize)


# ------------------------------------------------------------------ pass@k arithmetic
def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of k-subsets of n responses (c passing) that hold a passing one, counted."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k))


def test_pass_at_k_with_k_samples_is_any_passed_and_at_1_the_pass_rate():
    assert [pass_at_k(4, c, 4) for c in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(200, 3, 100) == pytest.approx(brute_pass_at_k_formula(200, 3, 100))


def brute_pass_at_k_formula(n: int, c: int, k: int) -> float:
    """1 - prod_{i=n-c+1..n} (1 - k/i): the product form, numerically independent of math.comb."""
    out = 1.0
    for i in range(n - c + 1, n + 1):
        out *= 1 - k / i
    return 1 - out


@pytest.mark.parametrize("n, c, k", [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_summarize_counts_passes_at_the_threshold_and_leaves_unknowns_out():
    scores = [PromptScore(1.0, (0.0, 1.0, 0.0)), PromptScore(0.5, (0.5, 0.5, 0.5)), PromptScore(0.0, (0.0, 0.0, 1.0))]
    r = summarize(3, scores, failed=1, k=3, threshold=1.0, seconds=0.5, errors=["x"])
    assert r.pass_at_1 == pytest.approx(1 / 3) and r.pass_at_k == pytest.approx(2 / 3)
    assert r.sampled_pass_at_1 == pytest.approx(2 / 9) and r.reward_mean == pytest.approx(0.5)
    assert r.sampled_reward_mean == pytest.approx(3.5 / 9)
    lower = summarize(3, scores, failed=0, k=3, threshold=0.5, seconds=0.0)
    assert lower.pass_at_1 == pytest.approx(2 / 3) and lower.pass_at_k == pytest.approx(1.0)
    row = r.as_row()
    assert row["eval/pass@1"] == r.pass_at_1 and row["eval/pass@k"] == r.pass_at_k
    assert row["eval/k"] == 3 and row["eval/prompts"] == 3 and row["eval/failed"] == 1
    greedy_only = summarize(1, [PromptScore(1.0)], failed=0, k=0, threshold=1.0, seconds=0.0).as_row()
    assert greedy_only["eval/pass@1"] == 1.0 and "eval/pass@k" not in greedy_only
    nothing = summarize(1, [], failed=2, k=2, threshold=1.0, seconds=0.0).as_row()
    assert "eval/pass@1" not in nothing and nothing["eval/failed"] == 2  # never NaN


# ------------------------------------------------------------------ prompts, generation, scoring
def test_held_out_prompts_are_a_files_first_rows_or_a_fixed_draw(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i}) + "\n" for i in range(5)))
    task = JsonlTask(path)
    assert [p.text for p in held_out_prompts(task, 3, 0)] == ["p0", "p1", "p2"]
    assert len(held_out_prompts(task, 99, 0)) == 5  # each row once
    pattern = PatternTask(["a", "b", "c"])
    first = [p.text for p in held_out_prompts(pattern, 6, seed=1)]
    assert first == [p.text for p in held_out_prompts(pattern, 6, seed=1)]


class Tok:
    """Characters as token ids."""

    def encode(self, text, add_special_tokens=False):  # type: ignore[no-untyped-def]
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, **kw):  # type: ignore[no-untyped-def]
        return [ord(c) for c in "<chat>" + messages[-1]["content"]]


class Scripted(PatternTask):
    """Rewards 1 for a response that starts with the prompt's answer; records each group scored."""

    def __init__(self) -> None:
        super().__init__(["a"], 4)
        self.groups: list[tuple[str, list[str]]] = []

    async def rewards(self, prompt, responses):  # type: ignore[no-untyped-def]
        self.groups.append((prompt.text, list(responses)))
        if prompt.text == "boom":
            raise RuntimeError("reward broke")
        return [float(r.startswith(str(prompt.answer))) for r in responses]


def test_the_evaluator_sends_greedy_and_seeded_samples_and_scores_each_group_once():
    calls: list[tuple[list[int], object, str | None]] = []

    async def generate(ids, params, session):  # type: ignore[no-untyped-def]
        calls.append((ids, params, session))
        # greedy answers right; samples right only for seed parity
        good = params.temperature == 0 or params.seed % 2 == 0
        text = ("x" if good else "y") + "!!STOP tail"
        return Generation([ord(c) for c in text], [], [VersionSpan(3, 0, len(text))], "stop", len(ids))

    task = Scripted()
    prompts = [Prompt("q1", "x"), Prompt("q2", "x", messages=[{"role": "user", "content": "q2"}]), Prompt("boom", "x")]
    evaluator = Evaluator(EvalConfig(k=3, temperature=0.7, samples=3), task, generate, Tok(),
                          max_new_tokens=5, stop=["!!"], seed=4)
    evaluator.prompts = prompts
    result = asyncio.run(evaluator.evaluate(step=6))
    assert len(calls) == 3 * 4  # a greedy and k sampled per prompt
    greedy = [c for c in calls if c[1].temperature == 0]
    assert len(greedy) == 3 and all(c[1].seed is None and c[1].max_tokens == 5 for c in greedy)
    sampled = [c for c in calls if c[1].temperature == 0.7]
    assert len({c[1].seed for c in sampled}) == len(sampled) == 9 and all(c[1].stop == ["!!"] for c in sampled)
    assert {c[2] for c in calls} == {"eval-6-0", "eval-6-1", "eval-6-2"}  # one session per prompt
    assert [ord(c) for c in "<chat>q2"] in [c[0] for c in calls]  # chat messages through the template
    assert len(task.groups) == 3 and all(len(r) == 4 for _, r in task.groups)  # one group of 1 + k
    assert all(r in ("x", "y") for _, rs in task.groups for r in rs)  # cut before the stop string
    assert result.prompts == 2 and result.failed == 1 and "reward broke" in result.errors[0]
    assert result.pass_at_1 == 1.0
    again = asyncio.run(evaluator.evaluate(step=8))  # the same prompts and seeds: the same scores
    assert again.pass_at_k == result.pass_at_k and again.sampled_pass_at_1 == result.sampled_pass_at_1


def test_periodic_eval_is_due_every_n_steps_and_after_the_last():
    cfg = PipelineConfig(name="p", steps=7, eval={"every": 3, "task": {"name": "arithmetic"}})
    periodic = PeriodicEval(cfg, evaluator=None, collector=None)  # type: ignore[arg-type]
    assert [s for s in range(0, 8) if periodic.due(s)] == [3, 6, 7]
    assert PeriodicEval.of(PipelineConfig(name="p"), collector=None) is None  # type: ignore[arg-type]


def test_an_evaluation_is_pending_work_for_the_scheduler():
    from rlix.config.models import RolloutConfig
    from rlix.pipeline.hooks import NoOpHooks
    from rlix.pipeline.rollout.buffer import ReplayBuffer
    from rlix.pipeline.rollout.collector import TrajectoryCollector

    async def main() -> None:
        col = TrajectoryCollector(None, Tok(), PatternTask(), ReplayBuffer(), NoOpHooks(),  # type: ignore[arg-type]
                                  RolloutConfig(group_size=2, groups_per_step=1), max_age=0)
        assert not col.pending_work()
        with col.other_work():
            assert col.pending_work()
        assert not col.pending_work() and col.buffer.accounting()["started"] == 0
    asyncio.run(main())


# ------------------------------------------------------------------ rlix eval, rlix check
def write_task(tmp: Path) -> Path:
    (tmp / "held.jsonl").write_text("".join(json.dumps({"q": f"{i}+{i}?", "answer": 2 * i}) + "\n" for i in range(4)))
    (tmp / "rw.py").write_text("def score(response, row):\n    return float(str(row['answer']) in response)\n")
    path = tmp / "task.yaml"
    path.write_text(yaml.safe_dump({"name": "dataset", "path": "held.jsonl", "prompt_column": "q",
                                    "reward": "rw:score"}))
    return path


def test_rlix_eval_on_a_checkpoint_folder_prints_pass_at_1(tmp_path, tiny_model_dir, capsys, monkeypatch):
    task = write_task(tmp_path)
    monkeypatch.chdir("/")  # the task's paths are read from its file's folder
    code = main(["eval", str(tiny_model_dir), "--task", str(task), "-k", "2", "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 2 and "pass@1 " in lines[0] and "pass@2 " in lines[0] and "(4 prompts" in lines[0]
    (row,) = json.loads(lines[1])["eval"]
    assert row["prompts"] == 4 and row["k"] == 2 and 0 <= row["pass@1"] <= 1 and row["failed"] == 0


@pytest.mark.parametrize("args, says", [
    ([], "needs the held-out task: --task TASK.yaml, or --config"),
    (["--task", "/nope.yaml"], "--task /nope.yaml: no such file"),
    (["--checkpoint", "latest"], "--checkpoint is for a config"),
    (["--task", "TASK", "-k", "-1"], "k"),
])
def test_rlix_eval_errors_are_one_line_exit_2(tmp_path, tiny_model_dir, capsys, args, says):
    task = write_task(tmp_path)
    args = [str(task) if a == "TASK" else a for a in args]
    assert main(["eval", str(tiny_model_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def config(tmp: Path, evaluation: dict) -> Path:
    write_task(tmp)
    data = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "run_dir": str(tmp / "run"),
            "pipelines": [{"name": "p", "steps": 2, "model": "tiny", "eval": evaluation}]}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


TASK = {"name": "dataset", "path": "held.jsonl", "prompt_column": "q", "reward": "rw:score"}


@pytest.mark.parametrize("evaluation, field", [
    ({"every": 2}, "pipelines[0].eval: task (the held-out set) is needed"),
    ({"every": -1, "task": TASK}, "pipelines[0].eval.every"),
    ({"every": 2, "task": TASK, "k": 1000}, "pipelines[0].eval.k"),
    ({"every": 2, "task": TASK, "threshold": 0}, "pipelines[0].eval.threshold"),
    ({"every": 2, "task": TASK, "samples": 0}, "pipelines[0].eval.samples"),
    ({"every": 2, "task": {**TASK, "path": "missing.jsonl"}}, "pipelines[0] (p).eval.task.path"),
    ({"every": 2, "task": {**TASK, "prompt_column": "question"}}, "pipelines[0] (p).eval.task.prompt_column"),
    ({"every": 2, "task": {**TASK, "reward": "rw:nope"}}, "pipelines[0] (p).eval.task.reward"),
    ({"every": 2, "task": {**TASK, "bogus": 1}}, "pipelines[0].eval.task.bogus"),
])
def test_bad_eval_settings_fail_rlix_check_naming_the_field(tmp_path, capsys, evaluation, field):
    assert main(["check", str(config(tmp_path, evaluation))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err


def test_a_good_eval_section_passes_rlix_check_from_any_folder(tmp_path, capsys, monkeypatch):
    path = config(tmp_path, {"every": 2, "task": TASK, "samples": 3, "k": 2})
    monkeypatch.chdir("/")
    assert main(["check", str(path)]) == 0, capsys.readouterr().err


def test_latest_checkpoint_is_the_highest_step(tmp_path):
    from rlix.eval_command import latest_checkpoint
    from rlix.errors import ConfigError

    with pytest.raises(ConfigError, match="no checkpoint"):
        latest_checkpoint(tmp_path)
    for name, step in (("step-3", 3), ("trainer", 10), ("step-7", 7)):
        model = tmp_path / "checkpoint" / name / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        (model.parent / "trainer.json").write_text(json.dumps({"step": step}))
    assert latest_checkpoint(tmp_path) == (tmp_path / "checkpoint" / "trainer" / "model", 10)
