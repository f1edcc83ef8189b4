"""ampsweep's sweeper for Hydra (``hydra/sweeper=ampsweep``, the default of conf/config.yaml).

Hydra's basic sweeper (same options: ``hydra.sweeper.params``, ``max_batch_size``), without
its check of each batch. That check composes every job's config once more before the launcher
composes it again to run it; ampsweep's command has already composed and checked every job of
the command, with the typed schema and each component against its builder, before Hydra
starts (``ampsweep.app.train.validate``), so it would be a third composition of each job:
about 80 ms a job on a 2-core CPU, a sixth of a short job's cost beyond its training
(``scripts/bench_fixed_cost.py``). ``hydra/sweeper=basic`` restores Hydra's own.

Its jobs run seed-major: every mode of seed 0, then every mode of seed 1 (``sweep.repeats``
or an explicit ``trainer.seed`` sweep), as ``ampsweep.config.compose.expand_sweep`` lists
them. Hydra's basic sweeper would vary the last override fastest, running all seeds of fp32
before bf16 starts, so that a change in the machine's load over time falls on one mode.
"""

from __future__ import annotations

from collections.abc import Sequence

# The basic sweeper is a core plugin of Hydra; its module is the only place it is defined.
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.types import Override

from ampsweep.config.compose import seed_major


class AmpsweepSweeper(BasicSweeper):
    """Hydra's BasicSweeper for commands that ampsweep has checked before Hydra starts."""

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        """Checked already: ampsweep composed every job of the command up front."""

    @staticmethod
    def split_arguments(overrides: list[Override], max_batch_size: int | None):
        """The basic sweeper's jobs with the seed's sweep as the slowest axis; each job's
        overrides stay in the order given (what its run records as its overrides)."""
        keys = [o.get_key_element() for o in overrides]
        order = seed_major(keys)
        batches = BasicSweeper.split_arguments([overrides[i] for i in order], max_batch_size)
        place = {key: keys.index(key) for key in keys}
        return [
            [sorted(job, key=lambda o: place[o.split("=", 1)[0]]) for job in batch]
            for batch in batches
        ]
