"""Tasks: rewards by hand, JSONL loading and its errors, the settings model."""

from __future__ import annotations

import json
import random

import pytest

from rlix.envs import ArithmeticTask, JsonlTask, PatternTask, Prompt, Task, TaskConfig, make_task, numeric_credit
from rlix.errors import ConfigError, TaskError


def test_pattern_reward_is_the_share_of_matching_characters():
    task = PatternTask(["ab"], length=4)
    p = Prompt("Repeat: ab\n", "ab")
    assert task.reward(p, "abab") == 1.0
    assert task.reward(p, "ababXYZ") == 1.0  # only the first `length` characters count
    assert task.reward(p, "ab ab") == 0.5  # a blank is a character like any other
    assert task.reward(p, "abba") == 0.5
    assert task.reward(p, "a") == 0.25  # short answers lose the missing positions
    assert task.reward(p, "") == 0.0
    single = PatternTask()  # the default: one fixed character
    q = single.sample_prompt(random.Random(0))
    assert q.text == "Repeat: a\n" and q.answer == "a"
    assert single.reward(q, "aaaaaabbbbbb") == 0.5


def test_pattern_prompts_name_their_pattern_and_draws_are_reproducible():
    task = PatternTask(["ab", "xyz"], length=6)
    draws = [task.sample_prompt(random.Random(5)) for _ in range(2)]
    assert draws[0] == draws[1]
    seen = {task.sample_prompt(rng).answer for rng in [random.Random(1)] for _ in range(50)}
    assert seen == {"ab", "xyz"}
    p = Prompt("Repeat: xyz\n", "xyz")
    assert task.reward(p, "xyzxyz") == 1.0 and task.reward(p, "xyxyxy") == pytest.approx(2 / 6)
    with pytest.raises(ValueError):
        PatternTask([""])


@pytest.mark.parametrize("answer,response,credit", [
    (7, "7", 1.0),
    (7, " 7 and more", 1.0),  # the first number counts
    (12, "12.0", 1.0),  # numerically equal
    (12, "13", 0.5),  # right number of digits
    (12, "3", 0.2),  # a number at least
    (-4, "-4", 1.0),
    (2.5, "2.5", 1.0),
    (12, "no number", 0.0),
    (12, "", 0.0),
    ("abc", "abc", 0.0),  # no number in the response
])
def test_numeric_credit_by_hand(answer, response, credit):
    assert numeric_credit(answer, response) == credit


def test_arithmetic_prompts_carry_their_sum():
    task = ArithmeticTask(9)
    for seed in range(20):
        p = task.sample_prompt(random.Random(seed))
        a, b = (int(x) for x in p.text.rstrip("=").split("+"))
        assert p.answer == a + b and 0 <= a <= 9 and 0 <= b <= 9
        assert task.reward(p, str(a + b)) == 1.0
    assert task.reward(Prompt("5+6=", 11), "12") == 0.5
    assert task.reward(Prompt("5+6=", 11), "what") == 0.0


def test_jsonl_task_with_builtin_and_custom_verifiers(tmp_path, monkeypatch):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "2+2=", "answer": 4, "id": 7}\n\n'
                    '{"prompt": "capital of France?", "answer": "Paris"}\n')
    task = make_task({"name": "jsonl", "path": str(data), "verifier": "contains"})
    assert isinstance(task, JsonlTask) and isinstance(task, Task) and len(task.items) == 2
    assert task.items[0].meta == {"id": 7}
    assert task.reward(task.items[1], "It is Paris.") == 1.0
    assert task.reward(task.items[1], "Lyon") == 0.0
    exact = make_task(TaskConfig(name="jsonl", path=str(data)))
    assert exact.reward(exact.items[1], " Paris\n") == 1.0 and exact.reward(exact.items[1], "Paris!") == 0.0
    numeric = make_task(TaskConfig(name="jsonl", path=str(data), verifier="numeric"))
    assert numeric.reward(numeric.items[0], "4") == 1.0 and numeric.reward(numeric.items[0], "5") == 0.5
    (tmp_path / "my_verifier.py").write_text(
        "def score(prompt, answer, response):\n"
        "    if response == 'boom':\n        raise KeyError('x')\n"
        "    if response == 'nan':\n        return float('nan')\n"
        "    return 2.0 if response == 'yes' else -1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    custom = make_task({"name": "jsonl", "path": str(data), "verifier": "my_verifier:score"})
    assert custom.reward(custom.items[0], "yes") == 1.0  # clamped into [0, 1]
    assert custom.reward(custom.items[0], "no") == 0.0
    with pytest.raises(TaskError, match="my_verifier:score.*KeyError"):
        custom.reward(custom.items[0], "boom")
    with pytest.raises(TaskError, match="NaN"):
        custom.reward(custom.items[0], "nan")


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    """JSON strings may hold U+2028, U+0085 or a form feed unescaped (json.dumps with
    ensure_ascii=False writes them raw): they are part of the prompt, not line breaks."""
    data = tmp_path / "data.jsonl"
    texts = ["first\u2028second", "a\x85b\x0cc", "plain"]
    data.write_text("".join(json.dumps({"prompt": t, "answer": i}, ensure_ascii=False) + "\r\n"
                            for i, t in enumerate(texts)), encoding="utf-8")
    task = make_task({"name": "jsonl", "path": str(data)})
    assert [p.text for p in task.items] == texts and [p.answer for p in task.items] == [0, 1, 2]


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "x"}\n', r"data.jsonl:1: each line needs"),
    ('{"prompt": "x", "answer": 1}\nnot json\n', r"data.jsonl:2: not JSON"),
    ('{"prompt": "x", "answer": 1}\n\n["a list"]\n', r"data.jsonl:3: each line needs"),
    ('{"prompt": 5, "answer": 1}\n', r"data.jsonl:1: each line needs a string"),
    ('{"prompt": "", "answer": 1}\n', r"data.jsonl:1: empty"),
    ("\n", r"data.jsonl: no prompts"),
])
def test_bad_jsonl_is_refused_naming_file_and_line(tmp_path, content, match):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    with pytest.raises(ConfigError, match=match):
        make_task({"name": "jsonl", "path": str(data)})


def test_missing_or_binary_files_and_bad_verifiers_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="nope.jsonl: no such file"):
        make_task({"name": "jsonl", "path": str(tmp_path / "nope.jsonl")})
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="bin.jsonl: not UTF-8"):
        make_task({"name": "jsonl", "path": str(tmp_path / "bin.jsonl")})
    with pytest.raises(ConfigError, match="module:function"):
        make_task({"name": "jsonl", "path": __file__, "verifier": "nope"})
    with pytest.raises(ConfigError, match="cannot be imported"):
        make_task({"name": "jsonl", "path": __file__, "verifier": "no_such_module_xyz:f"})


def test_task_settings_are_strict():
    with pytest.raises(ValueError, match="needs a path"):
        TaskConfig(name="jsonl")
    with pytest.raises(ValueError, match="extra"):
        TaskConfig(name="pattern", pattern="a")  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="task: name"):
        make_task("chess")
    with pytest.raises(ConfigError, match="task: patterns"):
        make_task({"patterns": []})
    assert isinstance(make_task("pattern"), PatternTask)
    assert isinstance(make_task({"name": "arithmetic", "max_operand": 99}), ArithmeticTask)
    assert TaskConfig().patterns == ["a"]


def test_task_config_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, rlix.envs.config; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
