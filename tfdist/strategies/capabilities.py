"""Opt-in capabilities: what only some engines do.

The adapter base (`base.Strategy`) holds what every engine has. A feature
that only some engines have is an interface here, which an adapter
implements (by subclassing it next to `Strategy`) and the trainer, the
controller and the API test for with `capability(strategy, Interface)` —
never by engine name (the shape of Lightning Fabric's `_Sharded` and
`_BackwardSyncControl`). A new engine implements those it needs; a new kind of
feature (pipeline stages, say) is a new interface here, not a new base hook.

Each interface may be implemented by a class yet not used by a given run
(Horovod is elastic only with --elastic): `active()` says whether it is.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, NamedTuple, Optional, Sequence, TypeVar

from tfdist.errors import UsageError

T = TypeVar("T")


class Capability(abc.ABC):
    """Base of the capability interfaces."""

    needs = "a capability"   # what a feature needs, in `require`'s refusal
    # The class attribute an adapter that inherits the interface but cannot
    # honour it sets to False (a pipeline's stages), or None: none.
    declined_by = None

    def active(self) -> bool:
        """Whether this run uses the capability (default: always, when offered)."""
        return True

    @classmethod
    def offered_by(cls, adapter: type) -> bool:
        """Whether engines of class `adapter` (a subclass) offer it at all."""
        return cls.declined_by is None or getattr(adapter, cls.declined_by)


def capability(strategy, interface: type[T]) -> Optional[T]:
    """`strategy` as an `interface` if it implements and offers it and this run uses
    it, else None."""
    if (isinstance(strategy, interface) and interface.offered_by(type(strategy))
            and interface.active(strategy)):
        return strategy
    return None


def require(strategy, interface: type[T], feature: str) -> T:
    """`strategy` as an `interface`, or the one refusal every capability
    shares: a `UsageError` naming `feature`, what it needs, the engine, and
    the engines that have it (their adapters are imported to ask)."""
    found = capability(strategy, interface)
    if found is not None:
        return found
    import importlib

    from tfdist import strategies
    having = []
    for engine in strategies.engines():
        adapter = engine.adapter
        if isinstance(adapter, str):
            module, _, name = adapter.partition(":")
            try:
                adapter = getattr(importlib.import_module(module), name)
            except ImportError:   # an engine whose own dependency is missing
                continue
        if issubclass(adapter, interface) and interface.offered_by(adapter):
            having.append(engine.name)
    raise UsageError(f"{feature} needs {interface.needs}; --strategy={strategy.config.name} "
                     f"has none (engines that do: {', '.join(having) or 'none'})")


class TensorSharding(Capability):
    """Variables are split over devices by layout rules (DTensor). Such an
    engine takes the model's rules before the model is built, and can report
    where every variable and optimizer slot lives (`--print_layouts`)."""

    @abc.abstractmethod
    def set_layout_rules(self, rules) -> None:
        """The model's rules (`tfdist.sharding.LayoutRules`), before it is built."""

    @abc.abstractmethod
    def layout_report(self, model, optimizer) -> str:
        """A table of every variable's sharding and the per-device totals."""

    def prepare_model(self, model) -> None:
        """Called once the model and its optimizer are built on the engine (ZeRO-3
        makes each layer gather its own weights). Default: nothing."""

    def compute_scope(self):
        """A context for the forward and backward passes, in which sharded
        variables are read in the layout they compute in (ZeRO-3 gathers them
        there). Default: reads as stored."""
        return contextlib.nullcontext()

    def shard_gradients(self, grads: list, variables: list) -> list:
        """Gradients as they leave the backward pass, in the layout they are
        accumulated and applied in (ZeRO-2 splits them). Default: as given."""
        return list(grads)

    @abc.abstractmethod
    def predict_on_mesh(self, model, x, batch_size: Optional[int] = None):
        """`model`'s outputs for host inputs `x`, computed where its variables
        live (for a model too large to copy whole into one process)."""

    def host_copy_refusal(self, model) -> Optional[str]:
        """Why a whole copy of `model` must not be made in this process (it
        would not fit), or None. Default: it fits."""
        return None

    def end_of_run(self) -> None:
        """Called by every process after the run's last collective (the copy
        of the trained model to the host): processes that host shared
        services leave last. Default: nothing to wait for."""


