"""The error every layer raises for a problem the user can fix."""


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key, the value and the fix."""
