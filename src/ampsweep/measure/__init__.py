"""What a run measures: step time, activation and peak memory, FLOPs and MFU, gradient
underflow, divergence."""
