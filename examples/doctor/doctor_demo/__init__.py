"""Models with a known numerics defect at a known place, for ``ampsweep doctor``."""
