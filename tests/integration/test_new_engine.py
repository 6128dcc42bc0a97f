"""Adding an engine is one file plus one registry line: a minimal engine,
written against the adapter base alone, registers and trains.

`LoopbackStrategy` below is a complete data-parallel engine in a few dozen
lines: replicas on the virtual CPUs, each batch split over them, gradients
summed with TensorFlow's own collective reduction (through tf.distribute's
replica context, the only engine machinery it borrows). It implements only
the core hooks, no capability, and the trainer, the controller and the API
take it as they take the built-in engines.
"""

import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfdist import api, cluster, models, strategies
from tfdist.errors import UsageError
from tfdist.strategies import capabilities
from tfdist.strategies.base import Strategy
from tfdist.strategies.tf_distribute import apply_if_merged, run_first_result

from common import IMAGE_SPEC, assert_weights_close, run_config, train_from
from conftest import REPO, run_all, tfdist_train


class LoopbackStrategy(Strategy):
    """Synchronous data parallelism over this host's (virtual) CPUs."""

    name = "loopback"

    def setup(self):
        devices = cluster.local_devices(self.config.virtual_devices)
        self._engine = tf.distribute.MirroredStrategy(
            devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice(devices[0]))

    def scope(self):
        return self._engine.scope()

    @property
    def num_replicas(self):
        return self._engine.num_replicas_in_sync

    def distribute_dataset(self, dataset_fn):
        return self._engine.distribute_datasets_from_function(dataset_fn)

    def run(self, replica_fn, *args):
        return run_first_result(self._engine, replica_fn, args)

    def _all_reduce_sum(self, tensors):
        context = tf.distribute.get_replica_context()
        return context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)

    def apply_if(self, condition, update, *args):
        apply_if_merged(condition, update, args)


@pytest.fixture(scope="module", autouse=True)
def loopback_registered():
    """Registered for this module only (other tests list the built-in engines)."""
    strategies.register("loopback", LoopbackStrategy)
    yield
    strategies.unregister("loopback")


def test_a_registered_minimal_engine_trains_like_one_device():
    """Two replicas of the loopback engine match one device (same global
    batch, same initial weights) to float32 reordering (common.py)."""
    config = run_config("loopback", steps=4, steps_per_loop=2)
    initial = models.build(config.model, IMAGE_SPEC).get_weights()
    loopback = train_from(config, initial)
    single = train_from(run_config("default", steps=4, steps_per_loop=2), initial)
    assert loopback.summary["strategy"] == "loopback"
    assert loopback.summary["replicas"] == 2
    assert loopback.summary["steps"] == 4
    assert_weights_close(loopback.model.get_weights(), single.model.get_weights())
    moved = [np.abs(a - b).max() for a, b in zip(loopback.model.get_weights(), initial)]
    assert max(moved) > 1e-3   # it trained


def test_capabilities_are_opt_in():
    """The minimal engine has none; asking for one is a clear usage error."""
    adapter = strategies.create(run_config("loopback").strategy)
    for interface in (capabilities.TensorSharding, capabilities.ElasticMembership,
                      capabilities.ScheduledSteps, capabilities.ServingProcesses):
        assert capabilities.capability(adapter, interface) is None
    with pytest.raises(UsageError, match="does not shard tensors"):
        api.describe_layouts(run_config("loopback"))
    elastic = run_config("loopback").strategy.replace(elastic=True)
    with pytest.raises(UsageError, match="--elastic"):
        strategies.create(elastic)


def test_registering_a_taken_name_is_refused():
    with pytest.raises(UsageError, match="already registered"):
        strategies.register("mirrored", LoopbackStrategy)


TOY_DECLARATION = '''
from tfdist.strategies import Engine
ENGINE = Engine("toy", "toy_engine_adapter:ToyStrategy",
                "a toy engine from another package: one device under its own name")
'''
TOY_ADAPTER = '''
from tfdist.strategies.default import DefaultStrategy

class ToyStrategy(DefaultStrategy):
    name = "toy"
'''


@pytest.fixture(scope="module")
def toy_package(tmp_path_factory):
    """An installed package outside tfdist that declares an engine through the
    `tfdist.engines` entry points (a directory on PYTHONPATH with its own
    dist-info, as pip would leave it): no tfdist file names it."""
    root = tmp_path_factory.mktemp("site")
    (root / "toy_engine.py").write_text(TOY_DECLARATION)
    (root / "toy_engine_adapter.py").write_text(TOY_ADAPTER)
    info = root / "toy_engine-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[tfdist.engines]\ntoy = toy_engine:ENGINE\n")
    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def test_an_engine_of_another_package_appears_everywhere_and_trains(toy_package, data_dir):
    """Help, the generated reference, the name check and a run all see the
    plug-in engine; the committed reference (made without it) does not."""
    reference = ("from tfdist import help; print(help.markdown_reference())")
    helped, generated, refused, trained = run_all([
        tfdist_train(["--help"]),
        [sys.executable, "-c", reference],
        tfdist_train(["--strategy=toyy"]),
        tfdist_train(["--strategy=toy", "--model=mlp", "--model_width=8", "--train_steps=2",
                      "--global_batch_size=16", f"--data_dir={data_dir}"]),
    ], envs=[toy_package] * 4, timeout=240)
    summary = "toy: a toy engine from another package: one device under its own name."
    assert summary in " ".join(helped.stdout.split()), helped.stderr[-2000:]
    assert "default, dtensor, horovod, mirrored, multi_worker, parameter_server, pipeline, toy" \
        in generated.stdout, generated.stderr[-2000:]
    assert refused.returncode == 2
    assert "pipeline, toy" in refused.stderr, refused.stderr
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads(trained.stdout.strip().splitlines()[-1])["strategy"] == "toy"
    with open(os.path.join(REPO, "docs", "reference", "flags.md")) as f:
        assert "toy" not in f.read()   # control: without the package, no toy
