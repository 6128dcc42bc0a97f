"""The options only `horovod` reads (no TensorFlow)."""

from __future__ import annotations

from tfdist.config.options import engine_options, non_negative, option


@engine_options("horovod")
class HorovodOptions:
    elastic: bool = option(
        False, group="faults",
        help="horovod under an elastic horovodrun (--min-np/--max-np "
             "--host-discovery-script): keep the training state in Horovod's elastic state; "
             "when a rank dies the others roll back to the last commit and continue, and "
             "ranks that join start from it. Other strategies: an error.")
    elastic_commit_every: int = option(
        0, lower=0, check=non_negative, group="faults",
        help="--elastic: commit the training state (to host memory) every N steps, the most "
             "a rank's death loses; 0: at the end of every loop (every --steps_per_loop "
             "steps).")
