"""One global order of the training data (`--autoshard=global`): the same
global batches for every number of input pipelines and replicas, and a
resumed stream that continues exactly. Pure tf.data, in one process."""

import numpy as np
import tensorflow as tf

from tfdist.data import inputs as inputs_lib
from tfdist.data.function_inputs import FunctionInputs
from tfdist.data.spec import DatasetSpec

EXAMPLES, BATCH, SEED, BUFFER = 40, 8, 3, 16
SPEC = DatasetSpec(name="numbered", kind="image", input_shape=(2,), num_classes=5,
                   train_examples=EXAMPLES, eval_examples=8)


def _dataset_fn(split, context):
    ids = np.arange(EXAMPLES, dtype=np.float32)
    x = np.stack([ids, -ids], axis=1)
    ds = tf.data.Dataset.from_tensor_slices((x, (ids % 5).astype(np.int32), ids / 100))
    return ds   # no sharding of its own: the global order reads everything


INPUTS = FunctionInputs(_dataset_fn, SPEC)


def _global_batches(pipelines, replicas_per_pipeline, steps, start_example=0, pipeline_ids=None):
    """The ids of the examples of each global batch, rebuilt from every
    pipeline's per-replica batches (pipeline by pipeline, replica by replica)."""
    fn = inputs_lib.train_dataset_fn(INPUTS, global_batch_size=BATCH, seed=SEED,
                                     shuffle_buffer=BUFFER, start_example=start_example)
    streams = []
    for i in pipeline_ids or range(pipelines):
        context = tf.distribute.InputContext(pipelines, i, pipelines * replicas_per_pipeline)
        it = iter(fn(context))
        rows = []
        for _ in range(steps):
            parts = [next(it) for _ in range(replicas_per_pipeline)]
            for x, _, w in parts:
                np.testing.assert_allclose(w.numpy(), x.numpy()[:, 0] / 100, rtol=1e-6)
            rows.append(np.concatenate([x.numpy()[:, 0] for x, _, _ in parts]))
        streams.append(rows)
    return [np.concatenate([s[k] for s in streams]).astype(int).tolist() for k in range(steps)]


def test_every_layout_reads_the_same_global_batches():
    steps = 12   # 2.4 epochs of 5 batches: epochs change inside a batch
    one = _global_batches(1, 1, steps)
    assert sorted(sum(one[:5], [])) == list(range(EXAMPLES))   # an epoch is a permutation
    assert one[:5] != one[5:10]                                 # reshuffled per epoch
    for pipelines, replicas in ((1, 2), (2, 1), (2, 2), (4, 1), (8, 1)):
        assert _global_batches(pipelines, replicas, steps) == one, (pipelines, replicas)


def test_a_stream_resumed_at_an_example_continues_exactly():
    one = _global_batches(1, 1, 12)
    for step in (1, 5, 7):   # 7: inside the second epoch, 16 examples in
        assert _global_batches(2, 1, 12 - step, start_example=step * BATCH) == one[step:]


def test_a_lone_pipeline_with_its_own_id_reads_its_own_order():
    """The control, and the parameter server's workers: one pipeline whose id
    is not 0 offsets the seed (each worker reads on its own)."""
    assert _global_batches(1, 1, 5, pipeline_ids=[1]) != _global_batches(1, 1, 5)


def test_the_order_does_not_depend_on_the_global_seed():
    """Only `--seed` (passed to the order) counts, not TensorFlow's global
    seed, which Keras sets from it: also a global seed of 0 (where TF 2.21's
    seed handling fails on a tensor seed)."""
    tf.random.set_seed(0)
    zero = _global_batches(2, 1, 6)
    tf.random.set_seed(5)
    assert _global_batches(2, 1, 6) == zero


def test_a_resumed_stream_can_be_built_inside_a_traced_function():
    """A parameter-server worker builds its dataset inside a `tf.function`
    (AutoGraph-converted): there the split's size is a tensor, and the
    resumed stream must still start at its example."""
    fn = inputs_lib.train_dataset_fn(INPUTS, global_batch_size=BATCH, seed=SEED,
                                     shuffle_buffer=BUFFER, start_example=7 * BATCH)

    @tf.function
    def first_batch():
        context = tf.distribute.InputContext(1, 0, 1)
        return next(iter(fn(context)))[0][:, 0]

    assert first_batch().numpy().astype(int).tolist() == _global_batches(1, 1, 8)[7]
