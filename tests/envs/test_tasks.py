"""Tasks: rewards by hand, JSONL loading and its errors."""

from __future__ import annotations

import random

import pytest

from rlix.envs import ArithmeticTask, PatternTask, Prompt, TaskConfig, make_task
from rlix.errors import ConfigError


def test_pattern_reward_is_the_share_of_matching_characters():
    task = PatternTask(["ab"], length=4)
    p = Prompt("Repeat: ab\n", "ab")
    assert task.reward(p, "abab") == 1.0
    assert task.reward(p, "ab ab") == 0.5  # a blank is a character like any other
    assert task.reward(p, "abba") == 0.5
    assert task.reward(p, "a") == 0.25  # short answers lose the missing positions
    assert task.reward(p, "") == 0.0


def test_arithmetic_gives_partial_credit():
    task = ArithmeticTask(9)
    p = task.sample_prompt(random.Random(3))
    a, b = (int(x) for x in p.text.rstrip("=").split("+"))
    assert p.answer == a + b
    right = str(a + b)
    assert task.reward(p, f" {right} and more") == 1.0
    wrong_same_len = str((a + b + 1) % (10 ** len(right)) or 1).rjust(len(right), "1")
    if wrong_same_len != right:
        assert task.reward(p, wrong_same_len) == 0.5
    assert task.reward(p, "no number") == 0.0


def test_jsonl_task_with_builtin_and_custom_verifiers(tmp_path, monkeypatch):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "2+2=", "answer": 4}\n\n{"prompt": "capital of France?", "answer": "Paris"}\n')
    task = make_task({"name": "jsonl", "path": str(data), "verifier": "contains"})
    assert len(task.items) == 2
    assert task.reward(task.items[1], "It is Paris.") == 1.0
    assert task.reward(task.items[1], "Lyon") == 0.0
    numeric = make_task(TaskConfig(name="jsonl", path=str(data), verifier="numeric"))
    assert numeric.reward(numeric.items[0], "4") == 1.0
    (tmp_path / "my_verifier.py").write_text(
        "def score(prompt, answer, response):\n    return 2.0 if response == 'yes' else -1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = make_task({"name": "jsonl", "path": str(data), "verifier": "my_verifier:score"})
    assert custom.reward(custom.items[0], "yes") == 1.0  # clamped into [0, 1]
    assert custom.reward(custom.items[0], "no") == 0.0


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "x"}\n', r"data.jsonl:1: each line needs"),
    ('{"prompt": "x", "answer": 1}\nnot json\n', r"data.jsonl:2: not JSON"),
    ("\n", r"no prompts"),
])
def test_bad_jsonl_is_refused_naming_file_and_line(tmp_path, content, match):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    with pytest.raises(ConfigError, match=match):
        make_task({"name": "jsonl", "path": str(data)})


def test_bad_task_settings_are_refused():
    with pytest.raises(ValueError, match="needs a path"):
        TaskConfig(name="jsonl")
    with pytest.raises(ConfigError, match="module:function"):
        make_task({"name": "jsonl", "path": __file__, "verifier": "nope"})
