"""`tfdist-train`: parse flags, build, train, print the run summary.

User errors (bad flags, bad config, data that cannot be prepared, ...) are
reported as one line on stderr with exit status 2 and no traceback.
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import sys

# Quiet TensorFlow's C++ start-up chatter unless the user asked for it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import app, flags, logging  # noqa: E402

from tfdist import flags as tfdist_flags  # noqa: E402  (defines the flags)
from tfdist import models, strategies  # noqa: E402  (registries; no TensorFlow yet)
from tfdist.errors import UsageError, WorkerFault  # noqa: E402

USAGE_ERROR = 2
PROG = "tfdist-train"


def usage_exit(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parse, but a bad flag exits 2 with one line (absl exits 1)."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as error:
        usage_exit(str(error).replace("\n", " "))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        usage_exit(f"unexpected arguments {' '.join(argv[1:])!r}; flags must start with --")
    logging.set_verbosity(logging.INFO)
    # TensorFlow's own Python INFO lines (one per traced collective) drown the progress.
    std_logging.getLogger("tensorflow").setLevel(std_logging.WARNING)
    try:
        config = tfdist_flags.run_config()
        strategies.check_name(config.strategy.name)
        models.check_name(config.model.name)
        from tfdist import api  # TensorFlow loads here, after the flags are known good
        if tfdist_flags.print_layouts():
            print(api.describe_layouts(config), flush=True)
            return
        result = api.train(config)
    except UsageError as error:
        usage_exit(str(error))
    except WorkerFault as fault:
        # Exit at once: with a dead peer, TensorFlow's teardown can block.
        sys.stderr.write(f"{PROG}: fault: {fault}\n")
        sys.stderr.flush()
        os._exit(1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the last complete checkpoint (if any) is intact",
              file=sys.stderr)
        sys.exit(130)
    if result.is_chief:
        print(json.dumps(result.summary, sort_keys=True), flush=True)


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
