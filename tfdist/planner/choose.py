"""The `--strategy=auto` process: `python -m tfdist.planner.choose REQUEST OUT`.

REQUEST (JSON) holds the run's tfdist-train flags, the planner's keywords
and where the user's functions are (`functions.reference`); OUT receives
the plan followed (`auto.Choice`'s fields) or {"error": one line}. It runs
TensorFlow (the key's model build, the planner) so that the process that
trains starts none before its engine.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def main(argv: list[str]) -> int:
    request_path, out = argv[1], argv[2]
    with open(request_path) as f:
        request = json.load(f)
    from absl import logging
    from tfdist import flags as tfdist_flags   # defines tfdist's flags
    from tfdist import startup
    from tfdist.errors import UsageError
    from tfdist.planner import functions
    auto = startup.load("planner.auto")   # TensorFlow and Keras, frozen (tfdist/startup.py)
    try:
        config = tfdist_flags.run_config_of(request["flags"])   # resets absl's verbosity
        logging.set_verbosity(logging.INFO)   # the planner's progress, as tfdist-train's
        choice = auto.choose_here(
            config, **functions.resolved(request["functions"]), options=request["options"],
            log=lambda line: logging.info("--strategy=auto: %s", line),
            progress=request.get("progress"))
        answer, status = dataclasses.asdict(choice), 0
    except UsageError as error:
        answer, status = {"error": str(error)}, 2
    with open(out, "w") as f:
        json.dump(answer, f)
    return status


if __name__ == "__main__":
    from absl import app
    app.run(lambda argv: sys.exit(main(argv)))
