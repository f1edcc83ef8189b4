"""ampsweep's sweeper and launcher (``hydra/sweeper=ampsweep``, ``hydra/launcher=ampsweep``),
where Hydra looks for plugins: they live in ``ampsweep.app.sweeper``."""

from ampsweep.app.sweeper import AmpsweepLauncher, AmpsweepSweeper  # noqa: F401
