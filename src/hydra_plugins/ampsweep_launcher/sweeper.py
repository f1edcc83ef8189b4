"""ampsweep's sweeper for Hydra (``hydra/sweeper=ampsweep``, the default of conf/config.yaml).

Hydra's basic sweeper (same options: ``hydra.sweeper.params``, ``max_batch_size``), without
its check of each batch. That check composes every job's config once more before the launcher
composes it again to run it; ampsweep's command has already composed and checked every job of
the command, with the typed schema and each component against its builder, before Hydra
starts (``ampsweep.app.train.validate``), so it would be a third composition of each job:
about 80 ms a job on a 2-core CPU, a sixth of a short job's cost beyond its training
(``scripts/bench_fixed_cost.py``). ``hydra/sweeper=basic`` restores Hydra's own.
"""

from __future__ import annotations

from collections.abc import Sequence

# The basic sweeper is a core plugin of Hydra; its module is the only place it is defined.
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


class AmpsweepSweeper(BasicSweeper):
    """Hydra's BasicSweeper for commands that ampsweep has checked before Hydra starts."""

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Checked already: ampsweep composed every job of the command up front."""
