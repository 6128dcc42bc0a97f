"""Run configuration: frozen dataclasses, validated on construction.

This module knows nothing about absl flags or TensorFlow state, so the Python
API (`tfdist.train(RunConfig(...))`) and the CLI share one source of truth.
Every check here quotes the bad value and says what would be valid; the app
turns `ConfigError` into a one-line message and exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

from tfdist import sharding
from tfdist.errors import ConfigError, UsageError

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
COLLECTIVES = ("auto", "ring", "nccl")
AUTOSHARD = ("global", "auto", "file", "data", "off")
GRAD_COMPRESSION = ("none", "fp16", "bf16", "powersgd", "topk")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
LR_SCALING = ("none", "linear", "sqrt")
LR_DECAY = ("constant", "cosine")
JIT_COMPILE = ("auto", "on", "off")
ON_NONFINITE = ("stop", "skip", "rollback")
# --task_type with --worker_hosts/--ps_hosts (parameter_server).
TASK_TYPES = ("worker", "ps", "chief")
# Losses and metrics by name for models that end in logits over classes (the
# bundled builders; `tfdist.train` also takes any Keras loss and metrics).
LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy",
          "categorical_focal_crossentropy")
METRICS = ("accuracy", "top5_accuracy", "crossentropy")


def _one_of(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not known; valid: {', '.join(valid)}")


# Integers end up in TensorFlow int64 tensors (and the seed in NumPy's
# 32-bit legacy seeding), so larger ones fail deep inside a run.
INT_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1


def _too_large(name: str, value, most: int) -> None:
    if value > most:
        raise ConfigError(f"{name}={value!r} is too large; at most {most}")


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    _too_large(name, value, INT_MAX)


def _non_negative(name: str, value, most: int = INT_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be an integer >= 0")
    _too_large(name, value, most)


# Timeouts beyond a week are a typo, and beyond ~2**31 s they overflow
# time.sleep and TensorFlow's int64 microsecond timeouts deep inside a run.
SECONDS_MAX = 7 * 24 * 3600


def _seconds(name: str, value) -> None:
    if not (_finite(value) and 0 < value <= SECONDS_MAX):
        raise ConfigError(f"{name}={value!r} must be a number of seconds > 0 and at most "
                          f"{SECONDS_MAX} (a week)")


def _finite(value) -> bool:
    """A real number other than inf and nan (nan and inf pass `> 0` checks)."""
    return (not isinstance(value, bool) and isinstance(value, numbers.Real)
            and math.isfinite(value))


class _Replace:
    """`part.replace(field=value)`: a validated copy with some fields changed."""

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


ZERO_STAGES = (0, 1, 2, 3)
PIPELINE_SCHEDULES = ("1f1b", "gpipe")   # tfdist.pipeline.schedule.SCHEDULES


@dataclasses.dataclass(frozen=True)
class StrategyConfig(_Replace):
    """Which engine runs the replicas and how it is set up."""

    name: str = "mirrored"
    # Split the CPU into this many logical devices when no GPU is present, so
    # multi-device code runs for real on a CPU-only host. None: leave as is.
    virtual_devices: Optional[int] = None
    # Multi-worker: cross-worker collectives and their limits.
    collective: str = "auto"            # auto | ring | nccl
    collective_timeout_s: float = 60.0  # a collective (or a silent peer) fails after this
    bytes_per_pack: int = 0             # 0: TensorFlow's default packing
    # Alternative to TF_CONFIG (as in TensorFlow Model Garden): this host's
    # index in a comma-separated host:port list.
    worker_hosts: tuple = ()
    task_index: Optional[int] = None
    # parameter_server without TF_CONFIG: the parameter servers' host:port
    # list, and which list --task_index indexes (worker: --worker_hosts, whose
    # first entry is the chief; ps: --ps_hosts).
    ps_hosts: tuple = ()
    task_type: str = "worker"
    # parameter_server: split a variable over the parameter servers in shards
    # of at least this many bytes (MinSizePartitioner); 0: never split.
    ps_shard_bytes: int = 256 << 10
    # dtensor: the device mesh (batch x model axes) and the ZeRO stage: what is
    # also split over the mesh's batch axis (1: optimizer state; 2: + gradients;
    # 3: + the variables themselves, gathered for use: FSDP).
    # `shard_optimizer_state` is the older name of stage 1 (an alias: a higher
    # stage, which includes stage 1, wins).
    mesh: str = "batch:1,model:2"
    zero_stage: int = 0
    shard_optimizer_state: bool = False
    # horovod under an elastic horovodrun (--min-np/--max-np): the training
    # state lives in Horovod's elastic state object, committed every
    # elastic_commit_every steps (0: at the end of every loop, i.e. every
    # steps_per_loop steps); when a rank dies the others roll back to the
    # last commit and go on, and ranks that join start from it.
    elastic: bool = False
    elastic_commit_every: int = 0
    # pipeline: the model split into this many stages, one per device; the
    # micro-batches (TrainConfig.accum_steps) flow through them on this
    # schedule; the split balanced by FLOPs, or starting stages 2..S at these
    # layer names.
    pipeline_stages: int = 2
    pipeline_schedule: str = "1f1b"
    pipeline_split: tuple = ()

    def __post_init__(self):
        _positive("virtual_devices", self.virtual_devices, allow_none=True)
        if self.collective not in COLLECTIVES:
            raise ConfigError(f"collective={self.collective!r} is not known; valid: "
                              f"{', '.join(COLLECTIVES)}")
        _seconds("collective_timeout_s", self.collective_timeout_s)
        _non_negative("bytes_per_pack", self.bytes_per_pack)
        _non_negative("elastic_commit_every", self.elastic_commit_every)
        _one_of("task_type", self.task_type, TASK_TYPES)
        _non_negative("ps_shard_bytes", self.ps_shard_bytes)
        _positive("pipeline_stages", self.pipeline_stages)
        _one_of("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        if isinstance(self.pipeline_split, str) or not all(
                isinstance(n, str) and n for n in self.pipeline_split):
            raise ConfigError(f"pipeline_split={self.pipeline_split!r} must be a tuple of "
                              "layer names, e.g. ('block_2',)")
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"zero_stage={self.zero_stage!r} is not a ZeRO stage; valid: "
                              f"{', '.join(map(str, ZERO_STAGES))}")
        try:
            sharding.parse_mesh(self.mesh)
        except UsageError as error:
            raise ConfigError(str(error)) from None

    @property
    def zero(self) -> int:
        """The ZeRO stage in effect (`shard_optimizer_state` is stage 1)."""
        return max(self.zero_stage, 1 if self.shard_optimizer_state else 0)


@dataclasses.dataclass(frozen=True)
class ModelConfig(_Replace):
    """Which registered model builder to use, and its size knobs."""

    name: str = "cnn"
    width: int = 32          # hidden units (mlp), base channels (cnn), model dim (transformer)
    depth: int = 2           # hidden layers (mlp), residual blocks per stage (cnn), blocks (transformer)
    num_heads: int = 4       # transformer attention heads
    recompute: bool = False  # recompute each block's activations in the backward pass

    def __post_init__(self):
        _positive("width", self.width)
        _positive("depth", self.depth)
        _positive("num_heads", self.num_heads)


@dataclasses.dataclass(frozen=True)
class DataConfig(_Replace):
    """Where examples come from."""

    dataset: str = "tfdist_shapes"
    data_dir: Optional[str] = None   # None: TFDS default (~/tensorflow_datasets or $TFDS_DATA_DIR)
    synthetic: bool = False          # random tensors of the dataset's shapes, for benchmarking
    shuffle_buffer: int = 10_000
    # How training input is split between input pipelines (workers):
    # global: every pipeline reads every example in one seeded order and keeps
    # its rows of each global batch (the same batches on every engine and
    # cluster size; a checkpoint resumes under any of them);
    # file: each reads its own files; data: each reads its own examples;
    # off: each reads everything (differently shuffled); auto: file if the
    # split has enough files, else data. The last four read less per worker
    # but give batches that depend on the number of workers.
    autoshard: str = "global"
    # Images: resize to image_size x image_size (None: as stored; needed for
    # datasets whose images differ in size).
    image_size: Optional[int] = None
    # Text: a TextVectorization vocabulary of at most vocab_size tokens,
    # adapted on the train split (cached in model_dir), and token sequences
    # padded or cut to sequence_length.
    vocab_size: int = 20_000
    sequence_length: int = 256

    def __post_init__(self):
        if not self.dataset:
            raise ConfigError("dataset='' must name a TFDS dataset, e.g. tfdist_shapes")
        if any(c.isspace() or not c.isprintable() for c in self.dataset):
            raise ConfigError(f"dataset={self.dataset!r} is not a TFDS dataset name (no spaces "
                              "or control characters), e.g. tfdist_shapes or mnist:3.0.1")
        _positive("image_size", self.image_size, allow_none=True)
        _positive("vocab_size", self.vocab_size)
        _positive("sequence_length", self.sequence_length)
        if self.autoshard not in AUTOSHARD:
            raise ConfigError(f"autoshard={self.autoshard!r} is not known; valid: "
                              f"{', '.join(AUTOSHARD)}")
        _positive("shuffle_buffer", self.shuffle_buffer)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(_Replace):
    name: str = "adam"
    learning_rate: float = 1e-3
    momentum: float = 0.9            # used by `momentum`
    weight_decay: float = 1e-4       # used by `adamw`
    # learning_rate is tuned for base_batch_size; the peak rate follows the
    # global batch by lr_scaling, reached by a linear warm-up, then lr_decay.
    lr_scaling: str = "none"
    base_batch_size: int = 128
    warmup_steps: int = 0
    lr_decay: str = "constant"
    clip_grad_norm: Optional[float] = None   # global-norm clipping of the reduced gradient

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"optimizer={self.name!r} is not known; valid: {', '.join(OPTIMIZERS)}")
        if not (_finite(self.learning_rate) and self.learning_rate > 0):
            raise ConfigError(f"learning_rate={self.learning_rate!r} must be a finite number > 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum!r} must be in [0, 1)")
        if not (_finite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be a finite number >= 0")
        _one_of("lr_scaling", self.lr_scaling, LR_SCALING)
        _one_of("lr_decay", self.lr_decay, LR_DECAY)
        _positive("base_batch_size", self.base_batch_size)
        _non_negative("warmup_steps", self.warmup_steps)
        if self.clip_grad_norm is not None and not (
                _finite(self.clip_grad_norm) and self.clip_grad_norm > 0):
            raise ConfigError(f"clip_grad_norm={self.clip_grad_norm!r} must be a finite number > 0")


@dataclasses.dataclass(frozen=True)
class TrainConfig(_Replace):
    """The outer loop: how long, how often to evaluate, log and checkpoint."""

    global_batch_size: int = 128
    train_steps: Optional[int] = None   # exactly one of train_steps / epochs
    epochs: Optional[int] = None
    steps_per_loop: int = 50            # steps run inside one tf.function call
    accum_steps: int = 1                # micro-batches per update (gradient accumulation)
    # How gradients cross replicas: none | fp16 | bf16 (the sum's dtype) |
    # powersgd (rank-`powersgd_rank` factors) | topk (the largest
    # `topk_fraction` of each matrix's entries), the last two with error feedback.
    grad_compression: str = "none"
    powersgd_rank: int = 4
    topk_fraction: float = 0.01
    # powersgd: uncompressed for this many steps; topk: DGC's density warm-up over them.
    compression_warmup_steps: int = 0
    # Local SGD: every replica steps on its own gradients and the weights are
    # averaged every `sync_every` steps; 0: gradients summed at every step.
    sync_every: int = 0
    precision: str = "float32"          # float32 | mixed_bfloat16 | mixed_float16
    loss_scale_growth_steps: int = 2000  # mixed_float16: finite steps before the scale doubles
    eval_every: int = 0                 # steps between evaluations; 0: only at the end
    log_every: int = 0                  # steps between log lines; 0: every loop
    checkpoint_every: int = 0           # steps between checkpoints; 0: only at the end
    keep_checkpoints: int = 3
    # Save the input position with every checkpoint, for an exact resume
    # (the global order's examples read; with per-pipeline sharding each
    # pipeline's tf.data iterator state, shuffle buffer included).
    checkpoint_input: bool = True
    model_dir: Optional[str] = None     # None: no checkpoints, no summary file
    # After training the chief writes model.keras and a SavedModel here.
    export_dir: Optional[str] = None
    seed: int = 42
    # The loss and metrics by name, for models ending in class logits (the
    # bundled builders); `tfdist.train(loss=, metrics=)` or a compiled model
    # take precedence.
    loss: str = "sparse_categorical_crossentropy"
    metrics: tuple = ("accuracy",)
    label_smoothing: float = 0.0        # categorical losses only
    # XLA for the replica step: on, off, or auto (by precision, engine, model
    # and CPU ISA; tfdist/training/xla.py).
    jit_compile: str = "auto"
    # TensorBoard profiler trace of global steps [first, last] (inclusive); ().
    profile_steps: tuple = ()
    profile_all_ranks: bool = False     # trace on every worker/rank, not only the chief
    log_all_ranks: bool = False         # progress lines from every worker, not only the chief
    # Every N steps, the cosine similarity of each replica's gradient with the
    # cross-replica mean (data-parallel engines); 0: never.
    grad_agreement_every: int = 0
    # Reduce gradients in buckets of about this many MB, each issued as soon
    # as its gradients exist (overlapping the backward pass); 0: one reduction.
    reduce_bucket_mb: float = 0.0
    # On SIGTERM: finish the current loop, save, exit 143, all within this time.
    preemption_grace_s: float = 25.0
    # A non-finite loss: stop (one line naming the step and the last good
    # checkpoint), skip that update (every replica agrees), or rollback to the
    # last checkpoint and go on past the offending batches (at most
    # max_rollbacks times; needs model_dir).
    on_nonfinite: str = "stop"
    max_rollbacks: int = 3

    def __post_init__(self):
        _positive("global_batch_size", self.global_batch_size)
        if (self.train_steps is None) == (self.epochs is None):
            raise ConfigError(
                f"train_steps={self.train_steps!r}, epochs={self.epochs!r}: "
                "set exactly one of them")
        _positive("train_steps", self.train_steps, allow_none=True)
        _positive("epochs", self.epochs, allow_none=True)
        _positive("steps_per_loop", self.steps_per_loop)
        _positive("accum_steps", self.accum_steps)
        _one_of("grad_compression", self.grad_compression, GRAD_COMPRESSION)
        _check_exchange_config(self)
        _one_of("precision", self.precision, PRECISIONS)
        _positive("loss_scale_growth_steps", self.loss_scale_growth_steps)
        _non_negative("eval_every", self.eval_every)
        _non_negative("log_every", self.log_every)
        _non_negative("checkpoint_every", self.checkpoint_every)
        _positive("keep_checkpoints", self.keep_checkpoints)
        _non_negative("seed", self.seed, most=SEED_MAX)
        _one_of("loss", self.loss, LOSSES)
        for metric in self.metrics:
            _one_of("metrics", metric, METRICS)
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"label_smoothing={self.label_smoothing!r} must be in [0, 1)")
        if self.label_smoothing and self.loss == "sparse_categorical_crossentropy":
            raise ConfigError(f"label_smoothing={self.label_smoothing!r} needs "
                              "loss=categorical_crossentropy or categorical_focal_crossentropy "
                              "(Keras's sparse loss has no label smoothing)")
        _one_of("jit_compile", self.jit_compile, JIT_COMPILE)
        if self.profile_steps:
            steps = tuple(self.profile_steps)
            if (len(steps) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                       for s in steps) or steps[0] > steps[1]):
                raise ConfigError(f"profile_steps={self.profile_steps!r} must be two steps "
                                  "A,B with 1 <= A <= B, e.g. 20,25")
        _non_negative("grad_agreement_every", self.grad_agreement_every)
        if not (_finite(self.reduce_bucket_mb) and self.reduce_bucket_mb >= 0):
            raise ConfigError(f"reduce_bucket_mb={self.reduce_bucket_mb!r} must be a finite "
                              "number >= 0")
        _one_of("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        _non_negative("max_rollbacks", self.max_rollbacks)
        if self.on_nonfinite == "rollback" and not self.model_dir:
            raise ConfigError("on_nonfinite='rollback' restores the last checkpoint: set "
                              "model_dir (or use on_nonfinite=skip)")
        _seconds("preemption_grace_s", self.preemption_grace_s)


def _check_exchange_config(tc) -> None:
    """The compression and local-SGD settings of `TrainConfig` `tc`."""
    _positive("powersgd_rank", tc.powersgd_rank)
    if not (_finite(tc.topk_fraction) and 0 < tc.topk_fraction <= 1):
        raise ConfigError(f"topk_fraction={tc.topk_fraction!r} must be in (0, 1] (the share "
                          "of each matrix's entries sent, e.g. 0.01)")
    _non_negative("compression_warmup_steps", tc.compression_warmup_steps)
    _non_negative("sync_every", tc.sync_every)
    stateful = tc.grad_compression in ("powersgd", "topk")
    if stateful and tc.reduce_bucket_mb:
        raise ConfigError(f"reduce_bucket_mb={tc.reduce_bucket_mb:g} with grad_compression="
                          f"{tc.grad_compression}: its exchange is made of its own "
                          "collectives; use reduce_bucket_mb=0")
    if stateful and tc.precision == "mixed_float16":
        raise ConfigError(f"grad_compression={tc.grad_compression} keeps error feedback "
                          "across updates, which mixed_float16's changing loss scale would "
                          "mis-scale; use precision=mixed_bfloat16 or float32")
    if not tc.sync_every:
        return
    why = None
    if tc.accum_steps > 1:
        why = (f"accum_steps={tc.accum_steps}: local steps already average over the "
               "replica's own batch; use accum_steps=1")
    elif tc.grad_compression != "none":
        why = (f"grad_compression={tc.grad_compression}: local SGD sends weights, not "
               "gradients; use grad_compression=none")
    elif tc.reduce_bucket_mb:
        why = f"reduce_bucket_mb={tc.reduce_bucket_mb:g}: no gradients are reduced"
    elif tc.precision == "mixed_float16":
        why = ("precision=mixed_float16: each replica's loss scale would follow its own "
               "gradients; use precision=mixed_bfloat16 or float32")
    elif tc.grad_agreement_every:
        why = (f"grad_agreement_every={tc.grad_agreement_every}: no summed gradient to "
               "compare with")
    if why:
        raise ConfigError(f"sync_every={tc.sync_every} (local SGD) with {why}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs."""

    strategy: StrategyConfig = dataclasses.field(default_factory=StrategyConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(
        default_factory=lambda: TrainConfig(train_steps=1000))

    def replace(self, **parts) -> "RunConfig":
        """Copy with some parts swapped, e.g.
        `cfg.replace(train=cfg.train.replace(train_steps=200))`."""
        return dataclasses.replace(self, **parts)
