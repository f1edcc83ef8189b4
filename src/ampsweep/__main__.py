"""``python -m ampsweep`` is the ``ampsweep`` command."""

from ampsweep.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
