"""``ampsweep ui`` in a real process: MLflow's UI over a sweep's store, checked over HTTP and in
a real browser (Debian's chromium; required in CI)."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from conftest import cli_env, free_port, require_tool

from ampsweep.tracking import store

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("three_mode_sweep")]


@pytest.fixture(scope="module")
def served(three_mode_sweep):
    """`ampsweep ui` serving the shared three-mode sweep's store (read only)."""
    folder, uri = three_mode_sweep.folder, three_mode_sweep.uri
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampsweep", "ui", "--port", str(port)],  # store from the env
        cwd=folder,
        env=cli_env({"MLFLOW_TRACKING_URI": uri}),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    link = None
    deadline = time.monotonic() + 180
    while link is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line.startswith("MLflow UI: "):
            link = line.split(": ", 1)[1].strip()
    try:
        assert link, "ampsweep ui printed no link"
        yield {"store": uri, "port": port, "link": link, "proc": proc}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_ui_binds_localhost_and_links_the_classic_runs_view(served):
    link = served["link"]
    assert link.startswith(f"http://127.0.0.1:{served['port']}/#/experiments/")
    assert link.endswith("?workflowType=machine_learning")
    with urllib.request.urlopen(f"http://127.0.0.1:{served['port']}/", timeout=30) as r:
        assert r.status == 200
        assert "<html" in r.read().decode().lower()
    # the server alone: MLflow's GenAI job runner and its worker processes are not started
    import psutil

    tree = psutil.Process(served["proc"].pid).children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in tree]
    assert any("mlflow" in c and "server" in c for c in commands), commands
    assert not any("mlflow.server.jobs" in c or "huey" in c for c in commands), commands


def test_rest_search_returns_the_sweeps_runs(served):
    client = store.client_for(served["store"])
    exp_id = client.get_experiment_by_name("ampsweep").experiment_id
    body = json.dumps({"experiment_ids": [exp_id], "max_results": 100}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{served['port']}/api/2.0/mlflow/runs/search",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        runs = json.load(r)["runs"]
    names = {x["info"]["run_name"] for x in runs}
    assert {"fp32-cnn-digits", "fp16-cnn-digits", "bf16-cnn-digits"} <= names
    tags = {x["info"]["run_id"]: {t["key"]: t["value"] for t in x["data"]["tags"]} for x in runs}
    parents = [run_id for run_id, t in tags.items() if t.get(store.SWEEP) == "true"]
    assert len(parents) == 1 and len(runs) == 4
    for run_id, t in tags.items():
        if run_id != parents[0]:
            assert t[store.PARENT] == parents[0]


def _chromium(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    flags += [f"--user-data-dir={profile}", "--window-size=1400,900"]
    flags += ["--virtual-time-budget=15000"]
    return subprocess.run(["chromium", *flags, *args], capture_output=True, text=True, timeout=180)


def test_browser_renders_the_sweep_with_its_child_runs(served, tmp_path):
    found = shutil.which("chromium")
    require_tool(
        "chromium", None if found else "needs Debian's chromium (apt-get install chromium)"
    )
    client = store.client_for(served["store"])
    exp = client.get_experiment_by_name("ampsweep")
    parent = client.search_runs(
        [exp.experiment_id], filter_string="tags.`ampsweep.sweep` = 'true'"
    )[0]
    base = f"http://127.0.0.1:{served['port']}/#/experiments/{exp.experiment_id}"
    # The runs table shows the parent with its children collapsed; the parent's own page
    # lists the child runs by name (and its headline metrics).
    page = f"{base}/runs/{parent.info.run_id}?workflowType=machine_learning"
    dom = _chromium(["--dump-dom", page], tmp_path).stdout
    assert parent.info.run_name in dom
    assert "fp32-cnn-digits" in dom and "bf16-cnn-digits" in dom
    assert "speedup/bf16" in dom
    table = _chromium(["--dump-dom", served["link"]], tmp_path).stdout
    assert parent.info.run_name in table  # the experiment's runs table shows the sweep
    for name, url in [("ui-experiment.png", served["link"]), ("ui-sweep-run.png", page)]:
        shot = tmp_path / name  # a new folder: an old picture cannot pass for this one
        assert not shot.exists()
        _chromium([f"--screenshot={shot}", url], tmp_path)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert shot.stat().st_size > 10_000  # a rendered page, not an empty frame
