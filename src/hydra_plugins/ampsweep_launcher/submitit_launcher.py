"""ampsweep's launchers, where Hydra looks for them: ``hydra/launcher=ampsweep_local`` and
``ampsweep_slurm`` (conf/hydra/launcher/*.yaml name these classes as their ``_target_``).

The launchers are ``ampsweep.launch.hydra_launchers``'; this module only names them. Hydra
accepts a launcher only from the ``hydra_plugins`` namespace and knows each class by the
module that defines it, so each name here is a subclass with nothing of its own. Hydra imports
every module here at start-up: without the cluster extra (hydra-submitit-launcher) this one
names nothing, and imports cleanly.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
    from ampsweep.launch import hydra_launchers as _launchers

    class LocalLauncher(_launchers.LocalLauncher):
        __doc__ = _launchers.LocalLauncher.__doc__

    class SlurmLauncher(_launchers.SlurmLauncher):
        __doc__ = _launchers.SlurmLauncher.__doc__
