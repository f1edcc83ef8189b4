"""The application: the ``ampsweep`` command, one job, launching a sweep, reproduce, the UI and
the console."""
