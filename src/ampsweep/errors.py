"""The error every layer raises for a problem the user can fix."""


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key, the value and the fix."""


class FaultError(RuntimeError):
    """A fault of the machine or the store a user can fix (a full disk, a store that cannot be
    written): the message is the whole line, naming what failed and the fix; not a config
    error (the command exits 1, not 2)."""
