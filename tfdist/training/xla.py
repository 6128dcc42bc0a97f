"""`--jit_compile`: which parts of the replica step XLA compiles.

Three levels, from what `bench/vs_fit.py` measured on the CPUs this project
runs on:

    step       forward, backward and the optimizer update compiled; where
               the engine's cross-replica sum is a real collective it stays
               between two XLA clusters (gradients; then one fused update
               per variable), since collectives of tf.distribute and Horovod
               cannot run inside XLA on CPU. With micro-batches
               (`--accum_steps`), each micro-batch's forward and backward is
               one XLA cluster and TensorFlow runs their loop (then the
               fused update): XLA:CPU runs a convolution inside a loop body
               many times slower than at the top level (the cnn at 2
               micro-batches, float32, AMX Xeon: 35 examples/s with the loop
               compiled, 1004 with each micro-batch compiled; dense models
               ran the same either way), and the loop outside keeps one
               micro-batch's activations alive
    optimizer  only the optimizer update, fused per variable (Adam's dozen
               element-wise passes over every weight become one)
    off        plain TensorFlow graphs (oneDNN kernels throughout)

`auto` picks, from those measurements:
  - `step` for float32 dense models (matmuls, einsums): XLA fuses the step
    (everything, under the default strategy) and its float32 dots match
    oneDNN's (mlp 3691 vs 2898 off on the EPYC);
  - `step` for 16-bit policies on CPUs that emulate bf16 (AVX2 only): XLA
    computes bf16 dots and convolutions in float32, faster than the emulated
    kernels (Keras fit on the cnn: 1114 vs 501 examples/s with XLA on vs off);
  - `optimizer` for bfloat16 on AMD CPUs with AVX512-BF16 (Zen 4 and later):
    their bf16 dot products run at full rate (oneDNN bf16 matmul peak 0.84-0.88
    TFLOP/s vs float32 0.44-0.51 on a quiet 2-core EPYC), so oneDNN's native
    bf16 kernels beat XLA's float32 computation (default strategy, off vs
    step: mlp 4189 vs 3171 and 4343 vs 3317, cnn 2392 vs 2099 and 2790 vs
    2113), and the fused update beats both: Adam's float32 update is
    memory-bound and costs more than the whole bf16 backward pass when left
    unfused (off / optimizer / step, two rounds in one process each: mlp 4206
    / 5583 / 3158 and 4133 / 5392 / 3235, cnn 2336 / 2447 and 2122 / 2310,
    transformer 1057 / 1082 / 1033 and 1116 / 1131 / 1091, a tie; bench/vs_fit
    on a busier hour: mlp 3287 / 4162 / 2587, cnn 2283 / 2455 / 1518,
    transformer 938 / 961 / 929). Under mirrored the mlp gained too (2311 /
    3956 and 2135 / 3373) but the transformer lost (988 / 679): both
    replicas' per-variable updates share two cores there, and the start-up
    warning steers a CPU user to the default strategy anyway;
  - `step` for bfloat16 on Intel CPUs with AVX512-BF16 but no AMX (the
    2-core "Intel Xeon Processor" of docs/benchmarks.md's vs_fit table): oneDNN's bf16
    matmuls ran at half float32's rate there (0.141 vs 0.279 TFLOP/s, by the
    first probe, which measured bf16 at 1024 and could read low), and XLA won
    every bf16 row (tfdist on vs off, default strategy: mlp 2082 vs 1251, cnn
    1190 vs 875, transformer 626 vs 429); the fused update alone was not
    measured there;
  - `off` for float32 models of large matrices where replicas share the
    CPU's cores as virtual devices (mirrored over virtual CPUs): the FFN
    mlp (4M-element kernels) under mirrored over 2 virtual CPUs, off /
    step: 1875 / 1628, 1903 / 1591 and 2140 / 1698 examples/s on a Zen 5
    EPYC (family 26 model 2), 1192 / 1178 on the AMX Xeon, 1528 / 1557 and
    1580 / 1320 in the buckets' measurement below; with one replica per
    process (multi_worker, 2 processes) the step won on the Zen 5 (step /
    off 2861 / 1947 and 2998 / 2396 for an mlp of 1M-element kernels), and
    models of small matrices keep the step under mirrored too (the
    transformer, step / off: 1373 / 1015 on the Zen 5, 724 / 587 on AMX);
  - `off` for models whose FLOPs are mostly convolutions (above
    CONVOLUTION_SHARE), in float32 and in native bf16, unless half their
    parameters sit in large matrices (then `optimizer`, the memory-bound
    update fused, as for the mlp below): XLA's CPU convolutions are slower
    than oneDNN's (the cnn 1061 vs 1277 examples/s under the default
    strategy), and with the fused BatchNorm the per-variable fused update
    (one XLA launch per small variable, per replica) no longer pays.
    bench/vs_fit.py, the cnn, off / optimizer examples/s, float32 default,
    float32 mirrored, bf16 default: AMX Xeon (medians of 3) 1740 / 1669,
    1730 / 1664, 2999 / 2814; Zen 5 EPYC (family 26 model 2) 3099 / 2750,
    2756 / 2846, 4572 / 3794; Zen 4 EPYC (family 25 model 17) 1212 / 1221,
    1565 / 1300, 1887 / 1925. `off` is within 4% of the better of the two
    in every cell, `optimizer` fell 6-17% short in four of the nine (before
    the fused BatchNorm, `optimizer` had led by 2-9% on an AVX512-BF16 EPYC:
    2545 vs 2479 off in float32, 2447 vs 2336 and 2310 vs 2122 in bf16);
  - `optimizer` with --reduce_bucket_mb under replicated engines: one XLA
    cluster for the gradients would produce them all at once, so no bucket
    could overlap the backward pass (without buckets, `step` won for the
    transformer under mirrored, 711 vs 545 examples/s, and was within this
    machine's run-to-run noise for the mlp: 1557 vs 1528 in one run, 1320
    vs 1580 in another);
  - `optimizer` for bfloat16 on AMX CPUs, where XLA's dots bypass oneDNN's
    AMX path (Keras fit measured 1868 vs 2877 examples/s with XLA on vs off
    there);
  - on both kinds of CPU with native bf16 (AMX, AMD's AVX512-BF16), the fused
    update only where it pays: for models whose parameters sit mostly in
    large matrices (at least half in variables of LARGE_VARIABLE elements or
    more: the mlp, 4M-element kernels), where the update is memory-bound and
    oneDNN's bf16 dots beat XLA's; models of small matrices (the transformer
    at width 128, 64K-element kernels at most; the cnn, 37K) get, on AMX,
    XLA's fusion of their element-wise ops under the default strategy
    (`step`: transformer on AMX 621 step / 585 off / 581 optimizer, and 653
    / 607 / 605 in an earlier run), and plain TensorFlow on AMD's
    AVX512-BF16, where `step` at best tied (transformer, step / off: 1033 /
    1057 and 1091 / 1116 on an earlier AVX512-BF16 EPYC, 1026 / 1013
    on the Zen 5, 431 / 537 and 593 / 685 on the Zen 4 EPYC family 25 model
    17); plain TensorFlow where convolutions dominate (above), and under
    replicated engines,
    where each replica's per-variable update is its own XLA launch
    (mirrored over two virtual CPUs: transformer on AMX 682 off / 632
    optimizer / 635 step, 707 / 650 / 685 earlier, on the EPYC 988 off /
    679 optimizer; cnn on AMX 3040 off / 2812 optimizer; multi_worker and
    horovod, one replica per process, unmeasured).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist.errors import UsageError
from tfdist.observe import hardware

STEP, OPTIMIZER, OFF = "step", "optimizer", "off"


# Above this share of a model's FLOPs in convolutions, auto leaves the
# forward/backward to oneDNN: XLA's CPU convolutions were slower (the cnn:
# 1061 vs 1277 examples/s under the default strategy, float32).
CONVOLUTION_SHARE = 0.5
# A variable of at least this many elements is a large matrix; a model with
# at least half its parameters in such variables has large matrices.
LARGE_VARIABLE = 2 ** 18


def large_share(model) -> float:
    """The share of `model`'s trainable parameters in variables of at least
    LARGE_VARIABLE elements (1.0 for a model without any)."""
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    total = sum(sizes)
    return sum(s for s in sizes if s >= LARGE_VARIABLE) / total if total else 1.0


def auto_level(precision: str, whole_step: bool = True, convolution_share: float = 0.0,
               buckets: bool = False, large_share: float = 1.0,
               shared_replicas: int = 0) -> str:
    """What `--jit_compile=auto` picks on this CPU for `precision`, under an
    engine whose replica step fits in one XLA cluster (`whole_step`) or not,
    for a model with `convolution_share` of its FLOPs in convolutions and
    `large_share` of its parameters in large matrices, with bucketed
    reductions (`buckets`) or not, and `shared_replicas` replicas sharing
    this CPU's cores as virtual devices (0: one replica per device). The
    measurements behind each branch are in this module's docstring."""
    bf16 = hardware.bf16_support()
    if precision == "mixed_bfloat16" and (
            bf16 == "AMX" or (bf16 == "AVX-512" and hardware.cpu_vendor() == "AMD")):
        if large_share >= 0.5:
            return OPTIMIZER   # native bf16 matmuls in oneDNN, the memory-bound update fused
        if bf16 == "AMX" and whole_step and convolution_share <= CONVOLUTION_SHARE:
            return STEP   # XLA's fusion of the element-wise ops around small AMX dots
        return OFF   # per-variable XLA launches of small variables cost more than they fuse
    if precision != "float32":
        return STEP   # XLA's float32 dots and convolutions beat emulated 16-bit kernels
    if convolution_share > CONVOLUTION_SHARE:
        return OPTIMIZER if large_share >= 0.5 else OFF   # oneDNN's convolutions
    if buckets and not whole_step:
        return OPTIMIZER
    if shared_replicas > 1 and large_share >= 0.5:
        return OFF   # compiled steps of replicas sharing the cores lost to oneDNN's
    return STEP