class ZeroStages(Capability):
    """Training state split over the data-parallel replicas (ZeRO,
    `--zero_stage`): `zero_stages` are the stages the engine offers;
    `check_zero` refuses, in one line, a run it cannot split."""

    needs = "an engine that splits training state over its data-parallel replicas (ZeRO)"
    zero_stages: tuple = (1, 2, 3)

    def check_zero(self, config) -> None:
        """Raise `UsageError` if this run cannot use `config.strategy.zero`."""
        stage = config.strategy.zero
        if stage not in self.zero_stages:
            raise UsageError(f"--zero_stage={stage}: --strategy={config.strategy.name} offers "
                             f"ZeRO stage(s) {', '.join(map(str, self.zero_stages))}")


class ElasticMembership(Capability):
    """Workers may leave and join during a run (Horovod elastic). The engine
    keeps the training state in its own store, committed every
    `commit_interval` steps; when the group changes it rolls back to the last
    commit, re-forms and runs the outer loop again, which then re-reads the
    topology (number of replicas, rank, chief) and re-traces its functions."""

    def active(self) -> bool:
        return self.elastic_enabled

    @property
    @abc.abstractmethod
    def elastic_enabled(self) -> bool:
        """Whether this run is elastic (e.g. --elastic)."""

    @property
    @abc.abstractmethod
    def commit_interval(self) -> int:
        """Steps between commits (0: at the end of every loop); the outer
        loop regains control at each."""

    @abc.abstractmethod
    def train_elastic(self, train: Callable[[], Any], state_variables: Sequence) -> Any:
        """Run `train()` (the outer loop, from the step the state holds) with
        `state_variables` in the engine's store; call it again after each
        change of membership. Returns its result."""

    @abc.abstractmethod
    def commit_if_due(self, step: int) -> None:
        """Called by every worker after each loop, at global `step`."""


class ScheduledSteps(Capability):
    """Steps are independent tasks that the engine runs on whichever worker
    is free (parameter servers: asynchronous training). The trainer's loop
    function may then be called several times with fewer steps, and the
    pieces' results joined (`LoopTotals.chain`). Keras's `predict` on such a
    model would be scheduled too (and refuses host data): `RunResult.model`
    is a plain copy of it."""

    @abc.abstractmethod
    def scheduled_loop(self, loop_fn: Callable) -> Callable:
        """`loop_fn(iterator, num_steps, *options) -> dict of LoopTotals.fields`
        as a host call with the same arguments returning a `LoopTotals`."""

    @abc.abstractmethod
    def schedule_metrics(self) -> dict:
        """Scalars about the last loop's scheduling (e.g. staleness), for logs."""

    def learning_rate_factor(self) -> Optional[Callable]:
        """A function giving, inside a step, the factor of that update's
        learning rate (as a float32 tensor; 1.0 outside a step), or None."""
        return None


class ServingProcesses(Capability):
    """Some processes of the job only serve others (parameter servers and
    their workers; pipeline stages driven by one client): they run what a
    coordinator sends them and train nothing themselves."""

    @abc.abstractmethod
    def serve_if_server(self) -> bool:
        """If this process is such a server, serve until the job ends and
        return True (the caller then trains nothing here); else False."""


class LocalGradients(NamedTuple):
    """One replica's gradients and counters, before the cross-replica sum.

    data: gradients of its share of the data loss, scaled by 1/(the global
      divisor) where that is known without the data; else provisionally by
      1/`provisional_divisor` (the global batch size), and rescaled by the
      reduced divisor after the sum (masks, `mean_with_sample_weight`).
    regularization: gradients of the model's regularization losses, kept
      apart (not rescaled) exactly when the data's are rescaled; else empty.
    counters: the loss numerator, divisor and metric deltas.
    provisional_divisor: None, or the divisor `data` was provisionally scaled by.
    """

    data: list
    regularization: list
    counters: Any
    provisional_divisor: Optional[Any]


