"""ampsweep: what mixed precision buys on your model, data and hardware, tracked in MLflow."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ampsweep")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"
