"""tfdist-train under Slurm, then every task saves what it trained.

Run by tests/integration/test_slurm_runs.py as the program of launch/slurm/tfdist.sbatch
(TFDIST_TRAIN="python tests/slurm_worker.py"): it takes tfdist-train's flags
and runs tfdist-train's own `main` (only the chief prints the run summary and
writes --model_dir), then each task writes, into $TFDIST_SLURM_TEST_OUT,
weights-<SLURM_PROCID>.npz (its final weights, so the test can compare the
tasks bit for bit) and task-<SLURM_PROCID>.json (its place in the cluster),
and waits for the other tasks before it exits.
"""

import json
import os
import time

import numpy as np

from tfdist import app


def main(argv):
    from tfdist import api

    results = []
    train = api.train

    def train_and_keep(*args, **kwargs):
        results.append(train(*args, **kwargs))
        return results[-1]

    api.train = train_and_keep
    app.main(argv)
    result, out, rank = results[-1], os.environ["TFDIST_SLURM_TEST_OUT"], os.environ["SLURM_PROCID"]
    np.savez(os.path.join(out, f"weights-{rank}.npz"), *result.model.get_weights())
    tf_config = json.loads(os.environ["TF_CONFIG"])   # written by tfdist from Slurm's variables
    with open(os.path.join(out, f"task-{rank}.json"), "w") as f:
        json.dump({"worker_index": tf_config["task"]["index"],
                   "num_workers": result.summary["workers"], "is_chief": result.is_chief,
                   "tf_config": tf_config}, f)
    _wait_for_every_task(out, rank)


def _wait_for_every_task(out, rank, timeout_s=120):
    """Exit only once every task is done: a DTensor cluster's tasks still
    gathering weights fail ("Failed to send RPC to coordination service") when
    task 0, which hosts the coordination service, has already exited."""
    open(os.path.join(out, f"done-{rank}"), "w").close()
    tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(out, f"done-{i}")) for i in range(tasks)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other tasks did not finish within {timeout_s}s")
        time.sleep(0.05)


if __name__ == "__main__":
    app.run(main)