class PipelineStages(Capability):
    """The model is split into stages (`tfdist.pipeline.split`), each stage's
    layers, variables and optimizer slots on its own device, and micro-batches
    flow through the stages on a schedule (GPipe or 1F1B). The engine places
    the model once it is built, before its optimizer is (so that the slots
    land beside their variables), and computes a replica's gradients over its
    micro-batches in place of the trainer's accumulation loop. Where each
    process holds some stages only (`splits_update`), it also reduces and
    applies the update of its stages' variables only, holds only those (and
    their slots), evaluates through the stages (`forward`), writes and
    reads checkpoints in parts (`checkpoint_parts`) and gathers the model's
    weights on the chief for export (`gather_stages`)."""

    def build_model(self, build):
        """The model `build()` makes, in the engine's scope. Where each process
        runs some stages only, it may build the model without the storage of
        the other stages' weights (`place_model` gives each process its own)."""
        return build()

    @abc.abstractmethod
    def place_model(self, model, input_signature=None) -> None:
        """Split `model` into stages and move each stage's variables to its
        device. `input_signature`: one example of the data (batch 1), for the
        split's FLOP count where the model's inputs leave a length open.
        `UsageError` for a model that cannot be split so."""

    @abc.abstractmethod
    def local_gradients(self, losses, x, y, weight):
        """This replica's `trainer.LocalGradients` over its micro-batches (the
        batch split into --accum_steps parts), computed stage by stage.
        `losses` (`trainer.MicroBatchLoss`) says how a micro-batch's loss,
        counters and regularization are formed, exactly as without stages."""

    @abc.abstractmethod
    def stage_report(self, model) -> str:
        """A table of the stages: devices, layers, parameter bytes, FLOPs."""

    def state_share(self, variable, value):
        """This process's part of the sum of non-trainable state `variable`
        (now `value`) over the step's copies, which the trainer divides by
        `step_copies`: where only some processes run `variable`'s stage, they
        contribute scaled values and the others zeros. Default: `value`."""
        return value

    #: Whether each process updates only its own stages' variables: the
    #: trainer then uses `updated_variables`, `reduce_update`, `global_norm`,
    #: and the members below to hold, evaluate and gather the stages.
    splits_update = False

    def updated_variables(self, variables) -> list:
        """Those of the trainable `variables` this process updates, in order."""
        return list(variables)

    def reduce_update(self, grads, counters):
        """(`grads` of `updated_variables` summed over the processes that
        update them, `counters` summed over all): replaces the trainer's one
        reduction where `splits_update`."""
        raise NotImplementedError

    def global_norm(self, grads):
        """The norm of the whole model's reduced gradient, of which `grads`
        (reduced, of `updated_variables`) is this process's part."""
        raise NotImplementedError

    def applied_update(self, grads, variables) -> tuple:
        """(gradients, variables) of the reduced, clipped `grads` of
        `updated_variables` that this process applies the optimizer to.
        Default: all (ZeRO-1 within a stage's replicas applies each replica's
        share, then `share_update` shares the result)."""
        return list(grads), list(variables)

    def share_update(self, variables) -> None:
        """After this process's optimizer update of its `applied_update`
        (in the replica step): give every process that holds `variables`
        (`updated_variables`) their updated values. Default: nothing."""

    def build_optimizer(self, optimizer, variables) -> None:
        """`optimizer.build(variables)`. Where `splits_update`, the slots of
        the variables this process does not update are freed as they are made."""
        optimizer.build(variables)

    # Where `splits_update`, a process holds only its stages; `pairs` are
    # (variable, the trainable variable whose stage it belongs to) for every
    # trainable variable and optimizer slot (`TrainingState.owned`); the
    # engine's lifecycle hooks (`Strategy.gather_state`, ...) call these.
    def release_others(self, pairs) -> None:
        """Free this process's storage of the other stages' `pairs`."""

    def checkpoint_parts(self, checkpoint, state):
        """A `tfdist.checkpoint_parts.CheckpointParts` through which each
        process writes and reads its own part of `checkpoint` (`state`: the
        trainer's `TrainingState`), or None: the chief writes it whole after
        `gather_state`."""
        return None

    def materialize(self, pairs) -> None:
        """Give every freed variable of `pairs` its storage back (zeros), before
        something writes them all (a restore, a broadcast)."""

    def holds_whole_model(self) -> bool:
        """Whether every variable's storage is held here."""
        return True

    def chief_holds_model(self) -> bool:
        """Whether the chief holds every weight of the trained model at the
        end of training (the same answer in every process)."""
        return True

    def predict_through_stages(self, x, batch: int):
        """The model's outputs for host inputs `x` (every process calls this
        with the same `x`), run through the stages where no process holds
        the whole model; every process gets them."""
        raise NotImplementedError

    def gather_stages(self, pairs) -> None:
        """Give the chief every variable of `pairs` from its stage's owner."""
        raise NotImplementedError

    def scatter_stages(self, pairs) -> None:
        """Give every process the chief's values of its stages' `pairs`."""
        raise NotImplementedError

    def forward(self, x, y):
        """This process's stages of the evaluation forward pass of a batch:
        (the model's output, []) where the last stage runs here, else (None,
        the ops that must run: sends to the next stage). `y` gives the rows."""
        raise NotImplementedError


