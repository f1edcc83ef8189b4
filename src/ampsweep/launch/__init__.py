"""Handing a command's jobs to Hydra and its launchers (this process, or SLURM), and a
sweep's parent run around them."""
