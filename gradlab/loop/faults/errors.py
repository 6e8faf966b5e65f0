"""The error a bad option raises (its own module so that the checks config.py calls can raise it
too)."""


class ConfigError(ValueError):
    """A bad option: the message names it and its valid values."""
