"""Errors a user can cause, reported in one line with exit status 2."""


class UsageError(Exception):
    """Bad input found before training starts (flag, config, dataset, cluster).

    The message names the input and what would be valid; the CLI prints it as
    one line and exits with status 2, with no traceback.
    """


class ConfigError(UsageError, ValueError):
    """An invalid value in a `RunConfig` part."""
