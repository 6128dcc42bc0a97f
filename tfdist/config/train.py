"""The training loop's part of the run configuration: how long, the
gradient exchange, precision and speed, faults and output."""

from __future__ import annotations

from typing import Optional

from tfdist.config.options import (check_fields, finite, finite_non_negative, non_negative,
                                   one_of, option, part, positive, seconds, seed)
from tfdist.errors import ConfigError

GRAD_COMPRESSION = ("none", "fp16", "bf16", "powersgd", "topk")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
JIT_COMPILE = ("auto", "on", "off")
ON_NONFINITE = ("stop", "skip", "rollback")
# Losses and metrics by name for models that end in logits over classes (the
# bundled builders; `tfdist.train` also takes any Keras loss and metrics).
LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy",
          "categorical_focal_crossentropy")
METRICS = ("accuracy", "top5_accuracy", "crossentropy")
# The engines whose replicas keep their own state (error feedback, local SGD).
REPLICA_STATE = ("mirrored", "multi_worker", "horovod")
DEFAULT_TRAIN_STEPS = 1000   # where neither train_steps nor epochs is given
SPEED, NETWORK = "precision and speed", "slow network"


def _metrics(name, value):
    for metric in value:
        one_of(name, metric, METRICS)


def _fraction(name, value):
    if not (finite(value) and 0 < value <= 1):
        raise ConfigError(f"{name}={value!r} must be in (0, 1] (the share of each matrix's "
                          "entries sent, e.g. 0.01)")


def _label_smoothing(name, value):
    if not 0 <= value < 1:
        raise ConfigError(f"{name}={value!r} must be in [0, 1)")


def _profile_steps(name, value):
    if value and (len(value) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                         for s in value) or value[0] > value[1]):
        raise ConfigError(f"{name}={value!r} must be two steps A,B with 1 <= A <= B, e.g. "
                          "20,25")


