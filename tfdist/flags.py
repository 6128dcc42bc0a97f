"""The only module that defines or reads absl flags: flags -> `RunConfig`.

Every default comes from the `RunConfig` dataclasses (one source of truth for
the CLI and the Python API), with one exception: `--virtual_devices` is 2, so
`tfdist-train` on a CPU-only host runs 2 replicas, where the API's None leaves
the devices of a process that may already have started TensorFlow alone.
The main job's choices live in `configs/demo.cfg`; canned runs are flagfiles
in `configs/` (`--flagfile=configs/NAME.cfg`); flags after it override it.

A script of your own imports this module (`from tfdist import flags`), defines
its own flags beside these and calls `flags.run_config()` after absl parsed
the command line. A flag name defined twice (yours and tfdist's) ends the
program with one line naming it, exit status 2.
"""

from __future__ import annotations

import re
import sys

from absl import flags

from tfdist import config as config_lib
from tfdist.errors import UsageError

# The API's defaults, which the flags take.
_RUN = config_lib.RunConfig()
_STRATEGY_DEFAULTS, _MODEL_DEFAULTS, _DATA_DEFAULTS = _RUN.strategy, _RUN.model, _RUN.data
_OPTIMIZER_DEFAULTS, _TRAIN_DEFAULTS = _RUN.optimizer, _RUN.train
CLI_VIRTUAL_DEVICES = 2   # the documented exception (see above)


def _clash_hook(previous):
    """sys.excepthook: a flag defined by both tfdist and the user's script is
    reported in one line (absl raises DuplicateFlagError at import time)."""

    def hook(kind, error, traceback):
        if issubclass(kind, flags.DuplicateFlagError):
            found = re.search(r"flag '([^']+)' is defined twice\. First from (.+?), "
                              r"[Ss]econd from (.+?)\.(?:\s|$)", str(error))
            what = (f"--{found[1]} is defined twice, by {found[2]} and by {found[3]}"
                    if found else str(error).splitlines()[0])
            print(f"error: {what}: tfdist defines the flags of its README's flag reference; "
                  "rename yours", file=sys.stderr)
            sys.exit(2)
        previous(kind, error, traceback)
    return hook


sys.excepthook = _clash_hook(sys.excepthook)

# Registry names are listed in help text but checked after parsing (by the
# registries themselves), so the flags module never imports TensorFlow.
_STRATEGY = flags.DEFINE_string(
    "strategy", _STRATEGY_DEFAULTS.name,
    "Scale-out engine: default (one device), mirrored (all local devices), multi_worker "
    "(MultiWorkerMirroredStrategy over TF_CONFIG / --worker_hosts / Slurm), horovod "
    "(Horovod ranks under horovodrun; `make horovod` builds it), dtensor (tensor sharding "
    "over --mesh), parameter_server (asynchronous: ParameterServerStrategy with a chief, "
    "workers and parameter servers from TF_CONFIG / --worker_hosts --ps_hosts, or "
    "`tfdist-launch --workers=N --ps=P`).")
_VIRTUAL_DEVICES = flags.DEFINE_integer(
    "virtual_devices", CLI_VIRTUAL_DEVICES,
    "On a host without GPUs, split the CPU into this many logical devices so "
    "multi-device strategies run for real; 0 leaves the devices as they are.", lower_bound=0)

_WORKER_HOSTS = flags.DEFINE_list(
    "worker_hosts", [], "multi_worker without TF_CONFIG: every worker's host:port, in order "
    "(the same list on every host); TF_CONFIG is written from it.")
_TASK_INDEX = flags.DEFINE_integer(
    "task_index", None, "multi_worker: this host's index in --worker_hosts; parameter_server: "
    "its index in the list --task_type names.", lower_bound=0, upper_bound=config_lib.INT_MAX)
_PS_HOSTS = flags.DEFINE_list(
    "ps_hosts", list(_STRATEGY_DEFAULTS.ps_hosts), "parameter_server without TF_CONFIG: every "
    "parameter server's host:port (with --worker_hosts, whose first entry is the chief).")
