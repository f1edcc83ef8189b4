"""ampsweep's Hydra config tree, shipped inside the package as ampsweep.conf."""
