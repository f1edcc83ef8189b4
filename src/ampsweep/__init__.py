"""ampsweep: what mixed precision buys on your model, data and hardware, tracked in MLflow.

From Python (a notebook, a script), exactly as ``ampsweep train`` records:

```python
import ampsweep
run = ampsweep.train(["precision=bf16", "trainer.epochs=3"])
run.run_id, run.summary["val/acc"]
result = ampsweep.sweep(["experiment=precision_sweep"])
result.parent_run_id, result.recommendation, result.rows
```

The package's layers, each a subpackage: ``config`` (the schema, composing, one-line errors),
``precision`` (the mode table and the policy that applies a mode), ``measure`` (time, memory,
FLOPs, numerics), ``engine`` (building a run, the training loop), ``tracking`` (MLflow),
``report`` (the comparison of a sweep) and ``app`` (the ``ampsweep`` command and this API).

``train`` and ``sweep`` live in ``ampsweep.api`` and load on first use (PEP 562), so
``import ampsweep`` stays light: torch, Hydra and MLflow load when a run starts, and the
package's lower layers (which import ``ampsweep`` itself) never depend on the app layer.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version

from ampsweep.errors import ConfigError

try:
    __version__ = version("ampsweep")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

__all__ = ["ConfigError", "__version__", "sweep", "train"]
_API = ("train", "sweep")


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module("ampsweep.api"), name)
    raise AttributeError(f"module 'ampsweep' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
