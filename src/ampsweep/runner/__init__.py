"""One job's life: planned, its run opened, trained (``engine.loop.fit``), recorded and ended."""
