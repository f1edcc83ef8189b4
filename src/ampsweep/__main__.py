"""``python -m ampsweep`` is the ``ampsweep`` command."""

from ampsweep.app.cli import run

if __name__ == "__main__":
    run()
