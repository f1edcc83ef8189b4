"""MLflow: the store (tag names, statuses, queries), one run's recorder, sweeps as parent and
child runs, and masking secrets. Imports no torch."""
