"""``ampsweep ui``: MLflow's UI over the store and artifacts that ``ampsweep train`` writes.

It runs ``mlflow server`` in a child process (its own process group, so stopping ``ampsweep
ui`` stops all of the server's workers too), waits until it answers, and prints a link that
opens the experiment in MLflow's classic runs table (``workflowType=machine_learning``; the
default GenAI view hides the runs).

``--team`` starts it with MLflow's own logins (``mlflow server --app-name basic-auth``): every
request needs a user and password (clients pass ``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD``), every user may read every experiment, and only an experiment's
creator, the users it grants EDIT or MANAGE, and the admin may write to it. The users and
their permissions live in ``mlflow-auth.db`` beside the store, configured by
``mlflow-auth.ini`` there; the admin's password comes from ``MLFLOW_AUTH_ADMIN_PASSWORD`` the
first time, and the key that signs the UI's forms (CSRF) is kept in ``mlflow-auth.key``.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ampsweep import console
from ampsweep.tracking import store

STARTUP_TIMEOUT_S = 120  # mlflow server imports a lot; on a loaded machine it is slow
# MLflow 3's server also starts a job runner for its GenAI features (LLM judges, prompt
# optimisation): eight more Python processes, each with its own imports at every start and
# memory for the server's life, which training runs never use. Off unless the user's
# environment turns it on.
JOB_EXECUTION = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"
# MLflow's basic-auth app: its config file, its first admin's password, the key for its forms.
AUTH_CONFIG = "MLFLOW_AUTH_CONFIG_PATH"
ADMIN_PASSWORD = "MLFLOW_AUTH_ADMIN_PASSWORD"
FORM_KEY = "MLFLOW_FLASK_SERVER_SECRET_KEY"
# READ for every user with a login; writing needs EDIT on the experiment (its creator has
# MANAGE). Without a login nothing is served.
AUTH_INI = """\
[mlflow]
default_permission = READ
database_uri = {database}
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
"""


class UIError(Exception):
    """One line with the fix."""


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR as servers set it: a
    port left in TIME_WAIT by a UI stopped a moment ago is free to listen on again."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def experiment_link(uri: str, base_url: str) -> tuple[str, str]:
    """(what to open, a description): the newest sweep's experiment, else 'ampsweep'."""
    from ampsweep.report.sweeps import ReportError, find_sweep

    client = store.client_for(uri)
    try:
        parent, _ = find_sweep(client)
        exp_id = parent.info.experiment_id
        exp = client.get_experiment(exp_id)
        about = (
            f"experiment '{exp.name}' (id {exp_id}); newest sweep {parent.info.run_name}: "
            f"{base_url}/#/experiments/{exp_id}/runs/{parent.info.run_id}"
            "?workflowType=machine_learning"
        )
    except ReportError:
        exps = client.search_experiments()
        named = [e for e in exps if e.name == "ampsweep"] or exps
        if not named:
            return f"{base_url}/", "no experiments yet"
        exp_id = named[0].experiment_id
        about = f"experiment '{named[0].name}' (id {exp_id})"
    return f"{base_url}/#/experiments/{exp_id}?workflowType=machine_learning", about


def server_command(
    uri: str,
    host: str,
    port: int,
    allowed_hosts: str | None = None,
    cors: str | None = None,
    team: bool = False,
) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri]
    if team:
        cmd += ["--app-name", "basic-auth"]
    cmd += ["--host", host, "--port", str(port), "--workers", "1"]
    # MLflow answers 403 to a Host header it does not know (DNS-rebinding protection): other
    # machines reach it by a name or address that must be listed. A list replaces MLflow's
    # default (localhost and private addresses), so this machine's own names are kept in it.
    if allowed_hosts:
        local = f"localhost:{port},127.0.0.1:{port},[::1]:{port},localhost,127.0.0.1"
        cmd += ["--allowed-hosts", f"{allowed_hosts},{local}"]
    if cors:
        cmd += ["--cors-allowed-origins", cors]
    db = store.sqlite_path(uri)
    if db is not None:
        # Runs keep their own artifact locations (outputs/mlartifacts/...); experiments created
        # from the UI get theirs beside the store as well, not in ./mlartifacts of some cwd.
        cmd += ["--artifacts-destination", (db.parent / "mlartifacts").resolve().as_uri()]
    return cmd