def check(setting: str, strategy) -> None:
    """Raise `UsageError` if `--jit_compile=setting` cannot run under `strategy`."""
    if setting == "on" and not strategy.supports_xla:
        raise UsageError(f"--jit_compile=on is not supported by --strategy={strategy.name}: "
                         f"{strategy.supports_xla_reason}; use --jit_compile=off or auto")


def resolve(setting: str, precision: str, strategy, convolution_share: float = 0.0,
            buckets: bool = False, large: float = 1.0) -> str:
    """The level for `--jit_compile=setting` under `strategy`."""
    check(setting, strategy)
    if not strategy.supports_xla or setting == "off":
        return OFF
    if setting == "on":
        return STEP
    return auto_level(precision, strategy.xla_whole_step, convolution_share, buckets, large,
                      strategy.shared_cpu_replicas)


def describe(setting: str, level: str) -> str:
    what = {STEP: "forward, backward and optimizer update", OPTIMIZER: "optimizer update only",
            OFF: "off"}[level]
    return f"XLA (--jit_compile={setting}): {what}"


def fuse_optimizer_update(optimizer) -> None:
    """Compile `optimizer`'s per-variable update with XLA, one function per variable.

    Keras 3 calls `update_step(gradient, variable, learning_rate)` once per
    variable and, under tf.distribute, once per device copy of it. Each copy
    gets its own compiled function that captures it (and, through the
    optimizer's slot lookup, its own slots): a function shared between
    variables of one shape would reuse the first variable's slots.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    plain = inner.update_step
    compiled = {}

    def update_step(gradient, variable, learning_rate):
        key = id(variable)
        if key not in compiled:
            compiled[key] = (variable, tf.function(
                lambda g, lr: plain(g, variable, lr), jit_compile=True, autograph=False))
        return compiled[key][1](gradient, tf.convert_to_tensor(learning_rate))

    inner.update_step = update_step
