"""The dashboard in a real headless Chromium (Debian's `chromium` and `chromedriver`, driven by
selenium; `scripts/setup.sh --with-browser` installs them): `rlix run` of the two-pipeline
example on fake GPUs, its dashboard opened in the browser: the page loads, shows both pipelines
in its table, and what it shows of the GPUs changes by itself (no reload) as the scheduler moves
them; the reward curves grow as steps end, each plotted point one row of the pipeline's
metrics.jsonl (and a chart per eval metric exactly when the rows carry one). Skipped without
the browser, except under RLIX_REQUIRE_BROWSER=1 (CI's browser step), where that fails.
Screenshots of the page are left in the test's tmp_path (docs/dashboard.png and
docs/dashboard_curves.png are such)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import json
import tempfile
import time
from pathlib import Path

import pytest
import yaml


def require_browser() -> bool:
    """`RLIX_REQUIRE_BROWSER=1` (CI's browser step): this test fails instead of skipping when
    Chromium, ChromeDriver or selenium is missing."""
    return os.environ.get("RLIX_REQUIRE_BROWSER", "").strip() in ("1", "true", "yes")


def chromium_paths() -> tuple[str, str]:
    """(browser, driver): `RLIX_CHROMIUM` and `RLIX_CHROMEDRIVER`, else Debian's
    /usr/bin/chromium and /usr/bin/chromedriver (`scripts/setup.sh --with-browser` installs them)."""
    return (os.environ.get("RLIX_CHROMIUM", "").strip() or "/usr/bin/chromium",
            os.environ.get("RLIX_CHROMEDRIVER", "").strip() or "/usr/bin/chromedriver")


pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ("pattern-s1", "pattern-s2")
#: flags that work on a machine without a network or a display
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,860")


def _browser():
    """selenium's webdriver module and the Chromium and ChromeDriver paths; skip (or fail where
    required) if any is missing."""
    chromium, driver = chromium_paths()
    missing = [p for p in (chromium, driver) if not os.access(p, os.X_OK)]
    try:
        from selenium import webdriver  # deferred: an optional test dependency (the `browser` extra)
    except ImportError:
        webdriver = None
        missing.append("the selenium package")
    if missing:
        reason = (f"no {', '.join(missing)} (install with `bash scripts/setup.sh --with-browser`)")
        if require_browser():
            pytest.fail(f"a browser is required here (RLIX_REQUIRE_BROWSER): {reason}")
        pytest.skip(reason)
    return webdriver, chromium, driver


def _config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "examples" / "two_pipelines.yaml").read_text())
    cfg["run_dir"] = str(tmp_path / "run")
    cfg["scheduler"]["dashboard_port"] = 0
    for p in cfg["pipelines"]:
        p["steps"] = 400  # runs until the test ends it
        p["checkpoint_every"] = 0
    path = tmp_path / "two_pipelines.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wait_for(what: str, fn, timeout_s: float, proc: subprocess.Popen, log: Path, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"rlix run exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(every_s)
    pytest.fail(f"no {what} within {timeout_s:g} s:\n{log.read_text()[-3000:]}")


def _shown(driver) -> dict:
    """What the page shows now: its table's pipelines and states, every GPU's holder and role,
    the number of role changes."""
    return driver.execute_script("""
        return {
          pipelines: Array.from(document.querySelectorAll('#pipelines tbody tr[data-pipeline]'))
                       .map(tr => [tr.dataset.pipeline, tr.dataset.state]),
          gpus: Array.from(document.querySelectorAll('#timeline g.gpu-row'))
                  .map(g => [g.dataset.gpu, g.dataset.pipeline, g.dataset.role, g.dataset.rank]),
          segments: document.querySelectorAll('#timeline rect.segment').length,
          roleSeq: Number(document.body.dataset.roleSeq || -1),
          status: document.getElementById('status').textContent,
        };""")


def _curves(driver) -> dict:
    """The charts the page draws: series name -> pipeline -> its polyline's (x, y) points."""
    return driver.execute_script("""
        const out = {};
        for (const svg of document.querySelectorAll('#curves svg.chart')) {
          const lines = {};
          for (const l of svg.querySelectorAll('polyline.curve-line'))
            lines[l.dataset.pipeline] = l.getAttribute('points').trim().split(/\\s+/)
                                         .map(p => p.split(',').map(Number));
          out[svg.dataset.series] = lines;
        }
        return out;""")


def _metric_rows(run_dir: Path, pipeline: str) -> list[dict]:
    path = run_dir / pipeline / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # one being written
    return out


def _check_points(points: list[list[float]], values: list[float]) -> None:
    """The plotted points are the values in step order: x grows, and y is lower exactly where
    the value is higher (the SVG's y axis points down)."""
    assert len(points) == len(values), (points, values)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    assert all(a < b for a, b in zip(xs, xs[1:])), xs
    for i in range(len(values)):
        for j in range(len(values)):
            if values[i] > values[j] + 1e-9:
                assert ys[i] < ys[j], (i, j, values, ys)


