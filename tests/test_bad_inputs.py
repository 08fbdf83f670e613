"""Bad inputs, each through the real CLI entry point: exit code 2, one line on stderr, no
traceback, and the line names what is wrong (file, field path, pipeline, argument).

The table of every case and the line it gets is docs/RELIABILITY.md's "Bad inputs" section,
written by this test between its markers: the test fails when the committed table is out of
date (and rewrites it; commit the new one). HTTP bodies go to a real engine server and router and must get a 4xx that says why.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from rlix.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "RELIABILITY.md"
START, END = "<!-- bad-inputs:start -->", "<!-- bad-inputs:end -->"

GOOD_PIPE = {"name": "p", "model": "tiny", "steps": 2}


@dataclass
class Case:
    kind: str  # config | task file | verifier | model | CLI
    what: str  # the bad input, in words
    make: Callable[[Path], list[str]]  # writes what it needs under the dir; returns argv
    expect: str  # a regex the one-line message must match (names the file/field/argument)


def config(tmp: Path, text: str | bytes | None = None, name: str = "bad.yaml", **top: object) -> str:
    path = tmp / name
    if text is None:
        data = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "run_dir": str(tmp / "run"),
                "pipelines": [dict(GOOD_PIPE)]}
        for key, value in top.items():
            if key.startswith("p_"):
                data["pipelines"][0][key[2:]] = value
            else:
                data[key] = value
        text = yaml.safe_dump(data)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


def check(**top: object) -> Callable[[Path], list[str]]:
    return lambda tmp: ["check", config(tmp, **top)]


def check_text(text: str | bytes) -> Callable[[Path], list[str]]:
    return lambda tmp: ["check", config(tmp, text)]


def jsonl_task(content: str | bytes, verifier: str = "exact") -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        data = content.encode() if isinstance(content, str) else content
        (tmp / "tasks.jsonl").write_bytes(data)
        return ["check", config(tmp, p_task={"name": "jsonl", "path": "tasks.jsonl", "verifier": verifier})]
    return make


def verifier(module_text: str | None, spec: str) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        (tmp / "tasks.jsonl").write_text('{"prompt": "1+1=", "answer": 2}\n')
        if module_text is not None:
            (tmp / "myverifier.py").write_text(module_text)
        return ["check", config(tmp, p_task={"name": "jsonl", "path": "tasks.jsonl", "verifier": spec})]
    return make


def model_dir(files: dict[str, str]) -> Callable[[Path], list[str]]:
    def make(tmp: Path) -> list[str]:
        (tmp / "ckpt").mkdir()
        for name, text in files.items():
            (tmp / "ckpt" / name).write_text(text)
        return ["check", config(tmp, p_model="ckpt")]
    return make


def run_config(**top: object) -> Callable[[Path], list[str]]:
    return lambda tmp: ["run", config(tmp, **top)]


def file_as_run_dir(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["check", config(tmp, run_dir=str(tmp / "afile"))]


def under_a_file_run_dir(tmp: Path) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["run", config(tmp, run_dir=str(tmp / "afile" / "run"))]


def closed_port() -> str:
    from rlix.httpkit import free_port

    return f"127.0.0.1:{free_port('127.0.0.1')}"


CASES = [
    # ------------------------------------------------------------ the config file itself
    Case("config", "no such file", lambda tmp: ["check", str(tmp / "missing.yaml")], r"missing\.yaml: no such file"),
    Case("config", "a directory instead of a file", lambda tmp: ["check", str(tmp)], r"is a directory"),
    Case("config", "not UTF-8 (Latin-1 bytes)", check_text("run_dir: caf\xe9\n".encode("latin-1")), r"bad\.yaml: not UTF-8"),
    Case("config", "YAML syntax error", check_text("pipelines: [\n  - name: a\n"), r"bad\.yaml: line \d+ not valid YAML"),
    Case("config", "a list at the top level", check_text("- 1\n- 2\n"), r"expected a mapping at the top level"),
    Case("config", "an empty file", check_text(""), r"bad\.yaml: expected a mapping"),
    Case("config", "unknown top-level field", check(run_dri="x"), r"run_dri: unknown field"),
    Case("config", "no pipelines", check(pipelines=[]), r"pipelines: List should have at least 1 item"),
    Case("config", "unknown pipeline field", check(p_stpes=3), r"pipelines\[0\]\.stpes: unknown field"),
    Case("config", "steps is a string", check(p_steps="many"), r"pipelines\[0\]\.steps: .*integer.*'many'"),
    Case("config", "negative weight", check(p_weight=-1), r"pipelines\[0\]\.weight: .*greater than 0"),
    Case("config", "pipeline name with a space", check(p_name="my pipe"), r"pipelines\[0\]\.name: String should match"),
    Case("config", "min_shards above max_shards", check(p_min_shards=3, p_max_shards=2), r"pipelines\[0\]: .*min_shards \(3\) must not exceed max_shards \(2\)"),
    Case("config", "two pipelines with one name", check(pipelines=[GOOD_PIPE, GOOD_PIPE]), r"repeated: p"),
    Case("config", "train_gpus above the cluster", check(p_train_gpus=3), r"pipeline 'p': train_gpus=3 exceeds the cluster's 2 GPUs"),
    Case("config", "tp above gpus_per_node", check(p_tp=4, p_max_shards=1), r"pipeline 'p': tp=4 exceeds gpus_per_node=2"),
    Case("config", "standalone gpus outside the cluster", check(p_gpus=[0, 7]), r"pipeline 'p': gpus \[7\] are not in the cluster"),
    Case("config", "cluster with 0 nodes", check(cluster={"nodes": 0, "gpus_per_node": 1}), r"cluster: .*nodes must be >= 1"),
    Case("config", "unknown device", check(device="tpu"), r"device: Input should be 'auto', 'cpu' or 'cuda'"),
    Case("config", "unknown dtype", check(dtype="int4"), r"dtype: Input should be"),
    Case("config", "zero temperature", check(p_rollout={"temperature": 0}), r"pipelines\[0\]\.rollout\.temperature: .*greater than 0"),
    Case("config", "group of one sample", check(p_rollout={"group_size": 1}), r"pipelines\[0\]\.rollout\.group_size: .*greater than or equal to 2"),
    Case("config", "unknown restart policy", check(p_restart="always"), r"pipelines\[0\]\.restart: Input should be 'never' or 'on_failure'"),
    Case("config", "min_shards that cannot fit the cluster", check(p_min_shards=3, p_max_shards=3), r"pipelines\[0\] \(p\): min_shards=3 x tp=1 needs 3 GPUs but the cluster has 2"),
    Case("config", "floor + trainer without partial overlap", check(p_min_shards=2, p_max_shards=2, p_partial_overlap=False), r"pipelines\[0\] \(p\): min_shards=2 x tp=1 \+ train_gpus=1 \(partial_overlap off\) needs 3 GPUs"),
    Case("config", "run_dir is a file", file_as_run_dir, r"run_dir: .*afile exists and is not a directory"),
    Case("config", "run_dir under a file (rlix run)", under_a_file_run_dir, r"run_dir: cannot create .*afile/run: .*afile is not a directory"),
    # ------------------------------------------------------------ models
    Case("model", "unknown preset", check(p_model="gpt-17"), r"pipelines\[0\] \(p\)\.model: 'gpt-17' is neither a preset \(.*tiny.*\) nor a directory"),
    Case("model", "directory that is not a checkpoint", model_dir({"README": "hi"}), r"\.model: '.*ckpt' is not a checkpoint: no config\.json, no weights .*, no a tokenizer"),
    Case("model", "checkpoint without weights", model_dir({"config.json": "{}", "tokenizer.json": "{}"}), r"is not a checkpoint: no weights"),
    Case("model", "a file given as the model", lambda tmp: (tmp / "m.bin").write_text("x") and ["check", config(tmp, p_model=str(tmp / "m.bin"))], r"\.model: '.*m\.bin' is a file"),
    # ------------------------------------------------------------ task files
    Case("task file", "jsonl task without a path", check(p_task={"name": "jsonl"}), r"pipelines\[0\]\.task: .*task jsonl needs a path"),
    Case("task file", "missing task file", check(p_task={"name": "jsonl", "path": "nope.jsonl"}), r"\.task\.path: .*nope\.jsonl: no such file"),
    Case("task file", "a line that is not JSON", jsonl_task('{"prompt": "a", "answer": 1}\n{"prompt": \n'), r"tasks\.jsonl:2: not JSON"),
    Case("task file", "a line without a prompt", jsonl_task('{"question": "a", "answer": 1}\n'), r"tasks\.jsonl:1: each line needs a string \"prompt\" and an \"answer\""),
    Case("task file", "an empty prompt", jsonl_task('{"prompt": "", "answer": 1}\n'), r"tasks\.jsonl:1: empty \"prompt\""),
    Case("task file", "a file with no prompts", jsonl_task("\n\n"), r"tasks\.jsonl: no prompts"),
    Case("task file", "not UTF-8", jsonl_task(b'{"prompt": "caf\xe9", "answer": 1}\n'), r"tasks\.jsonl: not UTF-8"),
    Case("task file", "a JSON list instead of an object", jsonl_task('["a", 1]\n'), r"tasks\.jsonl:1: each line needs"),
    # ------------------------------------------------------------ verifiers
    Case("verifier", "not a name nor module:function", verifier(None, "fuzzy"), r"pipelines\[0\]\.task: verifier 'fuzzy': use one of exact, contains, numeric"),
    Case("verifier", "module that does not exist", verifier(None, "nosuchmod:score"), r"\.task\.verifier: verifier 'nosuchmod:score' cannot be imported: No module named 'nosuchmod'"),
    Case("verifier", "function missing from the module", verifier("def other(p, a, r):\n    return 1.0\n", "myverifier:score"), r"\.task\.verifier: verifier '.*myverifier\.py:score': .*myverifier\.py has no 'score'"),
    Case("verifier", "not callable", verifier("score = 3\n", "myverifier:score"), r"verifier '.*myverifier\.py:score' is not callable"),
    Case("verifier", "module that raises on import", verifier("raise RuntimeError('no GPU here')\n", "myverifier:score"), r"verifier '.*myverifier\.py:score': importing it raised RuntimeError: no GPU here"),
    Case("verifier", "file path that does not exist", verifier(None, "lib/score.py:score"), r"verifier '.*lib/score\.py:score' cannot be imported: no such file"),
    # ------------------------------------------------------------ command line
    Case("CLI", "unknown command", lambda tmp: ["frobnicate"], r"rlix: error: argument command: invalid choice: 'frobnicate'"),
    Case("CLI", "run without a config", lambda tmp: ["run"], r"rlix run: error: the following arguments are required: config"),
    Case("CLI", "run with an unknown --mode", lambda tmp: ["run", "x.yaml", "--mode", "fast"], r"argument --mode: invalid choice: 'fast'"),
    Case("CLI", "run with a bad config (fails before Ray)", run_config(p_steps=0), r"pipelines\[0\]\.steps: .*greater than or equal to 1"),
    Case("CLI", "serve with an unknown --device", lambda tmp: ["serve", "--model", "tiny", "--device", "tpu"], r"argument --device: invalid choice: 'tpu'"),
    Case("CLI", "serve with a non-numeric --port", lambda tmp: ["serve", "--model", "tiny", "--port", "http"], r"argument --port: invalid int value: 'http'"),
    Case("CLI", "sim with a missing scenario", lambda tmp: ["sim", str(tmp / "none.yaml")], r"none\.yaml: no such file"),
    Case("CLI", "sim with a non-UTF-8 scenario", lambda tmp: (tmp / "s.yaml").write_bytes(b"\xff\xfe") and ["sim", str(tmp / "s.yaml")], r"s\.yaml: not UTF-8"),
    Case("CLI", "status with a malformed --address", lambda tmp: ["status", "--address", "nowhere"], r"Ray address 'nowhere' \(--address or RAY_ADDRESS\): give host:port"),
    Case("CLI", "run with an address nothing listens on", lambda tmp: ["run", config(tmp), "--address", closed_port()], r"no Ray cluster answers at 127\.0\.0\.1:\d+"),
    Case("CLI", "run with an address that is not host:port", lambda tmp: ["run", config(tmp), "--address", "nowhere"], r"give host:port or ray://host:port"),
    Case("CLI", "status with an address nothing listens on", lambda tmp: ["status", "--address", closed_port()], r"no Ray cluster answers at 127\.0\.0\.1:\d+"),
    Case("CLI", "up with neither --num-gpus nor --address", lambda tmp: ["up"], r"rlix up: give --num-gpus N for a local cluster"),
    Case("CLI", "up with a negative --rotate-s", lambda tmp: ["up", "--num-gpus", "2", "--rotate-s", "-1"], r"rlix up: dwell_s, aging_s and rotate_s must be >= 0"),
    Case("CLI", "up with a malformed --quota", lambda tmp: ["up", "--num-gpus", "2", "--quota", "alice"], r"--quota 'alice': give USER=GPUS"),
    Case("CLI", "submit a config that fails its check", lambda tmp: ["submit", config(tmp, p_steps=0)], r"pipelines\[0\]\.steps: .*greater than or equal to 1"),
    Case("CLI", "submit with no cluster up", lambda tmp: ["submit", config(tmp), "--address", closed_port()], r"no Ray cluster answers at 127\.0\.0\.1:\d+"),
    Case("CLI", "cancel with no cluster up", lambda tmp: ["cancel", "job", "--address", closed_port()], r"no Ray cluster answers at 127\.0\.0\.1:\d+"),
    Case("CLI", "timeline of a missing run dir", lambda tmp: ["timeline", str(tmp / "none")], r"none: no such run directory"),
    Case("CLI", "timeline of a run dir without summary.json", lambda tmp: ["timeline", str(tmp)], r"summary\.json: not found"),
]


def normalise(line: str, tmp: Path) -> str:
    """The same table on every machine and run: no temp paths, no free-port numbers."""
    line = line.replace(str(tmp.resolve()), "<tmp>").replace(str(tmp), "<tmp>")
    return re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", line)


@pytest.fixture(scope="module")
def table() -> list[tuple[str, str, str]]:
    return []


@pytest.mark.parametrize("case", CASES, ids=[f"{c.kind}: {c.what}" for c in CASES])
def test_bad_input_gets_one_line_and_exit_code_2(case: Case, tmp_path, capsys, table) -> None:
    argv = case.make(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Traceback" not in out
    assert re.search(case.expect, lines[0]), lines[0]
    table.append((case.kind, case.what, normalise(lines[0], tmp_path)))


@pytest.mark.parametrize("argv", [["check", "{tmp}/missing.yaml"], ["run"], ["status", "--address", "nowhere"]])
def test_as_a_real_process_too(argv: list[str], tmp_path) -> None:
    """Through the installed entry point, in a fresh interpreter: exit 2, one line, no traceback."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    done = subprocess.run([sys.executable, "-m", "rlix.cli", *argv], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr


