"""The ``ampsweep`` commands: each one reads its command line, and says what happened."""
