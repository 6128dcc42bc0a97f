"""What every part of the launcher shares: its name, its poll interval, its usage error."""

PROG = "tfdist-launch"
POLL_S = 0.1          # how often worker exits are checked; no busy loop
USAGE_EXIT = 2        # bad input: the launcher's, and tfdist-train's before it trains


class UsageError(Exception):
    """A mistake in the command line; reported in one line, exit status 2."""
