"""A depthwise convolution's backward pass: TensorFlow's native gradient ops
against the DTensor engine's rewrite (`tfdist/strategies/dtensor/ops.py`:
k·k per-tap slices, products and sums, the ops DTensor can shard), both on
one device, side by side in one process, so the ratio says what the rewrite
costs where the native op would also run. Shapes are MobileNet/EfficientNet
blocks at batch 32 (32x32 and 112x112 inputs, 3x3 and 5x5 kernels, strides
1 and 2). Each configuration: forward + backward traced once, then timed
over interleaved repeats; the median of each is reported.

    python bench/depthwise.py [--repeats=N]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import tensorflow as tf  # noqa: E402

from tfdist.strategies.dtensor import ops as dtensor_ops  # noqa: E402

SHAPES = [  # (batch, size, channels, kernel, stride)
    (32, 32, 96, 3, 1), (32, 32, 144, 5, 2), (32, 56, 144, 3, 1), (32, 112, 32, 3, 2)]


def step_fn(rewrite: bool, x, w, stride):
    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.depthwise_conv2d(x, w, [1, stride, stride, 1], "SAME")
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, w])

    if rewrite:
        with dtensor_ops.shardable_gradients():
            step.get_concrete_function()   # traced with the rewritten gradient
    else:
        step.get_concrete_function()
    return step


def timed(step, repeats) -> list:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        tf.nest.map_structure(lambda t: t.numpy(), step())
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows, header = [], ["batch x size x channels", "kernel", "stride", "native ms",
                        "rewrite ms", "rewrite / native"]
    for batch, size, channels, kernel, stride in SHAPES:
        x = tf.random.normal([batch, size, size, channels])
        w = tf.random.normal([kernel, kernel, channels, 1])
        steps = {name: step_fn(name == "rewrite", x, w, stride) for name in ("native", "rewrite")}
        for step in steps.values():
            step()   # warm up
        times = {name: [] for name in steps}
        for _ in range(args.repeats):   # interleaved: load changes hit both alike
            for name, step in steps.items():
                times[name] += timed(step, 1)
        native, rewrite = (statistics.median(times[n]) * 1e3 for n in ("native", "rewrite"))
        row = [f"{batch}x{size}x{channels}", f"{kernel}x{kernel}", stride, f"{native:.1f}",
               f"{rewrite:.1f}", f"{rewrite / native:.2f}"]
        common.print_row(row, header)
        rows.append(row)
    body = ("Forward + backward of one depthwise convolution (`tf.nn.depthwise_conv2d`, SAME, "
            "depth multiplier 1, float32), TensorFlow's native gradient against the DTensor "
            f"engine's rewrite, both on one device; median of {args.repeats} interleaved "
            "repeats.\n\n" + common.markdown_table(rows, header))
    print(common.write_section("depthwise", "Depthwise-convolution gradients: the DTensor "
                               "rewrite vs the native ops", body))


if __name__ == "__main__":
    main()
