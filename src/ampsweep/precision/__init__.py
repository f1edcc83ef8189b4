"""Precision modes: the table of what each mode means (``modes``, no torch) and the policy
that applies a mode to a run (``policy``: autocast, GradScaler, dtypes, TF32 flags)."""