@part
class TrainConfig:
    """The outer loop: how long, how often to evaluate, log and checkpoint."""

    global_batch_size: int = option(
        128, lower=1, check=positive, group="training", math=True,
        help="Examples per update over all replicas (split evenly between them).")
    train_steps: Optional[int] = option(   # exactly one of train_steps / epochs
        None, lower=1, check=positive, group="training", math=True,
        help="Updates to train for (the final global step). Default: "
             f"{DEFAULT_TRAIN_STEPS} if --epochs is unset.")
    epochs: Optional[int] = option(None, lower=1, check=positive, group="training", math=True,
                                   help="Epochs to train for (instead of --train_steps).")
    steps_per_loop: int = option(
        50, lower=1, check=positive, group=SPEED, tunable=(10, 50, 200),
        help="Steps run inside one tf.function call between host syncs.")
    accum_steps: int = option(
        1, lower=1, check=positive, group="training", tunable=(1, 2, 4, 8),
        help="Micro-batches per update (gradient accumulation); gradients are reduced across "
             "replicas once per update. Under --strategy=pipeline (or --microbatches): the "
             "micro-batches that flow through the stages.")
    sync_batchnorm: bool = option(
        False, group="training", math=True,
        engines=("default", "mirrored", "multi_worker", "horovod", "dtensor"),
        help="BatchNormalization normalises with the statistics of the global batch (its "
             "moments all-reduced in the forward pass, gradients through the reduction), "
             "not each replica's: mirrored and multi_worker (Keras's synchronized=True, which "
             "a layer of your own may also set) and horovod (Horovod's all-reduce); dtensor "
             "and one device have them already. Not with accumulation (each micro-batch has "
             "its own statistics).")
    grad_compression: str = option(
        "none", choices=GRAD_COMPRESSION, group=NETWORK, math=True,
        tunable=GRAD_COMPRESSION,
        help="How gradients cross replicas. fp16/bf16: cast for the sum (half the bytes), "
             "every strategy. powersgd: each matrix as rank --powersgd_rank factors (two "
             "all-reduces); topk: the largest --topk_fraction of each matrix's entries (an "
             "all-gather); both with per-replica error feedback, 1-D tensors sent whole; "
             "mirrored, multi_worker and horovod.")
    powersgd_rank: int = option(
        4, lower=1, check=positive, group=NETWORK, math=True, engines=REPLICA_STATE,
        help="--grad_compression=powersgd: the rank of each matrix's factors (at most its "
             "smaller dimension, for a matrix it compresses).")
    powersgd_min_compression: float = option(
        2.0, lower=0, check=finite_non_negative, group=NETWORK, math=True, engines=REPLICA_STATE,
        help="--grad_compression=powersgd: a matrix is compressed only where its rank "
             "--powersgd_rank factors are at least this many times smaller than it "
             "(n*m >= this * rank * (n+m); PyTorch's min_compression_rate); the others are "
             "summed whole, as 1-D tensors are. 0: every matrix.")
    topk_fraction: float = option(
        0.01, check=_fraction, group=NETWORK, math=True, engines=REPLICA_STATE,
        help="--grad_compression=topk: the share of each matrix's entries each replica sends "
             "per update, in (0, 1].")
    compression_warmup_steps: int = option(
        0, lower=0, check=non_negative, group=NETWORK, math=True, engines=REPLICA_STATE,
        help="powersgd: gradients are summed uncompressed for the first N steps (PyTorch's "
             "start_powerSGD_iter); topk: over the first N steps the share sent falls from "
             "25% to --topk_fraction in four stages (deep gradient compression's warm-up). "
             "0: none.")
    sync_every: int = option(
        0, lower=0, check=non_negative, group=NETWORK, math=True, engines=REPLICA_STATE,
        help="Local SGD: each replica steps its own optimizer on its own gradients, and the "
             "weights are averaged every N steps (optimizer state stays per replica); loops, "
             "logs, evaluations and checkpoints happen at those averages. 0: gradients "
             "summed at every step. mirrored, multi_worker and horovod.")
    precision: str = option(
        "float32", choices=PRECISIONS, group=SPEED, math=True, tunable=PRECISIONS[:2],
        help="Keras dtype policy: float32, mixed_bfloat16, or mixed_float16 (with dynamic "
             "loss scaling). Logits and loss stay float32.")
    loss_scale_growth_steps: int = option(
        2000, lower=1, check=positive, group=SPEED, math=True,
        help="mixed_float16: finite steps before the loss scale doubles (a non-finite step "
             "halves it and is skipped).")
    eval_every: int = option(0, lower=0, check=non_negative, group="training",
                             help="Evaluate on the test split every N steps (0: only at the "
                                  "end).")
    log_every: int = option(0, lower=0, check=non_negative, group="output",
                            help="Log a progress line every N steps (0: after every loop).")
    checkpoint_every: int = option(0, lower=0, check=non_negative, group="output",
                                   help="Save a checkpoint every N steps (0: only at the end).")
    keep_checkpoints: int = option(3, lower=1, check=positive, group="output",
                                   help="Checkpoints to keep.")
    checkpoint_input: bool = option(
        True, group="output",
        help="Save the input position with every checkpoint (--autoshard=global: the "
             "examples read, valid under any engine and worker count; otherwise each "
             "pipeline's iterator, its shuffle buffer included), so a resumed run reads "
             "exactly the batches an uninterrupted one reads; off: a resumed run draws a "
             "fresh permutation.")
    model_dir: Optional[str] = option(
        None, group="output",
        help="Directory for checkpoints and summary.json; a run resumes from its latest "
             "checkpoint. Default: none (nothing written).")
    export_dir: Optional[str] = option(
        None, group="output",
        help="After training, the chief writes model.keras and a SavedModel with a serving "
             "signature (saved_model/) here.")
    seed: int = option(42, lower=0, check=seed, group="training", math=True,
                       help="Seed for weights, shuffling and synthetic data.")
    # `tfdist.train(loss=, metrics=)` or a compiled model take precedence.
    loss: str = option(
        "sparse_categorical_crossentropy", choices=LOSSES, group="training", math=True,
        help="Loss on the model's logits and the dataset's class labels (your own Keras "
             "loss: tfdist.train(loss=...)).")
    metrics: tuple = option(
        ("accuracy",), check=_metrics, group="training",
        help="Metrics reported in progress lines, the summary and TensorBoard: any of "
             f"{', '.join(METRICS)} (your own: tfdist.train(metrics=...)).")
    label_smoothing: float = option(
        0.0, lower=0.0, upper=0.999, check=_label_smoothing, group="training", math=True,
        help="Label smoothing of the categorical losses.")
    jit_compile: str = option(
        "auto", choices=JIT_COMPILE, group=SPEED, tunable=("on", "off"),
        help="XLA for the replica step: on (forward, backward and the fused optimizer "
             "update; the cross-replica sum stays outside XLA), off, or auto (picked by "
             "--precision and the CPU's ISA; the start-up log says what it chose).")
    fused_batchnorm: bool = option(
        True, group=SPEED,
        help="BatchNormalization layers (channels last, no renorm, not synchronized) "
             "normalise with TensorFlow's fused kernel, one op forward and one backward, as "
             "Keras 2 did, instead of Keras 3's dozen element-wise passes: the same "
             "statistics up to float rounding; the cnn trained 1.81x faster in "
             "mixed_bfloat16 and 1.30x in float32 on an AMX Xeon. Not under dtensor (no "
             "layout rule for the fused op). --nofused_batchnorm keeps Keras's own.")
    profile_steps: tuple = option(
        (), check=_profile_steps, item=int, group=SPEED,
        help="Capture a TensorFlow profiler trace of global steps A,B (inclusive) into "
             "model_dir/tensorboard (TensorBoard's profile tab); needs --model_dir.")
    profile_all_ranks: bool = option(
        False, group=SPEED,
        help="--profile_steps on every worker/rank (each in its own directory), not only the "
             "chief.")
    log_all_ranks: bool = option(
        False, group="output",
        help="Progress lines from every worker/rank; by default only the chief logs progress "
             "(warnings and errors show from every rank).")
    grad_agreement_every: int = option(
        0, lower=0, check=non_negative, group="output",
        help="Every N steps, measure the cosine similarity of each replica's gradient with "
             "the cross-replica mean (data-parallel engines; TensorBoard and summary); 0: "
             "never.")
    reduce_bucket_mb: float = option(
        0.0, lower=0.0, check=finite_non_negative, group=SPEED, tunable=(0.0, 25.0),
        help="Reduce gradients across replicas in buckets of about this many MB, each issued "
             "as soon as the backward pass has produced it, so communication overlaps "
             "computation (DDP's buckets, Horovod's tensor fusion); 0: one reduction after "
             "the whole backward pass. Not with --accum_steps > 1 (its one reduction follows "
             "the last micro-batch anyway).")
    preemption_grace_s: float = option(
        25.0, lower=0.1, check=seconds, group="faults",
        help="On SIGTERM every worker finishes its current loop, saves one checkpoint at the "
             "same step and exits with status 143 within this many seconds (else exits 143 "
             "without saving).")
    on_nonfinite: str = option(
        "stop", choices=ON_NONFINITE, group="faults", math=True,
        help="A step whose loss is NaN or infinite: stop (one line naming the step and the "
             "last good checkpoint), skip its update (all replicas agree), or rollback to the "
             "last checkpoint and continue past the offending batches (needs --model_dir).")
    max_rollbacks: int = option(3, lower=0, check=non_negative, group="faults",
                                help="--on_nonfinite=rollback: stop after this many "
                                     "rollbacks.")

    def __post_init__(self):
        if (self.train_steps is None) == (self.epochs is None):
            raise ConfigError(f"train_steps={self.train_steps!r}, epochs={self.epochs!r}: "
                              "set exactly one of them")
        check_fields(self)
        if self.label_smoothing and self.loss == "sparse_categorical_crossentropy":
            raise ConfigError(f"label_smoothing={self.label_smoothing!r} needs "
                              "loss=categorical_crossentropy or categorical_focal_crossentropy "
                              "(Keras's sparse loss has no label smoothing)")
        _check_exchange(self)
        if self.sync_batchnorm and self.accum_steps > 1:
            raise ConfigError(f"sync_batchnorm with accum_steps={self.accum_steps}: each "
                              "micro-batch would normalise with its own statistics, not the "
                              "global batch's; use accum_steps=1")
        if self.on_nonfinite == "rollback" and not self.model_dir:
            raise ConfigError("on_nonfinite='rollback' restores the last checkpoint: set "
                              "model_dir (or use on_nonfinite=skip)")


