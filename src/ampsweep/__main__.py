"""``python -m ampsweep`` is the ``ampsweep`` command."""

from ampsweep.cli.main import run

if __name__ == "__main__":
    run()
