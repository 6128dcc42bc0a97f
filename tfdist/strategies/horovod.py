"""`horovod`: Horovod ranks (one process each), started by `horovodrun`.

    horovodrun -np 2 -H localhost:2 --gloo tfdist-train --strategy=horovod ...

Without horovodrun the process runs as a single rank. Horovod 0.28.1 does not
build against current TensorFlow as published; `make horovod` builds it
(launch/build_horovod.sh, see BUILD_NOTES.md). Its `DistributedGradientTape`
calls `.ref()` on its sources, which Keras 3 variables lack, so this adapter
all-reduces gradient tensors directly (`grouped_allreduce`), which is also
what lets accumulation reduce once per update.
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.errors import UsageError
from tfdist.strategies.base import Strategy

BUILD_HINT = "build it with `make horovod` (launch/build_horovod.sh; see BUILD_NOTES.md)"


def _import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        raise UsageError(f"--strategy=horovod: Horovod is not installed here ({error}); "
                         f"{BUILD_HINT}") from None
    except Exception as error:  # e.g. built against another TensorFlow: undefined symbols
        raise UsageError(f"--strategy=horovod: Horovod cannot be loaded "
                         f"({str(error).splitlines()[0]}); rebuild it with `make horovod`") from None
    return hvd  # the import loads Horovod's TensorFlow ops library: it was built with TF


class HorovodStrategy(Strategy):
    """Data parallelism over Horovod ranks; rank 0 is the chief."""

    name = "horovod"
    process_unit = "rank"

    def setup(self) -> None:
        hvd = _import_horovod()
        hvd.init()
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:  # one GPU per local rank
            tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
        self._hvd = hvd

    def close(self) -> None:
        """Shut Horovod's background thread down cleanly at the end of a run."""
        if getattr(self, "_hvd", None) is not None and self._hvd.is_initialized():
            self._hvd.shutdown()

    @property
    def num_replicas(self) -> int:
        return self._hvd.size()

    @property
    def num_workers(self) -> int:
        return self._hvd.size()

    @property
    def worker_index(self) -> int:
        return self._hvd.rank()

    def describe(self) -> str:
        return (f"horovod: {self.num_replicas} rank(s); this is rank {self.worker_index} "
                f"(local rank {self._hvd.local_rank()})")

    def distribute_dataset(self, dataset_fn):
        context = tf.distribute.InputContext(
            num_input_pipelines=self.num_workers, input_pipeline_id=self.worker_index,
            num_replicas_in_sync=self.num_replicas)
        return dataset_fn(context)

    def run(self, replica_fn, *args):
        return replica_fn(*args)

    def replica_id(self):
        return self._hvd.rank()

    def _all_reduce_sum(self, tensors):
        if self.num_replicas == 1:
            return list(tensors)
        return self._hvd.grouped_allreduce(list(tensors), op=self._hvd.Sum)

    def broadcast_variables(self, variables) -> None:
        """Rank 0's values everywhere (its initial weights, or its checkpoint)."""
        if self.num_replicas == 1:
            return
        for index, variable in enumerate(variables):
            variable.assign(self._hvd.broadcast(tf.convert_to_tensor(variable), root_rank=0,
                                                name=f"tfdist_broadcast_{index}"))

    def describe_fault(self, error: Exception) -> str:
        text = str(getattr(error, "message", error)).strip().splitlines()
        return (f"rank {self.worker_index}: Horovod collective failed (a peer rank died or "
                f"timed out): {text[0] if text else type(error).__name__}")
