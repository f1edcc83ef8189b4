"""Configuration: the schema of every key, composing it with Hydra, and one-line errors.

Imports no torch: a bad override is refused at once.
"""