_TASK_TYPE = flags.DEFINE_enum(
    "task_type", _STRATEGY_DEFAULTS.task_type, list(config_lib.TASK_TYPES),
    "parameter_server with --ps_hosts: this process's list, worker (--worker_hosts; entry 0 "
    "is the chief; chief is the same as worker 0) or ps (--ps_hosts).")
_PS_SHARD_BYTES = flags.DEFINE_integer(
    "ps_shard_bytes", _STRATEGY_DEFAULTS.ps_shard_bytes, "parameter_server: split variables "
    "over the parameter servers in shards of at least this many bytes (MinSizePartitioner); "
    "0: never split.", lower_bound=0)
_COLLECTIVE = flags.DEFINE_enum(
    "collective", _STRATEGY_DEFAULTS.collective, list(config_lib.COLLECTIVES),
    "multi_worker collective implementation (CommunicationOptions).")
_COLLECTIVE_TIMEOUT_S = flags.DEFINE_float(
    "collective_timeout_s", _STRATEGY_DEFAULTS.collective_timeout_s, "multi_worker: a collective that has not completed in this "
    "many seconds (e.g. a dead or never-started peer) fails the run.", lower_bound=1.0)
_BYTES_PER_PACK = flags.DEFINE_integer(
    "bytes_per_pack", _STRATEGY_DEFAULTS.bytes_per_pack, "multi_worker: pack gradients into all-reduces of about this many "
    "bytes (0: TensorFlow's default).", lower_bound=0)

_MESH = flags.DEFINE_string(
    "mesh", _STRATEGY_DEFAULTS.mesh,
    "dtensor: the device mesh, batch:B,model:M (B-way data parallel x M-way tensor "
    "sharding; B*M devices, e.g. --virtual_devices=B*M on a CPU host).")
_ZERO_STAGE = flags.DEFINE_enum(
    "zero_stage", str(_STRATEGY_DEFAULTS.zero_stage), ["0", "1", "2", "3"],
    "dtensor: what is also split over the mesh's batch axis (ZeRO). 0: nothing (each "
    "variable, gradient and optimizer slot is split by its layout rule only); 1: "
    "optimizer slots; 2: slots and gradients (reduce-scattered out of the backward "
    "pass); 3: slots, gradients and the variables themselves, each layer's gathered "
    "just before it computes and again in the backward pass (FSDP; one more forward "
    "pass per step). Per-device bytes of parameters + gradients + optimizer state "
    "fall towards 1/(batch x model) of one device's.")
_SHARD_OPTIMIZER_STATE = flags.DEFINE_boolean(
    "shard_optimizer_state", _STRATEGY_DEFAULTS.shard_optimizer_state,
    "dtensor: the older name of --zero_stage=1 (split optimizer slots over the batch "
    "axis); with a higher --zero_stage, which includes it, the higher stage applies.")
_ELASTIC = flags.DEFINE_boolean(
    "elastic", _STRATEGY_DEFAULTS.elastic,
    "horovod under an elastic horovodrun (--min-np/--max-np --host-discovery-script): keep "
    "the training state in Horovod's elastic state; when a rank dies the others roll back "
    "to the last commit and continue, and ranks that join start from it. Other strategies: "
    "an error.")
_ELASTIC_COMMIT_EVERY = flags.DEFINE_integer(
    "elastic_commit_every", _STRATEGY_DEFAULTS.elastic_commit_every,
    "--elastic: commit the training state (to host memory) every N steps, the most a rank's "
    "death loses; 0: at the end of every loop (every --steps_per_loop steps).", lower_bound=0)
_PRINT_LAYOUTS = flags.DEFINE_boolean(
    "print_layouts", False,
    "dtensor: print every variable's path, global shape, sharding spec and per-device "
    "bytes (and the per-device totals) for --model and --mesh, then exit.")

_PIPELINE_STAGES = flags.DEFINE_integer(
    "pipeline_stages", _STRATEGY_DEFAULTS.pipeline_stages,
    "pipeline: split the model into this many stages, one per device (with more devices, "
    "a multiple of S: devices/S pipeline replicas); the split is balanced by FLOPs over "
    "the model's blocks unless --pipeline_split names where stages begin.", lower_bound=1)
