"""ampsweep's Hydra plugins (Hydra finds plugins only under hydra_plugins)."""
