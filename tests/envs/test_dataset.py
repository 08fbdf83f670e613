"""The `dataset` task (JSONL and parquet through `datasets`, chat messages, the row-seeing reward
function in its sync, async and batch forms, its typed errors) and the `reasoning_gym` task."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from rlix.envs import DatasetTask, Prompt, Task, TaskConfig, TaskFieldError, make_task
from rlix.errors import TaskError

datasets = pytest.importorskip("datasets")

ROWS = [{"question": "What is 2+3?", "answer": 5, "unit": "apples"},
        {"question": "What is 10/4?", "answer": 2.5, "unit": "pears"},
        {"question": "What is 7-4?", "answer": 3, "unit": "plums"}]

REWARDS = '''
import asyncio

SEEN = []

def exact(response, row):
    SEEN.append(dict(row))
    row["answer"] = "edited"  # a function that edits its row changes nothing for the next call
    return 1.0 if response.strip() == row["unit"] else 0.25

async def slow(response, row):
    await asyncio.sleep(0.01)
    return 2.0 if row["unit"] in response else -1.0

def batch(responses, rows):
    return [len(r) / 10 for r in responses]

async def abatch(responses, rows):
    return tuple(float(r == rows[0]["unit"]) for r in responses)

def boom(response, row):
    raise KeyError("no such field")

def nan(response, row):
    return float("nan")

def text(response, row):
    return "high"

def short(responses, rows):
    return [1.0]
'''


@pytest.fixture
def data(tmp_path: Path) -> Path:
    (tmp_path / "rw.py").write_text(REWARDS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "rows.parquet")
    return tmp_path


def task(data: Path, file: str = "rows.jsonl", **kw) -> DatasetTask:  # type: ignore[no-untyped-def]
    cfg = {"name": "dataset", "path": str(data / file), "prompt_column": "question",
           "reward": f"{data / 'rw.py'}:exact", **kw}
    made = make_task(cfg)
    assert isinstance(made, DatasetTask) and isinstance(made, Task)
    return made


def rewards(t: DatasetTask, prompt: Prompt, responses: list[str]) -> list[float]:
    return asyncio.run(t.rewards(prompt, responses))


@pytest.mark.parametrize("file", ["rows.jsonl", "rows.parquet"])
def test_reads_jsonl_and_parquet_and_the_reward_sees_the_whole_row(data, file):
    t = task(data, file, system_prompt="Answer in one word.")
    assert len(t) == 3
    p = t.prompt(1)
    assert p.text == "What is 10/4?" and p.meta == ROWS[1]
    assert p.messages == [{"role": "system", "content": "Answer in one word."},
                          {"role": "user", "content": "What is 10/4?"}]
    assert rewards(t, p, ["pears", " pears\n", "apples"]) == [1.0, 1.0, 0.25]
    seen = t.score.fn.__globals__["SEEN"]  # what the loaded function recorded
    assert seen[-3:] == [ROWS[1]] * 3  # each call got the row as it is in the file, extra fields too
    draws = [t.sample_prompt(random.Random(4)).meta for _ in range(2)]
    assert draws[0] == draws[1]  # the same seed, the same row
    assert {t.sample_prompt(rng).meta["unit"] for rng in [random.Random(0)] for _ in range(40)} == {
        r["unit"] for r in ROWS}


def test_async_and_batch_reward_functions(data):
    p = task(data).prompt(0)
    slow = task(data, reward=f"{data / 'rw.py'}:slow")
    assert rewards(slow, p, ["3 apples", "5"]) == [1.0, 0.0]  # clamped into [0, 1]
    batch = task(data, reward=None, reward_batch=f"{data / 'rw.py'}:batch")
    assert rewards(batch, p, ["abc", "x" * 20, ""]) == [0.3, 1.0, 0.0]
    abatch = task(data, reward=None, reward_batch=f"{data / 'rw.py'}:abatch")
    assert rewards(abatch, p, ["apples", "pears"]) == [1.0, 0.0]


@pytest.mark.parametrize("fn, batch, match", [
    ("boom", False, r"reward '.*rw.py:boom' failed: KeyError: 'no such field'"),
    ("nan", False, r"reward '.*rw.py:nan' returned NaN"),
    ("text", False, r"reward '.*rw.py:text' returned str, not a number"),
    ("short", True, r"reward_batch '.*rw.py:short' returned 1 values for 2 responses"),
    ("batch", False, r"reward '.*rw.py:batch' returned list, not a number"),  # the batch form named as reward
])
def test_a_reward_function_that_fails_is_a_task_error_naming_it(data, fn, batch, match):
    spec = f"{data / 'rw.py'}:{fn}"
    t = task(data, reward=None if batch else spec, reward_batch=spec if batch else None)
    with pytest.raises(TaskError, match=match):
        rewards(t, t.prompt(0), ["a", "b"])


def test_messages_column_and_plain_text(data):
    chats = [{"messages": [{"role": "user", "content": "hi"}], "gold": "x"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
              "gold": "y"}]
    (data / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    t = make_task({"name": "dataset", "path": str(data / "chat.jsonl"), "messages_column": "messages",
                   "system_prompt": "You are terse.", "reward": f"{data / 'rw.py'}:batch"})
    first, second = t.prompt(0), t.prompt(1)  # type: ignore[attr-defined]
    assert first.messages == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    assert second.messages == chats[1]["messages"]  # the row's own system message stays, alone
    assert second.text == "and 3+3?" and second.meta["gold"] == "y"
    plain = task(data, chat_template=False, system_prompt="Answer:")
    p = plain.prompt(2)
    assert p.messages is None and p.text == "Answer:\nWhat is 7-4?"
    assert task(data, chat_template=False).prompt(2).text == "What is 7-4?"


@pytest.mark.parametrize("content, field, match", [
    (None, "path", "no such file"),
    ('{"question": "a"}\n{"question": ""}\n', "prompt_column", r"row 2: 'question' must be a non-empty string"),
    ('{"question": "a"}\n{"question": null}\n', "prompt_column", r"row 2: 'question' must be a non-empty string"),
    ('{"q": "a"}\n', "prompt_column", r"has no column 'question' \(its columns: q\)"),
    ("not json\n", "path", "cannot be read as json"),
])
def test_bad_files_name_the_field(data, content, field, match):
    if content is not None:
        (data / "bad.jsonl").write_text(content)
    with pytest.raises(TaskFieldError, match=match) as err:
        task(data, "bad.jsonl")
    assert err.value.field == field


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="needs a path"):
        TaskConfig(name="dataset", reward="m:f")
    with pytest.raises(ValueError, match="one of reward or reward_batch"):
        TaskConfig(name="dataset", path="x.jsonl")
    with pytest.raises(ValueError, match="one of reward or reward_batch"):
        TaskConfig(name="dataset", path="x.jsonl", reward="m:f", reward_batch="m:g")
    with pytest.raises(ValueError, match="reward 'nocolon'"):
        TaskConfig(name="dataset", path="x.jsonl", reward="nocolon")
    with pytest.raises(ValueError, match="messages_column needs chat_template"):
        TaskConfig(name="dataset", path="x.jsonl", reward="m:f", messages_column="m", chat_template=False)
    with pytest.raises(ValueError, match="uses verifier"):
        TaskConfig(name="jsonl", path="x.jsonl", reward="m:f")
    with pytest.raises(ValueError, match="at most 256"):
        TaskConfig(name="dataset", path="x.jsonl", reward="m:f", prompt_column="c" * 257)
    with pytest.raises(ValueError, match="needs a dataset"):
        TaskConfig(name="reasoning_gym")


def test_reward_function_that_does_not_import(data):
    with pytest.raises(TaskFieldError, match="reward 'no_such_module_xyz:f' cannot be imported") as err:
        task(data, reward="no_such_module_xyz:f")
    assert err.value.field == "reward"
    with pytest.raises(TaskFieldError, match="has no 'missing'") as err:
        task(data, reward=None, reward_batch=f"{data / 'rw.py'}:missing")
    assert err.value.field == "reward_batch"


def test_reasoning_gym_task_uses_its_generator_and_scorer():
    pytest.importorskip("reasoning_gym")
    t = make_task({"name": "reasoning_gym", "dataset": "basic_arithmetic", "size": 50, "data_seed": 3,
                   "system_prompt": "Put the answer in <answer></answer>.", "answer_tag": "answer"})
    p = t.sample_prompt(random.Random(0))
    assert p.messages is not None and p.messages[0]["role"] == "system" and p.messages[1]["content"] == p.text
    assert p.text == p.meta["question"] and p.answer == p.meta["answer"]
    right, wrong = f"So <answer>{p.answer}</answer>", "<answer>nonsense</answer>"
    got = asyncio.run(t.rewards(p, [right, wrong, str(p.answer), f"<answer>x</answer><answer>{p.answer}</answer>"]))
    assert got[0] == 1.0 and got[1] == 0.0 and got[2] == 0.0 and got[3] == 1.0  # no tag: 0; the last tag counts
    plain = make_task({"name": "reasoning_gym", "dataset": "basic_arithmetic", "size": 5, "chat_template": False})
    q = plain.sample_prompt(random.Random(0))
    assert q.messages is None and asyncio.run(plain.rewards(q, [f" {q.answer}\n"])) == [1.0]
    with pytest.raises(TaskFieldError, match="no_such_generator") as err:
        make_task({"name": "reasoning_gym", "dataset": "no_such_generator"})
    assert err.value.field == "dataset"