def _check_exchange(tc) -> None:
    """The rules between the compression and local-SGD settings of `tc`."""
    stateful = tc.grad_compression in ("powersgd", "topk")
    if stateful and tc.reduce_bucket_mb:
        raise ConfigError(f"reduce_bucket_mb={tc.reduce_bucket_mb:g} with grad_compression="
                          f"{tc.grad_compression}: its exchange is made of its own "
                          "collectives; use reduce_bucket_mb=0")
    if stateful and tc.precision == "mixed_float16":
        raise ConfigError(f"grad_compression={tc.grad_compression} keeps error feedback "
                          "across updates, which mixed_float16's changing loss scale would "
                          "mis-scale; use precision=mixed_bfloat16 or float32")
    if tc.sync_every:
        why = _local_sgd_conflict(tc)
        if why:
            raise ConfigError(f"sync_every={tc.sync_every} (local SGD) with {why}")


def _local_sgd_conflict(tc) -> Optional[str]:
    if tc.accum_steps > 1:
        return (f"accum_steps={tc.accum_steps}: local steps already average over the "
                "replica's own batch; use accum_steps=1")
    if tc.grad_compression != "none":
        return (f"grad_compression={tc.grad_compression}: local SGD sends weights, not "
                "gradients; use grad_compression=none")
    if tc.reduce_bucket_mb:
        return f"reduce_bucket_mb={tc.reduce_bucket_mb:g}: no gradients are reduced"
    if tc.precision == "mixed_float16":
        return ("precision=mixed_float16: each replica's loss scale would follow its own "
                "gradients; use precision=mixed_bfloat16 or float32")
    if tc.grad_agreement_every:
        return (f"grad_agreement_every={tc.grad_agreement_every}: no summed gradient to "
                "compare with")
    return None
