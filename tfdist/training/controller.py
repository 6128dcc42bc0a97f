"""The outer training loop (Orbit's `Controller`): when, not how.

The controller decides when the in-graph loop (`Trainer.train_loop`) hands
control back — at every log, evaluation, checkpoint, gradient-agreement,
profiler and elastic-commit boundary, and at least every `steps_per_loop`
steps — and what happens then: metrics and TensorBoard, evaluation,
checkpoints, signals (Ctrl-C, preemption), rollback past non-finite steps,
elastic commits, and the run's end.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

from absl import logging

from tfdist.data.resume import TrainingData
from tfdist.errors import WorkerFault
from tfdist.observe import flops as flops_lib
from tfdist.observe import logs, tensorboard
from tfdist.observe.progress import Progress
from tfdist.observe.tensorboard import Profiler, TensorBoard
from tfdist.strategies.capabilities import ElasticMembership, ScheduledSteps, capability
from tfdist.training import nonfinite, optimizers, xla_cache
from tfdist.training.interrupts import Preempted, StopSignals
from tfdist.training.precision import Precision
from tfdist.observe.totals import LoopTotals
from tfdist.training.trainer import Trainer


def _due(every: int, step: int) -> bool:
    return bool(every) and step % every == 0


def _passed(every: int, start: int, stop: int) -> bool:
    """Whether a loop from `start` to `stop` reached a multiple of `every`: the
    loop ends on it, except under local SGD, whose loops end only where the
    weights are averaged (the first average at or after it)."""
    return bool(every) and stop // every > start // every


@dataclasses.dataclass
class _Run:
    """What one pass of the outer loop accumulates."""

    progress: Progress
    signals: StopSignals
    train_metrics: dict = dataclasses.field(default_factory=dict)
    eval_metrics: dict = dataclasses.field(default_factory=dict)
    timed_examples: int = 0
    timed_seconds: float = 0.0
    first_loop: bool = True   # its call traces and compiles the graph: not timed


class Controller:
    """Runs `trainer` to `total_steps` (see module doc); `fit()` returns the metrics."""

    def __init__(self, *, config, trainer: Trainer, inputs, total_steps: int,
                 checkpointer=None, flops_per_example: Optional[int] = None,
                 peak_tflops: Optional[float] = None):
        tc, strategy = config.train, trainer.strategy
        self.config, self.train_config, self.trainer, self.strategy = config, tc, trainer, strategy
        self.total_steps, self.checkpointer = total_steps, checkpointer
        self.flops_per_example, self.peak_tflops = flops_per_example, peak_tflops
        self.data = TrainingData(config=config, strategy=strategy, inputs=inputs,
                                 checkpointer=checkpointer)
        self.nonfinite = nonfinite.Policy(tc, strategy, checkpointer,
                                          before_restore=self._hold_state,
                                          restore_state=self._broadcast_restored)
        self.elastic = capability(strategy, ElasticMembership)
        self.tensorboard = TensorBoard(tc.model_dir, enabled=strategy.is_chief)
        profile_dir = tc.model_dir and tensorboard.directory(tc.model_dir)
        if profile_dir and not strategy.is_chief:
            profile_dir = os.path.join(profile_dir, f"worker_{strategy.worker_index}")
        self.profiler = Profiler(tc.profile_steps, profile_dir,
                                 enabled=strategy.is_chief or tc.profile_all_ranks)
        self._logs_here = strategy.is_chief or tc.log_all_ranks
        self.grad_agreement: dict = {}
        self.loop_start = 0   # the step the running loop began at (for fault messages)
        self._runs = 0        # passes of the outer loop (an elastic engine may repeat it)

    # -- the run ---------------------------------------------------------------
    def fit(self) -> dict:
        """Train to `total_steps` (resuming from the latest checkpoint); return metrics.

        Every replica starts from the chief's state (its initial values, or
        the checkpoint it restored), even where workers cannot see its files;
        a pipeline whose processes built only their own stages starts each
        stage from its first worker's initial values.
        An elastic engine runs the loop again from its last commit after
        workers left or joined."""
        xla_cache.start()   # before this process's first XLA compilation
        restored = None
        if self.checkpointer:
            if self.checkpointer.candidates():
                self._hold_state()
            restored = self.checkpointer.restore_latest()
        state = self.trainer.state_variables
        try:
            with StopSignals(self.train_config.preemption_grace_s,
                             describe=self.strategy.describe_process) as signals:
                if self.elastic:
                    return self.elastic.train_elastic(lambda: self._train_to_end(signals), state)
                self._broadcast_state(restored is not None)
                self._restore_replica_state()
                return self._train_to_end(signals)
        finally:
            self.profiler.stop()
            self.tensorboard.close()
            xla_cache.publish()   # what this run compiled, for this host's other processes

    def _train_to_end(self, signals: StopSignals) -> dict:
        """The outer loop, from the step the state holds to `total_steps`."""
        if self._runs:   # run again by an elastic engine: the ranks were re-formed
            self._regrouped()
        self._runs += 1
        step = self.trainer.current_step()
        iterator = self.data.train_iterator(step)
        run = _Run(Progress(self.total_steps, start=step, enabled=self._logs_here,
                            metric_names=self.trainer.task.metric_names), signals)
        while step < self.total_steps:
            stop = self._next_stop(step)
            self.loop_start = step
            self.profiler.before_loop(step)
            started = time.perf_counter()
            totals = self.trainer.train_loop(iterator, stop - step,
                                             _due(self.train_config.grad_agreement_every, stop))
            seconds = time.perf_counter() - started
            if totals.nonfinite:
                rolled_back = self.nonfinite.react(totals, step)
                if rolled_back is not None:
                    step = rolled_back
                    continue
            self.profiler.after_loop(stop)
            examples = (stop - step) * self.trainer.global_batch_size
            self._time(run, examples, seconds)
            step = stop
            self._after_loop(run, step, totals, examples / seconds)
        self.trainer.gather_model()   # the trained model on the chief
        return self._final_metrics(run, step)

    def _next_stop(self, step: int) -> int:
        """The next step at which the outer loop must regain control."""
        tc = self.train_config
        stop = min(self.total_steps, step + tc.steps_per_loop)
        commit_every = self.elastic.commit_interval if self.elastic else 0
        for every in (tc.eval_every, tc.checkpoint_every, tc.log_every,
                      tc.grad_agreement_every, commit_every):
            if every:
                stop = min(stop, (step // every + 1) * every)
        for boundary in [*self.profiler.boundaries(), *self.trainer.compression.boundaries()]:
            if boundary > step:
                stop = min(stop, boundary)
        if tc.sync_every:   # local SGD: loops end where the weights are averaged
            stop = min(self.total_steps, -(-stop // tc.sync_every) * tc.sync_every)
        return stop

    @staticmethod
    def _time(run: _Run, examples: int, seconds: float) -> None:
        if not run.first_loop:
            run.timed_examples += examples
            run.timed_seconds += seconds
        run.first_loop = False

    # -- after each loop ---------------------------------------------------------
    def _after_loop(self, run: _Run, step: int, totals: LoopTotals,
                    examples_per_sec: float) -> None:
        tc = self.train_config
        run.train_metrics = self._train_metrics(totals, examples_per_sec)
        logged = dict(run.train_metrics)

        def due(every):
            return _passed(every, self.loop_start, step)

        if due(tc.grad_agreement_every) and totals.agreement is not None:
            self.grad_agreement = _agreement_metrics(totals.agreement)
            logged.update(self.grad_agreement)
        if due(tc.eval_every) or step == self.total_steps:
            run.eval_metrics = self.evaluate()
            logged.update(run.eval_metrics)
        if self.checkpointer and (due(tc.checkpoint_every) or step == self.total_steps):
            self._save(step, release=step < self.total_steps)
        if self.strategy.step_copies > 1:   # an explicit all-reduce
            logged["bytes_reduced_per_update"] = self.trainer.bytes_per_update
        scheduled = capability(self.strategy, ScheduledSteps)
        if scheduled:
            logged.update(scheduled.schedule_metrics())
        self.tensorboard.write(step, logged)
        run.progress.update(step, {**run.train_metrics, **run.eval_metrics},
                            log=not tc.log_every or due(tc.log_every)
                            or step == self.total_steps)
        self._check_signals(run.signals, step)
        if self.elastic:
            self.elastic.commit_if_due(step)

    def _train_metrics(self, totals: LoopTotals, examples_per_sec: float) -> dict:
        metrics = {**self.trainer.results(totals.counters),
                   "examples_per_sec": examples_per_sec,
                   **self._throughput(examples_per_sec),
                   "learning_rate": optimizers.current_learning_rate(self.trainer.optimizer),
                   "grad_norm": totals.grad_norm}
        loss_scale = Precision.loss_scale(self.trainer.optimizer)
        if loss_scale is not None:
            metrics["loss_scale"] = loss_scale
        return metrics

    def _throughput(self, examples_per_sec: float) -> dict:
        """Model TFLOP/s and MFU for a measured examples/sec (when known)."""
        if not self.flops_per_example:
            return {}
        metrics = {"tflops": flops_lib.model_tflops(examples_per_sec, self.flops_per_example)}
        if self.peak_tflops:
            metrics["mfu"] = flops_lib.mfu(examples_per_sec, self.flops_per_example,
                                           self.peak_tflops)
        return metrics

    def evaluate(self) -> dict:
        """Loss and metrics over the whole test split (exact, padding excluded)."""
        if self.data.eval_data is None:
            return {}
        counters = self.trainer.evaluate_counters(iter(self.data.eval_data),
                                                  self.data.eval_steps)
        return {f"test_{name}": value for name, value in self.trainer.results(counters).items()}

    def _final_metrics(self, run: _Run, step: int) -> dict:
        if not run.eval_metrics and self.data.eval_data is not None:
            run.eval_metrics = self.evaluate()  # resumed at the final step: still report it
        if run.timed_seconds:
            rate = run.timed_examples / run.timed_seconds
            run.train_metrics.update({"examples_per_sec": rate, **self._throughput(rate)})
        return {"steps": step, **run.train_metrics, **run.eval_metrics}

    # -- signals, rollback, membership ---------------------------------------------
    def _check_signals(self, signals: StopSignals, step: int) -> None:
        """After a loop: Ctrl-C stops here; SIGTERM on any worker makes every
        worker save at this same step and stop (`interrupts.py`)."""
        if signals.interrupted:
            raise KeyboardInterrupt
        if step < self.total_steps and self.strategy.any_worker(signals.preempted):
            saved = self._save(step, release=False) if self.checkpointer else None
            if saved is None and self.checkpointer and not self.strategy.is_chief:
                saved = "(by the chief)"
            raise Preempted(step, saved)

    # -- the state and its checkpoints -----------------------------------------------
    def _save(self, step: int, release: bool):
        """Checkpoint `step`: the whole state gathered onto the chief for the
        write (and released after it, if `release`), unless each process
        writes its own part."""
        whole = self.checkpointer.parts is None
        if whole:
            self.trainer.gather_state()
        saved = self.checkpointer.save(step)
        if whole and release:
            self.trainer.release_state()
        return saved

    def _hold_state(self) -> None:
        """Before a restore: where the chief restores the whole state, storage
        for every variable (a restore writes each); where each process reads
        its own part, nothing."""
        if self.checkpointer.parts is None:
            self.trainer.hold_state()

    def _broadcast_state(self, restored: bool) -> None:
        """Every replica starts from the chief's state, unless each process
        restored its own part in place."""
        if not (restored and self.checkpointer and self.checkpointer.parts is not None):
            self.trainer.broadcast_state(restored)

    def _broadcast_restored(self) -> int:
        """After a rollback's restore: the restored state everywhere; the step."""
        self._broadcast_state(True)
        self._restore_replica_state()
        return self.trainer.current_step()

    def _restore_replica_state(self) -> None:
        """Every process: its replicas' own state of the step resumed from
        (after the chief's state was broadcast), where it keeps any."""
        step = self.trainer.current_step()
        if step and self.checkpointer and self.checkpointer.replica_state is not None:
            self.checkpointer.replica_state.restore(step)

    def _regrouped(self) -> None:
        """Workers left or joined (elastic): the number of replicas, this
        process's rank and who is chief may all have changed."""
        strategy, tc = self.strategy, self.train_config
        chief, batch = strategy.is_chief, self.trainer.global_batch_size
        logs.configure(strategy, log_all_ranks=tc.log_all_ranks)   # "[rank 0/1 chief]"
        if chief:
            logging.set_verbosity(logging.INFO)
        replicas = strategy.num_replicas
        if batch % (replicas * tc.accum_steps):
            raise WorkerFault(f"{strategy.describe_process()}: the ranks changed to "
                              f"{replicas}, which do not divide --global_batch_size="
                              f"{batch} (x --accum_steps={tc.accum_steps})")
        logging.warning("%s: now %d replica(s) (global batch %d = %d x %d); going on from "
                        "step %d", strategy.describe_process(), replicas, batch, replicas,
                        batch // replicas, self.trainer.current_step())
        self.trainer.compile_loops()
        self._logs_here = chief or tc.log_all_ranks
        self.tensorboard.enabled = bool(tc.model_dir) and chief
        if self.checkpointer:
            self.checkpointer.is_chief = chief


def _agreement_metrics(values) -> dict:
    cosines = [float(v) for v in values]
    metrics = {"grad_agreement_min": min(cosines),
               "grad_agreement_mean": sum(cosines) / len(cosines)}
    metrics.update({f"grad_agreement_replica_{i}": c for i, c in enumerate(cosines)})
    return metrics
