"""ampsweep's sweeper and launcher (``hydra/sweeper=ampsweep``, ``hydra/launcher=ampsweep``),
where Hydra looks for plugins: they live in ``ampsweep.launch.sweeper``."""

from ampsweep.launch.sweeper import AmpsweepLauncher, AmpsweepSweeper  # noqa: F401