def test_dashboard_in_chromium_shows_both_pipelines_and_gpus_moving(tmp_path):
    webdriver, chromium, chromedriver = _browser()
    from selenium.webdriver.chrome.service import Service  # deferred: as in _browser

    path = _config(tmp_path)
    log = tmp_path / "rlix-run.out"
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "run", str(path)], stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    profile = tempfile.mkdtemp(prefix="rlix-chromium-")
    service = driver = None
    try:
        url = _wait_for("dashboard URL in rlix run's output",
                        lambda: (m := re.search(r"dashboard: (http://127\.0\.0\.1:\d+/)", log.read_text()))
                        and m.group(1), 120, proc, log)
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        service = Service(chromedriver)
        driver = webdriver.Chrome(service=service, options=options)
        driver.set_page_load_timeout(30)
        driver.get(url + "?window_s=60")
        assert driver.title == "rlix scheduler"

        # both pipelines in the table, once they have registered (after their setup)
        first = _wait_for("both pipelines on the page",
                          lambda: (s := _shown(driver)) and {p for p, _ in s["pipelines"]} >= set(PIPELINES)
                          and any(role != "idle" for _, _, role, _ in s["gpus"]) and s,
                          150, proc, log)
        assert len(first["gpus"]) == 2 and first["status"].startswith("live")

        # the page redraws by itself: what it shows of the GPUs changes as the scheduler moves them
        later = _wait_for("a GPU changing holder or role on the page",
                          lambda: (s := _shown(driver)) and s["gpus"] != first["gpus"] and s,
                          90, proc, log, every_s=0.2)
        assert later["roleSeq"] > first["roleSeq"]
        held = {p for _, p, role, _ in first["gpus"] + later["gpus"] if role != "idle"}
        assert held, (first, later)

        # a few more moves, then the screenshot (docs/dashboard.png is one of these)
        _wait_for("more GPU moves", lambda: _shown(driver)["roleSeq"] >= later["roleSeq"] + 6, 60, proc, log)
        both = _wait_for("both pipelines holding GPUs on the timeline",
                         lambda: {p for p in driver.execute_script(
                             "return Array.from(document.querySelectorAll('#timeline rect.segment'))"
                             ".map(r => r.dataset.pipeline)")} >= set(PIPELINES), 60, proc, log)
        assert both
        # up to 40 s more for a fuller picture (not a condition of the test)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and proc.poll() is None and driver.execute_script(
                "return Math.min(...Array.from(document.querySelectorAll('#timeline rect.segment'))"
                ".map(r => Number(r.getAttribute('x'))))") > 400:
            time.sleep(1)
        # the page's own box (its content, not the rest of the window)
        driver.find_element("tag name", "html").screenshot(str(tmp_path / "dashboard.png"))
        print(f"screenshot: {tmp_path / 'dashboard.png'}")

        # the reward curves: each pipeline's line grows as its steps end, a point per row
        run_dir = tmp_path / "run"
        grown = _wait_for("reward curves of both pipelines with 4 points or more",
                          lambda: (c := _curves(driver)) and all(len(c.get("reward", {}).get(p, [])) >= 4
                                                                 for p in PIPELINES) and c,
                          180, proc, log)
        for pipeline in PIPELINES:
            plotted = grown["reward"][pipeline]
            rows = _metric_rows(run_dir, pipeline)  # read after the page: it may hold more rows
            _check_points(plotted, [r["reward"] for r in rows[:len(plotted)]])
        # a chart per eval metric exactly when the rows have one (this run evaluates nothing
        # unless its config asks)
        evals = {k for p in PIPELINES for r in _metric_rows(run_dir, p) for k in r if k.startswith("eval/")}
        assert set(grown) - {"reward"} <= evals
        later_curves = _wait_for("a reward curve growing on the page",
                                 lambda: (c := _curves(driver)) and any(
                                     len(c["reward"].get(p, [])) > len(grown["reward"][p]) for p in PIPELINES) and c,
                                 120, proc, log)
        assert later_curves
        status = driver.execute_script("return document.getElementById('status').textContent")
        assert status.startswith("live"), status
        assert driver.execute_script("return document.getElementById('jobs-section').hidden")  # no cluster
        driver.find_element("tag name", "html").screenshot(str(tmp_path / "dashboard_curves.png"))
        print(f"screenshot: {tmp_path / 'dashboard_curves.png'}")
    finally:
        if driver is not None:
            driver.quit()
        if service is not None and service.process is not None and service.process.poll() is None:
            os.kill(service.process.pid, signal.SIGKILL)  # chromedriver, if quit did not end it
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C: the run stops its pipelines and Ray
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        out.close()
        shutil.rmtree(profile, ignore_errors=True)
