"""A process of the "does it fit" proof (tests/integration/test_zero.py, bench/fits.py).

    python tests/fits_worker.py OUT_DIR MODEL_DIR STRATEGY MESH STAGE WIDTH DEPTH STEPS [SNAPSHOT]

Trains the mlp WIDTH x DEPTH (Adam, global batch 16, the test images) under
--strategy=STRATEGY (dtensor: --mesh=MESH; pipeline: MESH is the number of
stages; --zero_stage=STAGE) up to step STEPS,
resuming from MODEL_DIR's checkpoint when it has one (so several runs start
from the same checkpoint, optimizer state included). With
SNAPSHOT, it first trains 1 step, copies MODEL_DIR (that step's checkpoint) to
SNAPSHOT, then goes on. Run alone or as one process of a tfdist-launch cluster
(each writes OUT_DIR/summary-<task>.json: the run summary, whose
peak_rss_bytes is this process's peak resident memory). Errors end the process
as tfdist-train's do: one line, exit status 1 or 2.
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import IMAGE_SPEC, image_dataset_fn  # noqa: E402


def main(out_dir, model_dir, strategy, mesh, stage, width, depth, steps, snapshot=None):
    import tfdist
    from tfdist.mesh_model import MeshModel

    def train(steps):
        layout = {"pipeline_stages": int(mesh)} if strategy == "pipeline" else {"mesh": mesh}
        config = tfdist.RunConfig(
            strategy=tfdist.StrategyConfig(name=strategy, zero_stage=int(stage),
                                           collective_timeout_s=300, **layout),
            model=tfdist.ModelConfig(name="mlp", width=int(width), depth=int(depth)),
            data=tfdist.DataConfig(shuffle_buffer=1),
            optimizer=tfdist.OptimizerConfig(name="adam", learning_rate=1e-3),
            train=tfdist.TrainConfig(global_batch_size=16, train_steps=steps,
                                     steps_per_loop=steps, eval_every=0, seed=1,
                                     model_dir=model_dir, jit_compile="off"))
        return tfdist.train(config, dataset_fn=image_dataset_fn, spec=IMAGE_SPEC)

    if snapshot:
        train(1)
        shutil.copytree(model_dir, snapshot)
    result = train(int(steps))
    index = json.loads(os.environ.get("TF_CONFIG", '{"task":{"index":0}}'))["task"]["index"]
    with open(os.path.join(out_dir, f"summary-{index}.json"), "w") as f:
        json.dump({**result.summary, "host_copy": not isinstance(result.model, MeshModel)}, f)


if __name__ == "__main__":
    from tfdist import app, startup
    startup.load("api")   # as tfdist's own processes load TensorFlow (frozen)
    app.run(lambda argv: main(*argv[1:]))
