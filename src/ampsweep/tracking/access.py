"""Whether this user may record into an experiment of an MLflow server with logins.

A server started with MLflow's basic-auth (``ampsweep ui --team``, ``mlflow server --app-name
basic-auth``) answers 401 to a request without a valid login and 403 to one its user may not
make. MLflow's client sends the login it finds in ``MLFLOW_TRACKING_USERNAME`` and
``MLFLOW_TRACKING_PASSWORD`` (the password is masked like every secret). ``check_write`` asks
once, before anything trains, with the calls a run will make (read the experiment, write to
it), so a refusal is one line with the fix, not a job that fails after its first step.
"""

from __future__ import annotations

import os
import re

from ampsweep.config.schema import ConfigError
from ampsweep.tracking import store

USER, PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
PROBE_TAG = "ampsweep.writable"  # set on the experiment: the write a run needs, made once


def _status(err: Exception) -> int | None:
    """The HTTP status of a refused MLflow request (MLflow puts it in the message)."""
    m = re.search(r"error code (\d{3})", str(err))
    return int(m.group(1)) if m else None


def check_write(uri: str, experiment: str, key: str = "tracking.uri") -> None:
    """Raise a one-line ConfigError when the server at ``uri`` refuses this login, or refuses
    it the experiment (reading it, or writing to it when it exists)."""
    if not store.is_server(uri):
        return
    client = store.client_for(uri)
    user = os.environ.get(USER)
    who = f"user {user}" if user else "no login"
    try:
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            client.set_experiment_tag(exp.experiment_id, PROBE_TAG, "true")
    except Exception as err:
        status = _status(err)
        if status == 401:
            fix = (
                f"check {USER} and {PASSWORD}"
                if user
                else f"set {USER} and {PASSWORD} to your account on it"
            )
            raise ConfigError(
                f"{key}={uri}: the MLflow server needs a login and refused {who}: {fix} (its "
                "admin creates accounts)"
            ) from None
        if status == 403:
            what = "write to" if exp is not None else "read"
            raise ConfigError(
                f"tracking.experiment={experiment}: {who} may not {what} this experiment on "
                f"{uri}: ask its owner or the server's admin for EDIT on it, or record into "
                "an experiment of your own (tracking.experiment=NAME)"
            ) from None
        first = " ".join(str(err).split())[:200]
        raise ConfigError(
            f"{key}={uri}: the MLflow server failed on experiment {experiment} ({first}): "
            "check the server's log"
        ) from None