class GlobalBatchStatistics(Capability):
    """BatchNormalization can normalise with the statistics of the global
    batch (`--sync_batchnorm`, or a layer's own `synchronized=True`): the
    moments reduced over every replica inside the forward pass, the
    gradients flowing back through the reduction. An engine that inherits it
    but cannot (a pipeline's stages see micro-batches) says so with
    `global_batch_statistics = False`."""

    needs = "BatchNorm statistics reduced over every replica's batch"
    declined_by = "global_batch_statistics"
    global_batch_statistics = True
    # Whether the reduction is a collective inside the forward pass (which
    # XLA cannot compile on CPU), or the statistics are global already.
    statistics_collective = True

    @abc.abstractmethod
    def synchronize_batch_statistics(self, layers: list) -> str:
        """Make `layers` (Keras BatchNormalization layers, built) normalise
        with the global batch's statistics; returns how, for the log."""


class ReplicaLocalState(Capability):
    """Each replica runs the step on its own share of the batch and may keep
    state of its own between steps, and tensors can be gathered from every
    replica: what compressed exchanges with error feedback
    (`--grad_compression=powersgd|topk`) and local SGD (`--sync_every`) need.
    Engines whose step is one SPMD program (DTensor), or whose workers step
    independently against servers (parameter servers), do not have it; an
    engine that inherits it but runs no such replicas (a pipeline's stages)
    says so with `replica_local_state = False`."""

    needs = "replicas that each step on their own data and keep state of their own"
    declined_by = "replica_local_state"
    replica_local_state = True

    @abc.abstractmethod
    def replica_variable(self, initial_value, name: str):
        """A variable of which every replica holds (and updates, in replica
        context) its own copy, starting from `initial_value` (a tensor, or
        a callable returning one)."""

    @abc.abstractmethod
    def replica_values(self, variable) -> list:
        """The copies of `variable` (a `replica_variable`, or one of the
        model's or optimizer's variables) held by this process's replicas,
        in replica order: variables that can be read and assigned eagerly."""

    @abc.abstractmethod
    def all_gather(self, tensor):
        """Every replica's `tensor` (same dtype and rank; the first dimension
        may differ) concatenated along axis 0 in replica order (called in
        replica context)."""
