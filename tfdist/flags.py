"""The only module that defines or reads absl flags: flags -> `RunConfig`.

Defaults are the main job (`make demo`): the bundled image dataset, the cnn
builder, `mirrored` over 2 virtual CPU devices. Canned runs are flagfiles in
`configs/` (`--flagfile=configs/NAME.cfg`); flags after it override it.
"""

from __future__ import annotations

from absl import flags

from tfdist import config as config_lib
from tfdist.errors import UsageError

# Registry names are listed in help text but checked after parsing (by the
# registries themselves), so the flags module never imports TensorFlow.
_STRATEGY = flags.DEFINE_string(
    "strategy", "mirrored",
    "Scale-out engine: default (one device), mirrored (all local devices), multi_worker "
    "(MultiWorkerMirroredStrategy over TF_CONFIG / --worker_hosts / Slurm), horovod "
    "(Horovod ranks under horovodrun; `make horovod` builds it), dtensor (tensor sharding "
    "over --mesh).")
_VIRTUAL_DEVICES = flags.DEFINE_integer(
    "virtual_devices", 2,
    "On a host without GPUs, split the CPU into this many logical devices so "
    "multi-device strategies run for real; 0 leaves the devices as they are.", lower_bound=0)

_WORKER_HOSTS = flags.DEFINE_list(
    "worker_hosts", [], "multi_worker without TF_CONFIG: every worker's host:port, in order "
    "(the same list on every host); TF_CONFIG is written from it.")
_TASK_INDEX = flags.DEFINE_integer(
    "task_index", None, "multi_worker: this host's index in --worker_hosts.", lower_bound=0)
_COLLECTIVE = flags.DEFINE_enum(
    "collective", "auto", list(config_lib.COLLECTIVES),
    "multi_worker collective implementation (CommunicationOptions).")
_COLLECTIVE_TIMEOUT_S = flags.DEFINE_float(
    "collective_timeout_s", 60.0, "multi_worker: a collective that has not completed in this "
    "many seconds (e.g. a dead or never-started peer) fails the run.", lower_bound=1.0)
_BYTES_PER_PACK = flags.DEFINE_integer(
    "bytes_per_pack", 0, "multi_worker: pack gradients into all-reduces of about this many "
    "bytes (0: TensorFlow's default).", lower_bound=0)

_MESH = flags.DEFINE_string(
    "mesh", config_lib.StrategyConfig.mesh,
    "dtensor: the device mesh, batch:B,model:M (B-way data parallel x M-way tensor "
    "sharding; B*M devices, e.g. --virtual_devices=B*M on a CPU host).")
_SHARD_OPTIMIZER_STATE = flags.DEFINE_boolean(
    "shard_optimizer_state", False,
    "dtensor: also split optimizer slots over the batch axis (ZeRO-1), so per-device "
    "optimizer memory falls with the whole mesh.")
_PRINT_LAYOUTS = flags.DEFINE_boolean(
    "print_layouts", False,
    "dtensor: print every variable's path, global shape, sharding spec and per-device "
    "bytes (and the per-device totals) for --model and --mesh, then exit.")

_MODEL = flags.DEFINE_string("model", "cnn", "Model builder: mlp, cnn, transformer.")
_MODEL_WIDTH = flags.DEFINE_integer(
    "model_width", 32, "Hidden units (mlp), base channels (cnn), model dim (transformer).", lower_bound=1)
_MODEL_DEPTH = flags.DEFINE_integer(
    "model_depth", 2, "Hidden layers (mlp), residual blocks per stage (cnn), blocks (transformer).", lower_bound=1)
_NUM_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads (transformer).", lower_bound=1)

