"""What a run measures: step time, activation and peak memory, FLOPs and MFU, gradient
underflow, divergence, where a non-finite value first appears, and the numerics probe."""
