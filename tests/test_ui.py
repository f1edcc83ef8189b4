"""`ampsweep ui`: MLflow's UI over a sweep's store, checked over HTTP and in a real browser."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from conftest import REPO, run_cli

from ampsweep.tracking import store as mlflow_store

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A two-mode sweep in a temporary store, and `ampsweep ui` serving it."""
    folder = tmp_path_factory.mktemp("ui")
    store = f"sqlite:///{folder / 'mlflow.db'}"
    quick = ["trainer.epochs=1", "trainer.max_steps=4", "trainer.log_every=2"]
    quick += ["trainer.timing_warmup_steps=1", "trainer.progress=false", "model.width=8"]
    res = run_cli(["train", "-m", "precision=fp32,bf16", f"tracking.uri={store}", *quick], folder)
    assert res.returncode == 0, res.stderr
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MLFLOW_TRACKING_URI": store}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampsweep", "ui", "--port", str(port)],  # store from the env
        cwd=folder,
        env=env,
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
        yield {"store": store, "port": port, "link": link, "proc": proc}
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


def test_rest_search_returns_the_sweeps_runs(served):
    client = mlflow_store.client_for(served["store"])
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
    assert {"fp32-cnn-digits", "bf16-cnn-digits"} <= names
    parents = [
        x for x in runs if x["info"]["run_name"] not in ("fp32-cnn-digits", "bf16-cnn-digits")
    ]
    assert len(parents) == 1
    pid = parents[0]["info"]["run_id"]
    for x in runs:
        if x["info"]["run_id"] != pid:
            tags = {t["key"]: t["value"] for t in x["data"]["tags"]}
            assert tags[mlflow_store.PARENT] == pid


def _chromium(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
    flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
    flags += [f"--user-data-dir={profile}", "--window-size=1400,900"]
    flags += ["--virtual-time-budget=15000"]
    return subprocess.run(["chromium", *flags, *args], capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
def test_browser_renders_the_sweep_with_its_child_runs(served, tmp_path):
    client = mlflow_store.client_for(served["store"])
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
    shots = REPO / "outputs"
    shots.mkdir(exist_ok=True)
    for name, url in [("ui-experiment.png", served["link"]), ("ui-sweep-run.png", page)]:
        _chromium([f"--screenshot={shots / name}", url], tmp_path)
        assert (shots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
