"""MLflow's UI, in a real browser, shows a run's MLflow-native results: its logged model, its
two data sets with their digests, and charts of the machine's load (System metrics tab)."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, free_port, require_tool, run_in_process

from ampsweep.tracking import store as mlflow_store

# One worker runs the whole module, so that its module-scoped fixture is built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_e2e_ui_mlflow_native")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One run (sampled every 0.02 s, so its charts have several points even where its 240
    steps take a fraction of a second) and `ampsweep ui` over it."""
    found = shutil.which("chromium")
    require_tool("chromium", None if found else "needs Debian's chromium: apt-get install chromium")
    folder = tmp_path_factory.mktemp("ui_native")
    store = f"sqlite:///{folder / 'mlflow.db'}"
    args = ["train", f"tracking.uri={store}", "trainer.epochs=20", "trainer.max_steps=240",
            "trainer.progress=false", "model.width=8",
            "tracking.system_metrics_interval=0.02"]  # fmt: skip
    res = run_in_process(args, folder)
    assert res.code == 0, res.err
    client = mlflow_store.client_for(store)
    exp = client.get_experiment_by_name("ampsweep")
    [run] = client.search_runs([exp.experiment_id])
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "MLFLOW_TRACKING_URI": store}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampsweep", "ui", "--port", str(port)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    up, deadline = False, time.monotonic() + 180
    while not up and time.monotonic() < deadline and proc.poll() is None:
        try:
            up = lines.get(timeout=1).startswith("MLflow UI: ")
        except queue.Empty:
            continue
    try:
        assert up, "ampsweep ui printed no link"
        base = f"http://127.0.0.1:{port}/#/experiments/{exp.experiment_id}"
        yield {"client": client, "run": run, "base": base}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def _page_text(url: str, tmp_path, wanted: str, tries: int = 3) -> tuple[str, str]:
    """The rendered DOM of ``url`` (and its text), rendered again (up to ``tries`` times)
    until ``wanted`` shows: the UI is a React app that fetches and draws after loading."""
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1400,900",
             "--virtual-time-budget=20000",
             # Lay out and paint before the DOM is dumped: without it the chart grid, which
             # sizes its cards from a measured width, is now and then still empty.
             "--run-all-compositor-stages-before-draw"]  # fmt: skip
    html = text = ""
    for _ in range(tries):
        html = subprocess.run(["chromium", *flags, "--dump-dom", url], capture_output=True,
                              text=True, timeout=240).stdout  # fmt: skip
        text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))
        if wanted in text or wanted in html:
            break
    return html, text


def _digests(run) -> dict[str, str]:
    return {d.dataset.name: d.dataset.digest for d in run.inputs.dataset_inputs}


def test_the_runs_page_lists_its_logged_model_and_data_sets(served, tmp_path):
    run = served["run"]
    digests = _digests(run)
    page = f"{served['base']}/runs/{run.info.run_id}?workflowType=machine_learning"
    _, text = _page_text(page, tmp_path, "Logged models (1)")
    assert "Logged models (1)" in text
    # the model's row: its name, status and the data set its metrics were measured on
    row = text[text.index("Logged models (1)") :]
    assert re.search(rf"\b{mlflow_store.MODEL_NAME} Ready\b", row)
    assert f"digits-train (#{digests['digits-train']})" in row
    # the Datasets of the run: the first shown, the other one behind "+1"
    assert f"Datasets digits-train ({digests['digits-train']}) training +1" in text
    # the experiment's runs table shows both, with their digests and contexts
    table, text = _page_text(f"{served['base']}?workflowType=machine_learning", tmp_path,
                             "digits-val")  # fmt: skip
    assert f"digits-train ({digests['digits-train']}) training" in text
    assert f"digits-val ({digests['digits-val']}) validation" in text


def test_the_models_page_links_its_metrics_to_the_validation_set(served, tmp_path):
    run = served["run"]
    [output] = run.outputs.model_outputs
    digest = _digests(run)["digits-val"]
    _, text = _page_text(f"{served['base']}/models/{output.model_id}", tmp_path, "val/acc")
    acc = run.data.metrics["val/acc"]
    assert re.search(rf"val/acc digits-val \(#{digest}\) {run.info.run_name} {acc}", text)


def test_the_system_metrics_tab_has_charts(served, tmp_path):
    run = served["run"]
    url = f"{served['base']}/runs/{run.info.run_id}/system-metrics?workflowType=machine_learning"
    html, text = _page_text(url, tmp_path, "js-plotly-plot")
    assert re.search(r"System metrics \(\d+\)", text)
    charts = html.count('data-testid="experiment-view-compare-runs-card"')
    plots = html.count("js-plotly-plot")
    assert charts >= 4 and plots >= 4  # CPU, memory, disk, network: one chart each at least
    assert "cpu_utilization_percentage" in text
    history = served["client"].get_metric_history(
        run.info.run_id, "system/cpu_utilization_percentage"
    )
    assert len(history) >= 2  # a line, not a dot