_DATASET = flags.DEFINE_string(
    "dataset", "tfdist_shapes",
    "TFDS dataset name: the bundled tfdist_shapes (images) or tfdist_tokens "
    "(token sequences), prepared offline on first use, or any TFDS dataset "
    "prepared in --data_dir.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "TFDS data directory (default: $TFDS_DATA_DIR or ~/tensorflow_datasets).")
_SYNTHETIC = flags.DEFINE_boolean(
    "synthetic", False, "Feed random tensors of the dataset's shapes (benchmarking; no eval).")
_AUTOSHARD = flags.DEFINE_enum(
    "autoshard", "auto", list(config_lib.AUTOSHARD),
    "How training input is split across workers: file (each reads its own files), data "
    "(each reads its own examples), off (each reads all, shuffled differently), auto (file "
    "when the split has enough files, else data).")
_SHUFFLE_BUFFER = flags.DEFINE_integer("shuffle_buffer", 10_000, "Examples in the shuffle buffer.", lower_bound=1)

_GLOBAL_BATCH_SIZE = flags.DEFINE_integer(
    "global_batch_size", 128, "Examples per update over all replicas (split evenly between them).", lower_bound=1)
_TRAIN_STEPS = flags.DEFINE_integer(
    "train_steps", None, "Updates to train for (the final global step). Default: 600 if "
    "--epochs is unset.", lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", None, "Epochs to train for (instead of --train_steps).", lower_bound=1)
_STEPS_PER_LOOP = flags.DEFINE_integer(
    "steps_per_loop", 100, "Steps run inside one tf.function call between host syncs.", lower_bound=1)
_ACCUM_STEPS = flags.DEFINE_integer(
    "accum_steps", 1, "Micro-batches per update (gradient accumulation); gradients are reduced "
    "across replicas once per update.", lower_bound=1)
_GRAD_COMPRESSION = flags.DEFINE_enum(
    "grad_compression", "none", list(config_lib.GRAD_COMPRESSION),
    "Cast gradients to this dtype for the cross-replica sum (halves the bytes reduced), "
    "back to the variables' dtype after; every strategy.")
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", 0, "Evaluate on the test split every N steps (0: only at the end).", lower_bound=0)
_REDUCE_BUCKET_MB = flags.DEFINE_float(
    "reduce_bucket_mb", 0.0, "Reduce gradients across replicas in buckets of about this many "
    "MB, each issued as soon as the backward pass has produced it, so communication overlaps "
    "computation (DDP's buckets, Horovod's tensor fusion); 0: one reduction after the whole "
    "backward pass. Not with --accum_steps > 1 (its one reduction follows the last "
    "micro-batch anyway).", lower_bound=0.0)
_LOG_EVERY = flags.DEFINE_integer(
    "log_every", 0, "Log a progress line every N steps (0: after every loop).", lower_bound=0)

_OPTIMIZER = flags.DEFINE_enum(
    "optimizer", "adam", list(config_lib.OPTIMIZERS), "Optimizer.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 3e-3, "Learning rate.", lower_bound=0.0)
_MOMENTUM = flags.DEFINE_float("momentum", 0.9, "Momentum (optimizer=momentum).")
_WEIGHT_DECAY = flags.DEFINE_float("weight_decay", 1e-4, "Weight decay (optimizer=adamw).")

_LR_SCALING = flags.DEFINE_enum(
    "lr_scaling", "none", list(config_lib.LR_SCALING),
    "Scale --learning_rate (tuned at --base_batch_size) to the global batch: linear "
    "(lr x global/base) or sqrt (lr x sqrt(global/base)).")
_BASE_BATCH_SIZE = flags.DEFINE_integer(
    "base_batch_size", 128, "The batch size --learning_rate was tuned for (--lr_scaling).",
    lower_bound=1)
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps", 0, "Linear learning-rate warm-up from 0 over this many steps.", lower_bound=0)
_LR_DECAY = flags.DEFINE_enum(
    "lr_decay", "constant", list(config_lib.LR_DECAY),
    "After warm-up: constant, or cosine decay to 0 at the last step.")
_CLIP_GRAD_NORM = flags.DEFINE_float(
    "clip_grad_norm", None, "Clip the global norm of the (cross-replica summed) gradient.",
    lower_bound=0.0)
_PRECISION = flags.DEFINE_enum(
    "precision", "float32", list(config_lib.PRECISIONS),
    "Keras dtype policy: float32, mixed_bfloat16, or mixed_float16 (with dynamic loss "
    "scaling). Logits and loss stay float32.")
_LOSS_SCALE_GROWTH_STEPS = flags.DEFINE_integer(
    "loss_scale_growth_steps", 2000, "mixed_float16: finite steps before the loss scale "
    "doubles (a non-finite step halves it and is skipped).", lower_bound=1)
_RECOMPUTE = flags.DEFINE_boolean(
    "recompute", False, "Gradient checkpointing: recompute the activations of each block "
    "(cnn, transformer) in the backward pass instead of keeping them.")

_JIT_COMPILE = flags.DEFINE_enum(
    "jit_compile", "auto", list(config_lib.JIT_COMPILE),
    "XLA for the replica step: on (forward, backward and the fused optimizer update; the "
    "cross-replica sum stays outside XLA), off, or auto (picked by --precision and the "
    "CPU's ISA; the start-up log says what it chose).")
_PROFILE_STEPS = flags.DEFINE_list(
    "profile_steps", [], "Capture a TensorFlow profiler trace of global steps A,B (inclusive) "
    "into model_dir/tensorboard (TensorBoard's profile tab); needs --model_dir.")
_PROFILE_ALL_RANKS = flags.DEFINE_boolean(
    "profile_all_ranks", False, "--profile_steps on every worker/rank (each in its own "
    "directory), not only the chief.")
_LOG_ALL_RANKS = flags.DEFINE_boolean(
    "log_all_ranks", False, "Progress lines from every worker/rank; by default only the chief "
    "logs progress (warnings and errors show from every rank).")
_GRAD_AGREEMENT_EVERY = flags.DEFINE_integer(
    "grad_agreement_every", 0, "Every N steps, measure the cosine similarity of each "
    "replica's gradient with the cross-replica mean (data-parallel engines; TensorBoard "
    "and summary); 0: never.", lower_bound=0)

_MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Directory for checkpoints and summary.json; a run resumes from its "
    "latest checkpoint. Default: none (nothing written).")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 0, "Save a checkpoint every N steps (0: only at the end).", lower_bound=0)
_KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints to keep.", lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 42, "Seed for weights, shuffling and synthetic data.", lower_bound=0)

_DEFAULT_TRAIN_STEPS = 600


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
    try:
        return config_lib.RunConfig(
            strategy=config_lib.StrategyConfig(
                name=_STRATEGY.value, virtual_devices=_VIRTUAL_DEVICES.value or None,
                collective=_COLLECTIVE.value, collective_timeout_s=_COLLECTIVE_TIMEOUT_S.value,
                bytes_per_pack=_BYTES_PER_PACK.value, worker_hosts=tuple(_WORKER_HOSTS.value),
                task_index=_TASK_INDEX.value, mesh=_MESH.value,
                shard_optimizer_state=_SHARD_OPTIMIZER_STATE.value),
            model=config_lib.ModelConfig(
                name=_MODEL.value, width=_MODEL_WIDTH.value, depth=_MODEL_DEPTH.value,
                num_heads=_NUM_HEADS.value, recompute=_RECOMPUTE.value),
            data=config_lib.DataConfig(
                dataset=_DATASET.value, data_dir=_DATA_DIR.value, synthetic=_SYNTHETIC.value,
                shuffle_buffer=_SHUFFLE_BUFFER.value, autoshard=_AUTOSHARD.value),
            optimizer=config_lib.OptimizerConfig(
                name=_OPTIMIZER.value, learning_rate=_LEARNING_RATE.value,
                momentum=_MOMENTUM.value, weight_decay=_WEIGHT_DECAY.value,
                lr_scaling=_LR_SCALING.value, base_batch_size=_BASE_BATCH_SIZE.value,
                warmup_steps=_WARMUP_STEPS.value, lr_decay=_LR_DECAY.value,
                clip_grad_norm=_CLIP_GRAD_NORM.value),
            train=config_lib.TrainConfig(
                global_batch_size=_GLOBAL_BATCH_SIZE.value, train_steps=train_steps,
                epochs=_EPOCHS.value, steps_per_loop=_STEPS_PER_LOOP.value,
                accum_steps=_ACCUM_STEPS.value, grad_compression=_GRAD_COMPRESSION.value,
                precision=_PRECISION.value,
                loss_scale_growth_steps=_LOSS_SCALE_GROWTH_STEPS.value,
                eval_every=_EVAL_EVERY.value,
                log_every=_LOG_EVERY.value, checkpoint_every=_CHECKPOINT_EVERY.value,
                keep_checkpoints=_KEEP_CHECKPOINTS.value, model_dir=_MODEL_DIR.value,
                seed=_SEED.value, jit_compile=_JIT_COMPILE.value,
                profile_steps=_profile_steps(), profile_all_ranks=_PROFILE_ALL_RANKS.value,
                log_all_ranks=_LOG_ALL_RANKS.value,
                grad_agreement_every=_GRAD_AGREEMENT_EVERY.value,
                reduce_bucket_mb=_REDUCE_BUCKET_MB.value),
        )
    except config_lib.ConfigError as error:  # a rule flags alone cannot express
        raise UsageError(str(error)) from None


def print_layouts() -> bool:
    """--print_layouts: describe the dtensor layouts and exit instead of training."""
    return _PRINT_LAYOUTS.value
