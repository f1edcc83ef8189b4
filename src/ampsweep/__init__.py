"""ampsweep: what mixed precision buys on your model, data and hardware, tracked in MLflow.

From Python (a notebook, a script), exactly as ``ampsweep train`` records::

    import ampsweep
    run = ampsweep.train(["precision=bf16", "trainer.epochs=3"])
    run.run_id, run.summary["val/acc"]
    result = ampsweep.sweep(["experiment=precision_sweep"])
    result.parent_run_id, result.rows

Importing ampsweep is light: torch, Hydra and MLflow load when a run starts.
"""

from importlib.metadata import PackageNotFoundError, version

from ampsweep.errors import ConfigError

try:
    __version__ = version("ampsweep")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

__all__ = ["ConfigError", "__version__", "sweep", "train"]


def train(overrides=(), config_dir=None):
    """Train one configuration: ``overrides`` as on the command line, ``config_dir`` your own
    config folder (as ``--config-dir``). Returns the run's id, name and final numbers; raises
    ConfigError for a refused command, ampsweep.app.api.TrainError for a failed run."""
    from ampsweep.app.api import train as run

    return run(overrides, config_dir)


def sweep(overrides=(), config_dir=None, baseline="fp32"):
    """Run a sweep (as ``ampsweep train -m``): returns the parent run id, the report's rows
    (each mode against ``baseline``) and findings."""
    from ampsweep.app.api import sweep as run

    return run(overrides, config_dir, baseline)