_PIPELINE_SCHEDULE = flags.DEFINE_enum(
    "pipeline_schedule", _STRATEGY_DEFAULTS.pipeline_schedule,
    list(config_lib.PIPELINE_SCHEDULES),
    "pipeline: the order of each stage's forward and backward passes over the "
    "--microbatches: 1f1b (one forward, one backward in turn: each stage holds at most "
    "S micro-batches' activations) or gpipe (every forward, then every backward: M).")
_PIPELINE_SPLIT = flags.DEFINE_list(
    "pipeline_split", list(_STRATEGY_DEFAULTS.pipeline_split),
    "pipeline: the layer names where stages 2..S begin (S-1 names, in model order; each "
    "must begin a block, where one tensor crosses); default: balanced by FLOPs.")
_PRINT_STAGES = flags.DEFINE_boolean(
    "print_stages", False,
    "pipeline: print each stage's device, layers, parameters and forward FLOPs for --model "
    "and --pipeline_stages, then exit.")

_MODEL = flags.DEFINE_string("model", _MODEL_DEFAULTS.name, "Model builder: mlp, cnn, transformer.")
_MODEL_WIDTH = flags.DEFINE_integer(
    "model_width", _MODEL_DEFAULTS.width, "Hidden units (mlp), base channels (cnn), model dim (transformer).", lower_bound=1,
    upper_bound=config_lib.INT_MAX)  # bounded here: its RunConfig field is `width`
_MODEL_DEPTH = flags.DEFINE_integer(
    "model_depth", _MODEL_DEFAULTS.depth, "Hidden layers (mlp), residual blocks per stage (cnn), blocks (transformer).", lower_bound=1,
    upper_bound=config_lib.INT_MAX)  # bounded here: its RunConfig field is `depth`
_NUM_HEADS = flags.DEFINE_integer("num_heads", _MODEL_DEFAULTS.num_heads, "Attention heads (transformer).", lower_bound=1)

_DATASET = flags.DEFINE_string(
    "dataset", _DATA_DEFAULTS.dataset,
    "TFDS dataset name: the bundled tfdist_shapes (images) or tfdist_tokens "
    "(token sequences), prepared offline on first use, or any TFDS dataset "
    "prepared in --data_dir.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", _DATA_DEFAULTS.data_dir, "TFDS data directory (default: $TFDS_DATA_DIR or ~/tensorflow_datasets).")
_SYNTHETIC = flags.DEFINE_boolean(
    "synthetic", _DATA_DEFAULTS.synthetic, "Feed random tensors of the dataset's shapes (benchmarking; no eval).")
_AUTOSHARD = flags.DEFINE_enum(
    "autoshard", _DATA_DEFAULTS.autoshard, list(config_lib.AUTOSHARD),
    "How training input is split across workers: global (every worker reads every example "
    "in one seeded order and keeps its rows of each global batch: the same batches on every "
    "engine and worker count, and checkpoints resume under any of them), file (each reads "
    "its own files), data (each reads its own examples), off (each reads all, shuffled "
    "differently), auto (file when the split has enough files, else data).")
_SHUFFLE_BUFFER = flags.DEFINE_integer("shuffle_buffer", _DATA_DEFAULTS.shuffle_buffer, "Examples in the shuffle buffer.", lower_bound=1)

