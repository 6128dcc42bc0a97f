"""Export for serving: `model.keras` and a SavedModel with a serving signature.

After training (`--export_dir`) the chief copies the trained weights into a
fresh build of the same model made outside any engine, so the export holds
plain, full (unsharded under dtensor) variables, and writes

    export_dir/model.keras     keras.saving.load_model(...)
    export_dir/saved_model/    tf.saved_model.load(...).serve(x)  (model.export)

into a temporary directory beside `export_dir` that replaces it only once
both are complete: an interrupted export never leaves half a model, and a
previous export stays intact until the new one is whole.

`tfdist-export --model_dir=D --export_dir=E` exports D's latest checkpoint
without training, from the run record (`D/run.json`: the RunConfig and the
dataset's spec) that every run with a model_dir writes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Callable, Optional

from tfdist.config import (DataConfig, ModelConfig, OptimizerConfig, RunConfig, StrategyConfig,
                           TrainConfig)
from tfdist.data.spec import DatasetSpec
from tfdist.errors import UsageError

RUN_RECORD = "run.json"
RUN_FLAGS = "run.cfg"


def write_run_record(model_dir: str, config: RunConfig, spec: DatasetSpec, *,
                     builder: bool) -> None:
    """`model_dir/run.json`: what `tfdist-export` needs to rebuild the model;
    and `model_dir/run.cfg`: the run's options as a flagfile
    (`tfdist-train --flagfile=model_dir/run.cfg` replays them)."""
    from tfdist import config as config_lib
    record = {"config": dataclasses.asdict(config), "spec": dataclasses.asdict(spec),
              "builder": builder}
    _write_text(os.path.join(model_dir, RUN_RECORD),
                json.dumps(record, indent=2, sort_keys=True, default=list) + "\n")
    _write_text(os.path.join(model_dir, RUN_FLAGS), config_lib.flagfile(config))


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def read_run_record(model_dir: str) -> tuple[RunConfig, DatasetSpec, bool]:
    path = os.path.join(model_dir, RUN_RECORD)
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"--model_dir={model_dir} has no {RUN_RECORD}: it is not a tfdist "
                         "run directory (runs with --model_dir write one)") from None
    except (OSError, ValueError) as error:
        raise UsageError(f"{path} cannot be read: {error}") from None
    parts = {"strategy": StrategyConfig, "model": ModelConfig, "data": DataConfig,
             "optimizer": OptimizerConfig, "train": TrainConfig}
    config = RunConfig(**{name: cls(**{k: _tuples(v) for k, v in record["config"][name].items()})
                          for name, cls in parts.items()})
    spec_fields = {k: _tuples(v) for k, v in record["spec"].items()}
    if isinstance(record["spec"].get("input_shape"), dict):
        spec_fields["input_shape"] = {k: tuple(v) for k, v in
                                      record["spec"]["input_shape"].items()}
    return config, DatasetSpec(**spec_fields), bool(record.get("builder"))


def _host_weights(model, strategy) -> list:
    if strategy is None:
        return model.get_weights()
    return [strategy.to_host(v).numpy() for v in model.weights]


def host_copy(model, strategy, rebuild: Callable):
    """A plain Keras model (built by `rebuild`, outside any engine) holding
    `model`'s weights as host values. For a model on a DTensor mesh every
    process must call this together: gathering a sharded variable is a
    collective across the mesh's processes."""
    copy = rebuild()
    copy.set_weights(_host_weights(model, strategy))
    return copy


def _write_atomically(export_dir: str, write: Callable[[str], None]) -> None:
    """`write(staging)` fills a fresh directory beside `export_dir`, which then
    replaces `export_dir` in one rename (a failure leaves the old one intact)."""
    parent = os.path.dirname(export_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(export_dir)}.tmp-", dir=parent)
    except OSError as error:
        raise UsageError(f"--export_dir={export_dir} cannot be written: "
                         f"{error.strerror or error}") from None
    try:
        write(staging)
        previous = None
        if os.path.exists(export_dir):
            previous = f"{staging}.previous"
            os.replace(export_dir, previous)
        os.replace(staging, export_dir)
        if previous:
            shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def export_mesh_model(model, export_dir: str) -> Optional[dict]:
    """Export a `MeshModel` (a model too large for one process): `model.keras`
    written one variable at a time (`MeshModel.save`); no SavedModel, whose
    export traces the model whole in one process. Every process calls this
    (the gathers are collectives); the chief writes `export_dir`, replaced
    atomically, the others a scratch file `MeshModel.save` deletes."""
    from absl import logging

    export_dir = os.path.abspath(export_dir)
    if not model.is_chief:
        model.save(os.path.join(export_dir, "model.keras"))
        return None
    _write_atomically(export_dir, lambda staging: model.save(os.path.join(staging, "model.keras")))
    paths = {"keras": os.path.join(export_dir, "model.keras"), "saved_model": None}
    logging.info("exported %s (no SavedModel: the model does not fit one process)",
                 paths["keras"])
    return paths


def export_model(model, export_dir: str, *, strategy=None,
                 rebuild: Optional[Callable] = None) -> dict:
    """Write `model` (trained under `strategy`) to `export_dir`; return the paths."""
    from absl import logging

    serving = model if rebuild is None else host_copy(model, strategy, rebuild)
    export_dir = os.path.abspath(export_dir)

    def write(staging):
        serving.save(os.path.join(staging, "model.keras"))
        serving.export(os.path.join(staging, "saved_model"), format="tf_saved_model",
                       verbose=False)

    _write_atomically(export_dir, write)
    paths = {"keras": os.path.join(export_dir, "model.keras"),
             "saved_model": os.path.join(export_dir, "saved_model")}
    logging.info("exported %s and %s", paths["keras"], paths["saved_model"])
    return paths


def export_checkpoint(model_dir: str, export_dir: str, *,
                      model_fn: Optional[Callable] = None, spec: Optional[DatasetSpec] = None,
                      checkpoint: Optional[str] = None) -> dict:
    """Export `model_dir`'s latest (or the given) checkpoint without training.

    Builders' runs rebuild from the run record; runs of your own `model_fn`
    pass it again (and the `spec` it was given, if it differs from the record's).
    """
    # The run record first: a wrong --model_dir is one line before TensorFlow loads.
    config, recorded_spec, builder = read_run_record(model_dir)
    spec = spec or recorded_spec
    if model_fn is None and not builder:
        raise UsageError(f"--model_dir={model_dir} was trained with a Python model_fn; "
                         "export it from Python: tfdist.export(model_dir, export_dir, "
                         "model_fn=...)")

    import tensorflow as tf
    from absl import logging

    from tfdist import models
    from tfdist.checkpointing import checkpoint_dir
    from tfdist.training.precision import Precision
    path = checkpoint or tf.train.latest_checkpoint(checkpoint_dir(model_dir))
    if not path:
        raise UsageError(f"--model_dir={model_dir} has no checkpoint to export (train with "
                         "--model_dir first)")
    with Precision(config.train.precision).policy_scope():
        model = model_fn(spec) if model_fn else models.build(config.model, spec)
    status = tf.train.Checkpoint(model=model).read(path)
    status.expect_partial()
    status.assert_existing_objects_matched()
    logging.info("restored %s", path)
    return export_model(model, export_dir)
