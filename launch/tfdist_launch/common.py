"""What every part of the launcher shares: its name, its poll interval, its usage error."""

PROG = "tfdist-launch"
POLL_S = 0.1          # how often worker exits are checked; no busy loop


class UsageError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""
