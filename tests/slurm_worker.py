"""tfdist-train under Slurm, then every task saves what it trained.

Run by tests/test_slurm.py as the program of launch/slurm/tfdist.sbatch
(TFDIST_TRAIN="python tests/slurm_worker.py"): it takes tfdist-train's flags
and runs tfdist-train's own `main` (only the chief prints the run summary and
writes --model_dir), then each task writes, into $TFDIST_SLURM_TEST_OUT,
weights-<SLURM_PROCID>.npz (its final weights, so the test can compare the
tasks bit for bit) and task-<SLURM_PROCID>.json (its place in the cluster).
"""

import json
import os

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
    with open(os.path.join(out, f"task-{rank}.json"), "w") as f:
        json.dump({"worker_index": result.strategy.worker_index,
                   "num_workers": result.strategy.num_workers, "is_chief": result.is_chief,
                   "tf_config": json.loads(os.environ["TF_CONFIG"])}, f)


if __name__ == "__main__":
    app.run(main)