_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", _TRAIN_DEFAULTS.global_batch_size, "Examples per update over all replicas (split evenly between them).", lower_bound=1)
_TRAIN_STEPS = flags.DEFINE_integer(
    "train_steps", None, "Updates to train for (the final global step). Default: "
    f"{_TRAIN_DEFAULTS.train_steps} if --epochs is unset.", lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", None, "Epochs to train for (instead of --train_steps).", lower_bound=1)
_STEPS_PER_LOOP = flags.DEFINE_integer(
    "steps_per_loop", _TRAIN_DEFAULTS.steps_per_loop, "Steps run inside one tf.function call between host syncs.", lower_bound=1)
_ACCUM_STEPS = flags.DEFINE_integer(
    "accum_steps", _TRAIN_DEFAULTS.accum_steps, "Micro-batches per update (gradient accumulation); gradients are reduced "
    "across replicas once per update. Under --strategy=pipeline (or --microbatches): "
    "the micro-batches that flow through the stages.", lower_bound=1)
# The pipeline's name for the same number (GPipe's M). Its own flag, not an
# absl alias, so that an error names the flag the user gave.
_MICROBATCHES = flags.DEFINE_integer(
    "microbatches", None, "pipeline: the micro-batches that flow through the stages per "
    "update (GPipe's M); the same number as --accum_steps, which it sets.", lower_bound=1,
    upper_bound=config_lib.INT_MAX)
_GRAD_COMPRESSION = flags.DEFINE_enum(
    "grad_compression", _TRAIN_DEFAULTS.grad_compression, list(config_lib.GRAD_COMPRESSION),
    "How gradients cross replicas. fp16/bf16: cast for the sum (half the bytes), every "
    "strategy. powersgd: each matrix as rank --powersgd_rank factors (two all-reduces); "
    "topk: the largest --topk_fraction of each matrix's entries (an all-gather); both "
    "with per-replica error feedback, 1-D tensors sent whole; mirrored, multi_worker "
    "and horovod.")
_POWERSGD_RANK = flags.DEFINE_integer(
    "powersgd_rank", _TRAIN_DEFAULTS.powersgd_rank, "--grad_compression=powersgd: the rank "
    "of each matrix's factors (at most its smaller dimension).", lower_bound=1)
_TOPK_FRACTION = flags.DEFINE_float(
    "topk_fraction", _TRAIN_DEFAULTS.topk_fraction, "--grad_compression=topk: the share of "
    "each matrix's entries each replica sends per update, in (0, 1].")
_COMPRESSION_WARMUP_STEPS = flags.DEFINE_integer(
    "compression_warmup_steps", _TRAIN_DEFAULTS.compression_warmup_steps, "powersgd: "
    "gradients are summed uncompressed for the first N steps (PyTorch's "
    "start_powerSGD_iter); topk: over the first N steps the share sent falls from 25% to "
    "--topk_fraction in four stages (deep gradient compression's warm-up). 0: none.",
    lower_bound=0)
_SYNC_EVERY = flags.DEFINE_integer(
    "sync_every", _TRAIN_DEFAULTS.sync_every, "Local SGD: each replica steps its own "
    "optimizer on its own gradients, and the weights are averaged every N steps "
    "(optimizer state stays per replica); loops, logs, evaluations and checkpoints "
    "happen at those averages. 0: gradients summed at every step. mirrored, "
    "multi_worker and horovod.", lower_bound=0)
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", _TRAIN_DEFAULTS.eval_every, "Evaluate on the test split every N steps (0: only at the end).", lower_bound=0)
_REDUCE_BUCKET_MB = flags.DEFINE_float(
    "reduce_bucket_mb", _TRAIN_DEFAULTS.reduce_bucket_mb, "Reduce gradients across replicas in buckets of about this many "
    "MB, each issued as soon as the backward pass has produced it, so communication overlaps "
    "computation (DDP's buckets, Horovod's tensor fusion); 0: one reduction after the whole "
    "backward pass. Not with --accum_steps > 1 (its one reduction follows the last "
    "micro-batch anyway).", lower_bound=0.0)
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", _TRAIN_DEFAULTS.log_every, "Log a progress line every N steps (0: after every loop).", lower_bound=0)

_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", _OPTIMIZER_DEFAULTS.name, list(config_lib.OPTIMIZERS), "Optimizer.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", _OPTIMIZER_DEFAULTS.learning_rate, "Learning rate.", lower_bound=0.0)
_MOMENTUM = flags.DEFINE_float("momentum", _OPTIMIZER_DEFAULTS.momentum, "Momentum (optimizer=momentum).")
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", _OPTIMIZER_DEFAULTS.weight_decay, "Weight decay (optimizer=adamw).")

_LR_SCALING = flags.DEFINE_enum(
    "lr_scaling", _OPTIMIZER_DEFAULTS.lr_scaling, list(config_lib.LR_SCALING),
    "Scale --learning_rate (tuned at --base_batch_size) to the global batch: linear "
    "(lr x global/base) or sqrt (lr x sqrt(global/base)).")
_BASE_BATCH_SIZE = flags.DEFINE_integer(
    "base_batch_size", _OPTIMIZER_DEFAULTS.base_batch_size, "The batch size --learning_rate was tuned for (--lr_scaling).",
    lower_bound=1)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", _OPTIMIZER_DEFAULTS.warmup_steps, "Linear learning-rate warm-up from 0 over this many steps.", lower_bound=0)
_LR_DECAY = flags.DEFINE_enum(
    "lr_decay", _OPTIMIZER_DEFAULTS.lr_decay, list(config_lib.LR_DECAY),
    "After warm-up: constant, or cosine decay to 0 at the last step.")
_CLIP_GRAD_NORM = flags.DEFINE_float(
    "clip_grad_norm", _OPTIMIZER_DEFAULTS.clip_grad_norm, "Clip the global norm of the (cross-replica summed) gradient.",
    lower_bound=0.0)
_PRECISION = flags.DEFINE_enum(
    "precision", _TRAIN_DEFAULTS.precision, list(config_lib.PRECISIONS),
    "Keras dtype policy: float32, mixed_bfloat16, or mixed_float16 (with dynamic loss "
    "scaling). Logits and loss stay float32.")
_LOSS_SCALE_GROWTH_STEPS = flags.DEFINE_integer(
    "loss_scale_growth_steps", _TRAIN_DEFAULTS.loss_scale_growth_steps, "mixed_float16: finite steps before the loss scale "
    "doubles (a non-finite step halves it and is skipped).", lower_bound=1)
_RECOMPUTE = flags.DEFINE_boolean(
    "recompute", _MODEL_DEFAULTS.recompute, "Gradient checkpointing: recompute the activations of each block "
    "(cnn, transformer) in the backward pass instead of keeping them.")

_JIT_COMPILE = flags.DEFINE_enum(
    "jit_compile", _TRAIN_DEFAULTS.jit_compile, list(config_lib.JIT_COMPILE),
    "XLA for the replica step: on (forward, backward and the fused optimizer update; the "
    "cross-replica sum stays outside XLA), off, or auto (picked by --precision and the "
    "CPU's ISA; the start-up log says what it chose).")
_PROFILE_STEPS = flags.DEFINE_list(
    "profile_steps", [], "Capture a TensorFlow profiler trace of global steps A,B (inclusive) "
    "into model_dir/tensorboard (TensorBoard's profile tab); needs --model_dir.")
_PROFILE_ALL_RANKS = flags.DEFINE_boolean(
    "profile_all_ranks", _TRAIN_DEFAULTS.profile_all_ranks, "--profile_steps on every worker/rank (each in its own "
    "directory), not only the chief.")
_LOG_ALL_RANKS = flags.DEFINE_boolean(
    "log_all_ranks", _TRAIN_DEFAULTS.log_all_ranks, "Progress lines from every worker/rank; by default only the chief "
    "logs progress (warnings and errors show from every rank).")
_GRAD_AGREEMENT_EVERY = flags.DEFINE_integer(
    "grad_agreement_every", _TRAIN_DEFAULTS.grad_agreement_every, "Every N steps, measure the cosine similarity of each "
    "replica's gradient with the cross-replica mean (data-parallel engines; TensorBoard "
    "and summary); 0: never.", lower_bound=0)

_LOSS = flags.DEFINE_enum(
    "loss", _TRAIN_DEFAULTS.loss, list(config_lib.LOSSES),
    "Loss on the model's logits and the dataset's class labels (your own Keras loss: "
    "tfdist.train(loss=...)).")
_METRICS = flags.DEFINE_list(
    "metrics", list(_TRAIN_DEFAULTS.metrics), "Metrics reported in progress lines, the "
    f"summary and TensorBoard: any of {', '.join(config_lib.METRICS)} (your own: "
    "tfdist.train(metrics=...)).")
_LABEL_SMOOTHING = flags.DEFINE_float(
    "label_smoothing", _TRAIN_DEFAULTS.label_smoothing,
    "Label smoothing of the categorical losses.", lower_bound=0.0, upper_bound=0.999)
_EXPORT_DIR = flags.DEFINE_string(
    "export_dir", _TRAIN_DEFAULTS.export_dir, "After training, the chief writes model.keras "
    "and a SavedModel with a serving signature (saved_model/) here.")
_IMAGE_SIZE = flags.DEFINE_integer(
    "image_size", _DATA_DEFAULTS.image_size, "Resize a TFDS image dataset's images to this "
    "height and width (needed when they differ in size).", lower_bound=1)
_VOCAB_SIZE = flags.DEFINE_integer(
    "vocab_size", _DATA_DEFAULTS.vocab_size, "Text datasets: the most tokens kept by the "
    "TextVectorization vocabulary adapted on the train split.", lower_bound=2)
_SEQUENCE_LENGTH = flags.DEFINE_integer(
    "sequence_length", _DATA_DEFAULTS.sequence_length, "Text datasets: tokens per "
    "example (padded or cut).", lower_bound=1)

_PREEMPTION_GRACE_S = flags.DEFINE_float(
    "preemption_grace_s", _TRAIN_DEFAULTS.preemption_grace_s, "On SIGTERM every worker "
    "finishes its current loop, saves one checkpoint at the same step and exits with status "
    "143 within this many seconds (else exits 143 without saving).", lower_bound=0.1)

_ON_NONFINITE = flags.DEFINE_enum(
    "on_nonfinite", _TRAIN_DEFAULTS.on_nonfinite, list(config_lib.ON_NONFINITE),
    "A step whose loss is NaN or infinite: stop (one line naming the step and the last "
    "good checkpoint), skip its update (all replicas agree), or rollback to the last "
    "checkpoint and continue past the offending batches (needs --model_dir).")
_MAX_ROLLBACKS = flags.DEFINE_integer(
    "max_rollbacks", _TRAIN_DEFAULTS.max_rollbacks, "--on_nonfinite=rollback: stop after "
    "this many rollbacks.", lower_bound=0)

_MODEL_DIR = flags.DEFINE_string(
    "model_dir", _TRAIN_DEFAULTS.model_dir, "Directory for checkpoints and summary.json; a run resumes from its "
    "latest checkpoint. Default: none (nothing written).")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", _TRAIN_DEFAULTS.checkpoint_every, "Save a checkpoint every N steps (0: only at the end).", lower_bound=0)
_KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", _TRAIN_DEFAULTS.keep_checkpoints, "Checkpoints to keep.", lower_bound=1)
_CHECKPOINT_INPUT = flags.DEFINE_boolean(
    "checkpoint_input", _TRAIN_DEFAULTS.checkpoint_input, "Save the input position with every "
    "checkpoint (--autoshard=global: the examples read, valid under any engine and worker "
    "count; otherwise each pipeline's iterator, its shuffle buffer included), so a resumed "
    "run reads exactly the batches an uninterrupted one reads; off: a resumed run draws a "
    "fresh permutation.")
_SEED = flags.DEFINE_integer("seed", _TRAIN_DEFAULTS.seed, "Seed for weights, shuffling and synthetic data.", lower_bound=0)

# `--help` lists tfdist's flags in these groups, in this order (tfdist/help.py).
# Every flag defined above belongs to exactly one: tests/test_help.py fails on a
# flag without a group, so a new flag is added here in the same change.
HELP_GROUPS = {title: tuple(holder.name for holder in holders) for title, holders in {
    "engine and cluster": (
        _STRATEGY, _VIRTUAL_DEVICES, _WORKER_HOSTS, _TASK_INDEX, _PS_HOSTS, _TASK_TYPE,
        _PS_SHARD_BYTES, _COLLECTIVE, _BYTES_PER_PACK, _MESH, _ZERO_STAGE, _SHARD_OPTIMIZER_STATE,
        _PRINT_LAYOUTS, _PIPELINE_STAGES, _PIPELINE_SCHEDULE, _PIPELINE_SPLIT, _PRINT_STAGES),
    "model and data": (
        _MODEL, _MODEL_WIDTH, _MODEL_DEPTH, _NUM_HEADS, _DATASET, _DATA_DIR, _SYNTHETIC,
        _IMAGE_SIZE, _VOCAB_SIZE, _SEQUENCE_LENGTH, _AUTOSHARD, _SHUFFLE_BUFFER),
    "training": (
        _GLOBAL_BATCH_SIZE, _TRAIN_STEPS, _EPOCHS, _OPTIMIZER, _LEARNING_RATE, _MOMENTUM,
        _WEIGHT_DECAY, _LR_SCALING, _BASE_BATCH_SIZE, _WARMUP_STEPS, _LR_DECAY,
        _CLIP_GRAD_NORM, _ACCUM_STEPS, _MICROBATCHES, _LOSS, _LABEL_SMOOTHING, _METRICS, _EVAL_EVERY, _SEED),
    "precision and speed": (
        _PRECISION, _LOSS_SCALE_GROWTH_STEPS, _JIT_COMPILE, _RECOMPUTE,
        _REDUCE_BUCKET_MB, _STEPS_PER_LOOP, _PROFILE_STEPS, _PROFILE_ALL_RANKS),
    "slow network": (
        _GRAD_COMPRESSION, _POWERSGD_RANK, _TOPK_FRACTION, _COMPRESSION_WARMUP_STEPS,
        _SYNC_EVERY),
    "faults": (
        _COLLECTIVE_TIMEOUT_S, _PREEMPTION_GRACE_S, _ON_NONFINITE, _MAX_ROLLBACKS, _ELASTIC,
        _ELASTIC_COMMIT_EVERY),
    "output": (
        _MODEL_DIR, _CHECKPOINT_EVERY, _KEEP_CHECKPOINTS, _CHECKPOINT_INPUT, _EXPORT_DIR,
        _LOG_EVERY, _LOG_ALL_RANKS, _GRAD_AGREEMENT_EVERY),
}.items()}

_DEFAULT_TRAIN_STEPS = _TRAIN_DEFAULTS.train_steps


@flags.multi_flags_validator(
    ["train_steps", "epochs"], message="--train_steps and --epochs: set only one of them")
def _one_length(values) -> bool:
    return values["train_steps"] is None or values["epochs"] is None


def _profile_steps() -> tuple:
    try:
        return tuple(int(step) for step in _PROFILE_STEPS.value)
    except ValueError:
        raise UsageError(f"--profile_steps={','.join(_PROFILE_STEPS.value)} must be two "
                         "step numbers A,B, e.g. 20,25") from None


def run_config() -> config_lib.RunConfig:
    """The `RunConfig` the parsed flags describe. Raises `UsageError`."""
    train_steps = _TRAIN_STEPS.value
    if train_steps is None and _EPOCHS.value is None:
        train_steps = _DEFAULT_TRAIN_STEPS
    accum_steps = _ACCUM_STEPS.value
    if _MICROBATCHES.value is not None:
        if _ACCUM_STEPS.present and accum_steps != _MICROBATCHES.value:
            raise UsageError(f"--microbatches={_MICROBATCHES.value} and --accum_steps="
                             f"{accum_steps} name the same number; give one of them")
        accum_steps = _MICROBATCHES.value
    try:
        return config_lib.RunConfig(
            strategy=config_lib.StrategyConfig(
                name=_STRATEGY.value, virtual_devices=_VIRTUAL_DEVICES.value or None,
                collective=_COLLECTIVE.value, collective_timeout_s=_COLLECTIVE_TIMEOUT_S.value,
                bytes_per_pack=_BYTES_PER_PACK.value, worker_hosts=tuple(_WORKER_HOSTS.value),
                task_index=_TASK_INDEX.value, mesh=_MESH.value,
                ps_hosts=tuple(_PS_HOSTS.value), task_type=_TASK_TYPE.value,
                ps_shard_bytes=_PS_SHARD_BYTES.value,
                shard_optimizer_state=_SHARD_OPTIMIZER_STATE.value,
                zero_stage=int(_ZERO_STAGE.value),
                elastic=_ELASTIC.value, elastic_commit_every=_ELASTIC_COMMIT_EVERY.value,
                pipeline_stages=_PIPELINE_STAGES.value,
                pipeline_schedule=_PIPELINE_SCHEDULE.value,
                pipeline_split=tuple(_PIPELINE_SPLIT.value)),
            model=config_lib.ModelConfig(
                name=_MODEL.value, width=_MODEL_WIDTH.value, depth=_MODEL_DEPTH.value,
                num_heads=_NUM_HEADS.value, recompute=_RECOMPUTE.value),
            data=config_lib.DataConfig(
                dataset=_DATASET.value, data_dir=_DATA_DIR.value, synthetic=_SYNTHETIC.value,
                shuffle_buffer=_SHUFFLE_BUFFER.value, autoshard=_AUTOSHARD.value,
                image_size=_IMAGE_SIZE.value, vocab_size=_VOCAB_SIZE.value,
                sequence_length=_SEQUENCE_LENGTH.value),
            optimizer=config_lib.OptimizerConfig(
                name=_OPTIMIZER.value, learning_rate=_LEARNING_RATE.value,
                momentum=_MOMENTUM.value, weight_decay=_WEIGHT_DECAY.value,
                lr_scaling=_LR_SCALING.value, base_batch_size=_BASE_BATCH_SIZE.value,
                warmup_steps=_WARMUP_STEPS.value, lr_decay=_LR_DECAY.value,
                clip_grad_norm=_CLIP_GRAD_NORM.value),
            train=config_lib.TrainConfig(
                global_batch_size=_GLOBAL_BATCH_SIZE.value, train_steps=train_steps,
                epochs=_EPOCHS.value, steps_per_loop=_STEPS_PER_LOOP.value,
                accum_steps=accum_steps, grad_compression=_GRAD_COMPRESSION.value,
                powersgd_rank=_POWERSGD_RANK.value, topk_fraction=_TOPK_FRACTION.value,
                compression_warmup_steps=_COMPRESSION_WARMUP_STEPS.value,
                sync_every=_SYNC_EVERY.value,
                precision=_PRECISION.value,
                loss_scale_growth_steps=_LOSS_SCALE_GROWTH_STEPS.value,
                eval_every=_EVAL_EVERY.value,
                log_every=_LOG_EVERY.value, checkpoint_every=_CHECKPOINT_EVERY.value,
                keep_checkpoints=_KEEP_CHECKPOINTS.value, model_dir=_MODEL_DIR.value,
                checkpoint_input=_CHECKPOINT_INPUT.value,
                export_dir=_EXPORT_DIR.value, loss=_LOSS.value, metrics=tuple(_METRICS.value),
                label_smoothing=_LABEL_SMOOTHING.value,
                seed=_SEED.value, jit_compile=_JIT_COMPILE.value,
                profile_steps=_profile_steps(), profile_all_ranks=_PROFILE_ALL_RANKS.value,
                log_all_ranks=_LOG_ALL_RANKS.value,
                grad_agreement_every=_GRAD_AGREEMENT_EVERY.value,
                reduce_bucket_mb=_REDUCE_BUCKET_MB.value,
                preemption_grace_s=_PREEMPTION_GRACE_S.value,
                on_nonfinite=_ON_NONFINITE.value, max_rollbacks=_MAX_ROLLBACKS.value),
        )
    except config_lib.ConfigError as error:  # a rule flags alone cannot express
        raise UsageError(str(error)) from None


def print_stages() -> bool:
    """--print_stages: describe the pipeline's stages and exit instead of training."""
    return _PRINT_STAGES.value


def print_layouts() -> bool:
    """--print_layouts: describe the dtensor layouts and exit instead of training."""
    return _PRINT_LAYOUTS.value