# ---------------------------------------------------------------- HTTP bodies
# (path, body bytes, what) sent to a real engine server and a real router; each must get a 4xx
# with a JSON error that says what is wrong, never a 500 or a traceback
HTTP_CASES = [
    ("engine", "/v1/completions", b"{not json", "malformed JSON"),
    ("engine", "/v1/completions", b"[1, 2]", "a JSON list instead of an object"),
    ("engine", "/v1/completions", b'{"model": "tiny"}', "completion without a prompt"),
    ("engine", "/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', "negative max_tokens"),
    ("engine", "/v1/completions", b'{"model": "nope", "prompt": "x"}', "unknown model"),
    ("engine", "/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', "chat messages as a string"),
    ("engine", "/inference/v1/generate", b'{"token_ids": [1, 99999999], "sampling_params": {}}', "token id outside the vocabulary"),
    ("engine", "/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"temperature": -1}}', "negative temperature"),
    ("engine", "/inference/v1/generate", b'{"token_ids": [], "sampling_params": {}}', "empty prompt"),
    ("engine", "/inference/v1/generate", b'{"token_ids": [1], "sampling_params": {"n": 0}}', "n = 0 samples"),
    ("engine", "/abort_requests", b"{oops", "control call with malformed JSON"),
    ("engine", "/v1/completions", b"x" * (5 * 2**20), "a 5 MiB body"),
    ("router", "/v1/completions", b"{not json", "malformed JSON"),
    ("router", "/inference/v1/generate", b'"just a string"', "a JSON string instead of an object"),
    ("router", "/router/shards", b'{"rank": "zero"}', "admin: rank not a number"),
    ("router", "/router/shards", b'{"rank": 3, "state": "sideways", "url": "http://x"}', "admin: unknown shard state"),
    ("router", "/router/shards", b'{"rank": 9}', "admin: a new shard without its url"),
    ("router", "/inference/v1/generate", b"x" * (5 * 2**20), "a 5 MiB body"),
]


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """A real engine server process and a router in front of it (own thread and loop)."""
    import asyncio
    import threading

    from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
    from rlix.inference.fleet.shard_process import ShardProcess
    from rlix.inference.router.app import RouterServer
    from rlix.inference.router.router import Router

    shard = ShardProcess(make_backend(EngineBackendConfig(backend="embedded", model=str(tiny_model_dir),
                                                          served_model_name="tiny", max_model_len=128)), "k")
    shard.start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    router = Router("k")
    server = RouterServer(router)
    try:
        shard.wait_ready()
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
        asyncio.run_coroutine_threadsafe(router.set_shard(0, shard.url, "active"), loop).result(10)
        yield {"engine": shard.url, "router": server.url}
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        shard.stop()


@pytest.mark.parametrize("case", HTTP_CASES, ids=[f"{c[0]} {c[1]}: {c[3]}" for c in HTTP_CASES])
def test_bad_http_body_gets_a_4xx_that_says_why(case, servers, http_table) -> None:
    import httpx

    where, path, body, what = case
    r = httpx.post(servers[where] + path, content=body, timeout=30,
                   headers={"Authorization": "Bearer k", "content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert "Traceback" not in r.text
    err = r.json().get("error")
    message = err.get("message") if isinstance(err, dict) else (err or r.json().get("detail"))
    assert message, r.text
    line = " ".join(str(message).split())
    http_table.append(("HTTP", f"{where} {path}: {what}", f"{r.status_code}: {line[:160]}"))


@pytest.fixture(scope="module")
def http_table() -> list[tuple[str, str, str]]:
    return []


def test_the_table_in_reliability_md_is_up_to_date(table, http_table) -> None:
    """Runs after the cases (file order): writes the table; fails if the committed one differed."""
    if len(table) != len(CASES) or len(http_table) != len(HTTP_CASES):
        pytest.skip("run the whole file to rebuild the table")
    table = table + http_table
    rows = ["| # | kind | bad input | what rlix says (CLI: stderr, exit code 2; HTTP: status and error) |",
            "| --- | --- | --- | --- |"]
    for i, (kind, what, line) in enumerate(table, 1):
        rows.append(f"| {i} | {kind} | {what} | `{line.replace('|', '/')}` |")
    block = "\n".join([START, *rows, END])
    text = DOC.read_text() if DOC.exists() else ""
    if START in text and END in text:
        new = text[:text.index(START)] + block + text[text.index(END) + len(END):]
    else:
        new = text.rstrip() + "\n\n## Bad inputs\n\nGenerated by `tests/test_bad_inputs.py`.\n\n" + block + "\n"
    if new != text:
        DOC.write_text(new)
        pytest.fail("docs/RELIABILITY.md's bad-input table was out of date; it has been rewritten: commit it")