def server_env(
    environ: dict[str, str] | None = None, auth: dict[str, str] | None = None
) -> dict[str, str]:
    """The server's environment: ours, with MLflow's job runner off unless set there, and
    the basic-auth app's settings for a team server."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault(JOB_EXECUTION, "false")
    return {**env, **(auth or {})}


def team_auth(db: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The basic-auth app's settings for the store ``db``: its config file (written beside the
    store unless $MLFLOW_AUTH_CONFIG_PATH names one), and the key for its forms (kept beside
    the store, so that a restart keeps logged-in browsers valid). Refuses, in one line, a
    first start without an admin password."""
    env = os.environ if environ is None else environ
    folder = db.parent
    config = Path(env.get(AUTH_CONFIG) or folder / "mlflow-auth.ini")
    users = folder / "mlflow-auth.db"
    if not env.get(AUTH_CONFIG):
        config.write_text(AUTH_INI.format(database=f"sqlite:///{users.resolve()}"))
    if not users.exists() and not env.get(ADMIN_PASSWORD) and not env.get(AUTH_CONFIG):
        raise UIError(
            f"--team: the first start creates the user 'admin' in {users}: set its password "
            f"in {ADMIN_PASSWORD} (12 characters or more), e.g. {ADMIN_PASSWORD}=$(openssl "
            "rand -base64 18)"
        )
    out = {AUTH_CONFIG: str(config)}
    if not env.get(FORM_KEY):
        key = folder / "mlflow-auth.key"
        if not key.exists():
            key.touch(mode=0o600)
            key.write_text(secrets.token_hex(32))
        out[FORM_KEY] = key.read_text().strip()
    return out


def wait_until_up(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            last = f": {tail[0].strip()}" if tail else ""
            raise UIError(f"mlflow server exited with code {proc.returncode}{last} (log: {log})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise UIError(f"mlflow server did not answer at {url} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def hide_empty_default(client) -> bool:
    """Delete MLflow's "Default" experiment (id 0) when it holds no run: every store has one,
    with an artifact location in ./mlruns of whichever folder made the store, which no
    ampsweep run uses; the UI then lists ampsweep's experiments only. A deleted experiment
    stays restorable (``mlflow experiments restore``). True when it was hidden."""
    from mlflow.entities import ViewType

    default = client.get_experiment("0")
    if default is None or default.lifecycle_stage != "active":
        return False
    if client.search_runs(["0"], run_view_type=ViewType.ALL, max_results=1):
        return False  # someone logged to it: theirs to keep
    client.delete_experiment("0")
    return True


def serve(
    uri: str,
    host: str,
    port: int,
    allowed_hosts: str | None = None,
    cors: str | None = None,
    team: bool = False,
) -> int:
    if store.is_server(uri):
        store.check(uri, key="--tracking-uri")
        link, about = experiment_link(uri, uri.rstrip("/"))
        print(f"The store is an MLflow server already; open {link}\n  {about}")
        return 0
    db = store.sqlite_path(uri)
    if db is None:
        raise UIError(f"--tracking-uri {uri}: ampsweep ui serves sqlite:/// or http(s):// stores")
    if not db.is_file():
        raise UIError(
            f"--tracking-uri {uri}: no MLflow store at {db}: run `ampsweep train` first, or "
            "pass the store with --tracking-uri sqlite:////abs/path/mlflow.db"
        )
    if not port_free(host, port):
        raise UIError(f"--port {port}: {host}:{port} is already in use: pass another --port")
    hide_empty_default(store.client_for(uri))
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base_url = f"http://{shown}:{port}" if ":" not in shown else f"http://[{shown}]:{port}"
    link, about = experiment_link(uri, base_url)
    auth = team_auth(db) if team else None
    # The server's own access log and warnings go to a file beside the store, not over ours.
    log = db.parent / "mlflow-ui.log"
    console.console.print(f"Starting the MLflow UI on {host}:{port} for {store.describe(uri)} ...")
    with open(log, "w") as out:
        command = server_command(uri, host, port, allowed_hosts, cors, team)
        proc = subprocess.Popen(
            command, stdout=out, stderr=out, start_new_session=True, env=server_env(auth=auth)
        )
    # `kill PID` (SIGTERM) must stop the server too, not leave it orphaned.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        wait_until_up(base_url, proc, STARTUP_TIMEOUT_S, log)
        # Plain print: a link must never be wrapped at the terminal width.
        print(f"MLflow UI: {link}", flush=True)
        if host in ("0.0.0.0", "::"):
            how = (
                f"other machines reach it as {allowed_hosts}"
                if allowed_hosts
                else "other machines need --allowed-hosts NAME:PORT,... (MLflow refuses "
                "Host headers it does not know)"
            )
            print(f"  listening on every interface; {how}", flush=True)
        if team:
            print(
                "  logins required (MLflow basic-auth): users and permissions in "
                f"{db.parent / 'mlflow-auth.db'}; clients set MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD",
                flush=True,
            )
        print(f"  {about}\n  server log: {log}\n  Ctrl-C stops it.", flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        _stop(proc)
