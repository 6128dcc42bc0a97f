"""The training data at a step: exactly where a resumed run left off.

A resumed run continues from the input position saved with its checkpoint,
so it reads exactly the batches an uninterrupted run reads. In the one global
order (`--autoshard=global`, the default) the position is the order's seed
and the global examples read (`checkpointing.GlobalInputPosition`), valid
under any synchronous engine and cluster size; with per-pipeline sharding it
is each pipeline's tf.data iterator (`checkpointing.InputPosition`), valid
for the same layout only. Where there is none (`--nocheckpoint_input`, other
input settings, a missing or damaged position, an engine whose iterators
cannot be checkpointed) it draws a fresh, seeded permutation instead, so it
does not replay the batches the first steps already saw.
"""

from __future__ import annotations

from typing import Optional

from absl import logging

from tfdist.checkpointing import GlobalInputPosition, InputPosition
from tfdist.data import inputs as inputs_lib

# A fresh permutation after step S is seeded `seed + FRESH_SEED_STRIDE * S`.
FRESH_SEED_STRIDE = 7919


class TrainingData:
    """The training iterator and evaluation data of one process under `strategy`."""

    def __init__(self, *, config, strategy, inputs: inputs_lib.Inputs, checkpointer=None):
        self.config, self.strategy, self.inputs = config, strategy, inputs
        self.checkpointer = checkpointer
        self.global_batch_size = config.train.global_batch_size
        self.eval_data, self.eval_steps = None, 0
        self._tracked = None   # (seed, first example, first step) of the global order read

    def shuffle_buffer(self) -> int:
        # More than the split holds buys nothing (and 2**63 would not allocate).
        return min(self.config.data.shuffle_buffer,
                   self.inputs.spec.train_examples or self.config.data.shuffle_buffer)

    @property
    def global_order(self) -> bool:
        return self.config.data.autoshard == "global"

    def _iterator(self, seed: int, start_example: int = 0):
        """The training iterator of a pipeline shuffled by `seed`, and its
        checkpointable state (None where the engine has none)."""
        return self.strategy.input_iterator(inputs_lib.train_dataset_fn(
            self.inputs, global_batch_size=self.global_batch_size, seed=seed,
            shuffle_buffer=self.shuffle_buffer(), global_order=self.global_order,
            start_example=start_example))

    def _signature(self) -> dict:
        return {"buffer": self.shuffle_buffer(), "spec": repr(self.inputs.spec)}

    def _global_iterator(self, start_step: int):
        """The iterator at `start_step` in the one global order: at the saved
        number of examples read, whatever engine and size saved it."""
        tc = self.config.train
        position = None
        if self.checkpointer is not None and tc.checkpoint_input:
            position = GlobalInputPosition(self.checkpointer.directory,
                                           signature=self._signature(),
                                           keep=self.checkpointer.keep)
        seed, start = tc.seed, 0
        if start_step:
            saved = position.restore(start_step) if position else None
            if saved is None and self._tracked is not None:
                # This process read the order up to here (Horovod's elastic ranks
                # re-formed): go on in it, with the new ranks' rows.
                seed, first_example, first_step = self._tracked
                saved = seed, first_example + (start_step - first_step) * self.global_batch_size
            if saved is None:
                why = ("--nocheckpoint_input" if not tc.checkpoint_input else
                       f"no input position of this data and shuffle buffer was saved at "
                       f"step {start_step}")
                logging.warning("%s: %s; reading a fresh permutation of the data",
                                self.strategy.describe_process(), why)
                seed = tc.seed + FRESH_SEED_STRIDE * start_step
            else:
                seed, start = saved
                logging.info("input position: %d examples read (seed %d); the resumed run "
                             "goes on from there", start, seed)
        iterator, _ = self._iterator(seed, start)
        self._tracked = seed, start, start_step
        if position:
            position.track(seed, start, start_step, self.global_batch_size)
        return iterator, position

    def _position(self) -> Optional[InputPosition]:
        if self.checkpointer is None or not self.config.train.checkpoint_input:
            return None
        strategy = self.strategy
        return InputPosition(
            self.checkpointer.directory, keep=self.checkpointer.keep,
            pipeline=strategy.worker_index, pipelines=strategy.num_input_pipelines,
            signature={"batch": self.global_batch_size, "buffer": self.shuffle_buffer(),
                       "replicas": strategy.num_replicas, "spec": repr(self.inputs.spec)})

    def train_iterator(self, start_step: int):
        """The training iterator at `start_step` (see module doc); from then on
        its position is saved with every checkpoint."""
        if self.global_order:
            iterator, position = self._global_iterator(start_step)
            if self.checkpointer is not None:
                self.checkpointer.input_position = position
            self._prepare_eval()
            return iterator
        tc = self.config.train
        position = self._position()
        saved_seed = position.saved_seed(start_step) if position and start_step else None
        seed = tc.seed if saved_seed is None else saved_seed
        iterator, state = self._iterator(seed)
        if state is None:
            position = None
        elif position:
            position.track(state, seed)
        if start_step and not (position and position.restore(start_step)):
            why = ("--nocheckpoint_input" if not tc.checkpoint_input
                   else f"--strategy={self.strategy.name} cannot checkpoint its input iterator"
                   if state is None else f"no input position was saved at step {start_step}")
            logging.warning("%s: %s; reading a fresh permutation of the data",
                            self.strategy.describe_process(), why)
            seed = tc.seed + FRESH_SEED_STRIDE * start_step
            iterator, state = self._iterator(seed)
            if position:
                position.track(state, seed)
        if self.checkpointer is not None:
            self.checkpointer.input_position = position
        self._prepare_eval()
        return iterator

    def _prepare_eval(self) -> None:
        if not self.inputs.has_eval:
            return
        strategy = self.strategy
        pipelines = strategy.num_input_pipelines
        self.eval_steps = inputs_lib.eval_steps(
            self.inputs, global_batch_size=self.global_batch_size, num_pipelines=pipelines)
        self.eval_data = strategy.distribute_dataset(inputs_lib.eval_dataset_fn(
            self.inputs, global_batch_size=self.global_batch_size, steps=self.eval_steps,
            replicas_per_pipeline=strategy.step_copies // pipelines))
