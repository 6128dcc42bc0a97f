"""Errors a user can cause, reported in one line with exit status 2."""


class UsageError(Exception):
    """Bad input found before training starts (flag, config, dataset, cluster).

    The message names the input and what would be valid; the CLI prints it as
    one line and exits with status 2, with no traceback.
    """


class ConfigError(UsageError, ValueError):
    """An invalid value in a `RunConfig` part."""


class WorkerFault(Exception):
    """A fault during training (a worker died, a collective timed out).

    The message names the failing worker; the CLI prints it and exits with
    status 1 at once, since a cluster with a dead member cannot continue.
    """


class NonFiniteLoss(WorkerFault):
    """The loss became NaN or infinite (`--on_nonfinite=stop`, or too many rollbacks)."""


def first_line(error: BaseException) -> str:
    """The first meaningful line of `error`'s message (a TensorFlow `OpError`'s
    `message`, without traceback lines), at most 300 characters; the error's
    type name when it has no message. For one-line reports of upstream errors."""
    for line in str(getattr(error, "message", error)).strip().splitlines():
        line = line.strip()
        if line and not line.startswith(("File ", "Traceback")):
            return line[:300]
    return type(error).__name__
