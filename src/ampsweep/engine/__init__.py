"""The engine: registries of models, data sets and optimizers; building a run from its config;
the training loop; checkpoints; DistributedDataParallel. Knows nothing of tracking or reports."""
