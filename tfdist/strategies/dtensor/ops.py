"""Gradients of ops that DTensor (TF 2.21) has no layout rule for, written
with ops it can shard; installed only while the DTensor engine traces a step.

A depthwise convolution (`tf.nn.depthwise_conv2d`, under Keras's
`DepthwiseConv2D` and `SeparableConv2D`, EfficientNet, MobileNet, Xception)
lowers forward on a mesh, but neither of its gradient ops does
(`DepthwiseConv2dNativeBackpropInput` and `...BackpropFilter` "do not
implement layout propagation", on any mesh, also after a relayout of their
inputs to replicated). Their math is k·k shifted slices of the input times a
per-channel weight:

    y[b, h, w, c·M + m] = Σ_ij x_pad[b, h·s + i·d, w·s + j·d, c] · W[i, j, c, m]

so the kernel's gradient is, for each tap (i, j), one product and sum

    dW[i, j, c, m] = Σ_bhw x_pad[b, h·s + i·d, w·s + j·d, c] · dy[b, h, w, c, m]

and the input's is the forward op itself: the output gradient spread to
stride 1 and correlated with the flipped kernel (dilation d) over C·M
channels, then summed over m. Slices, products, sums, pads, reshapes and the
forward depthwise op all have DTensor rules. The forward pass stays the
native op; the backward pass recomputes each tap's slice from the input kept
for the native gradient (nothing k² times the activations is kept from the
forward pass). `bench/depthwise.py` measures it against the native gradient.

An average pooling's gradient (`AvgPoolGrad`, DenseNet's transitions) has no
DTensor rule either; it is the input gradient of a depthwise convolution with
a kernel of ones, the output gradient divided by each window's count.
"""

from __future__ import annotations

import contextlib
import re

import tensorflow as tf

from tfdist import compat
from tfdist.errors import UsageError

DEPTHWISE = "DepthwiseConv2dNative"
AVG_POOL = "AvgPool"


def _pads(padding: str, explicit, size: int, out: int, kernel: int, stride: int,
          dilation: int, dim: int) -> tuple:
    """(before, after) padding of spatial dimension `dim` (1 or 2 in NHWC)."""
    if padding == "VALID":
        return 0, 0
    if padding == "EXPLICIT":
        return int(explicit[2 * dim]), int(explicit[2 * dim + 1])
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)   # SAME
    return total // 2, total - total // 2


def _spread(g, stride_h: int, stride_w: int, rows: int, cols: int):
    """[B, Ho, Wo, C] placed at every `stride`-th position of a zero
    [B, rows, cols, C] (rows = (Ho-1)·stride_h + 1)."""
    if stride_h == 1 and stride_w == 1:
        return g
    _, ho, wo, c = g.shape
    g = g[:, :, None, :, None, :]
    g = tf.pad(g, [[0, 0], [0, 0], [0, stride_h - 1], [0, 0], [0, stride_w - 1], [0, 0]])
    g = tf.reshape(g, [-1, ho * stride_h, wo * stride_w, c])
    return g[:, :rows, :cols, :]


def depthwise_gradients(x, kernel, dy, *, strides, padding: str, dilations,
                        explicit_paddings=()):
    """(dx, dkernel) of `tf.nn.depthwise_conv2d(x, kernel, ...)` for output
    gradient `dy`, all NHWC; `strides`/`dilations` as the op's 4-vectors."""
    k_h, k_w, channels, multiplier = kernel.shape
    _, height, width, _ = x.shape
    _, out_h, out_w, _ = dy.shape
    if None in (k_h, k_w, channels, multiplier, height, width, out_h, out_w):
        raise ValueError("a depthwise convolution's gradient on a mesh needs static spatial "
                         f"shapes; got input {x.shape}, kernel {kernel.shape}, output {dy.shape}")
    s_h, s_w, d_h, d_w = strides[1], strides[2], dilations[1], dilations[2]
    top, bottom = _pads(padding, explicit_paddings, height, out_h, k_h, s_h, d_h, 1)
    left, right = _pads(padding, explicit_paddings, width, out_w, k_w, s_w, d_w, 2)
    x_pad = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
    padded_h, padded_w = height + top + bottom, width + left + right
    dy5 = tf.reshape(dy, [-1, out_h, out_w, channels, multiplier])
    # Each tap's strided view of x_pad as a unit-stride slice: rows split into
    # (row // s, row % s), so offset i·d is block (i·d) // s, phase (i·d) % s.
    # (A strided slice per tap was 10x slower than the whole native gradient.)
    blocks_h, blocks_w = -(-padded_h // s_h), -(-padded_w // s_w)
    phased = tf.reshape(
        tf.pad(x_pad, [[0, 0], [0, blocks_h * s_h - padded_h], [0, blocks_w * s_w - padded_w],
                       [0, 0]]),
        [-1, blocks_h, s_h, blocks_w, s_w, channels])
    taps = []
    for i in range(k_h):
        for j in range(k_w):
            bi, pi = divmod(i * d_h, s_h)
            bj, pj = divmod(j * d_w, s_w)
            tap = phased[:, bi:bi + out_h, pi, bj:bj + out_w, pj, :]
            taps.append(tf.reduce_sum(tap[..., None] * dy5, axis=[0, 1, 2]))
    dkernel = tf.reshape(tf.stack(taps), [k_h, k_w, channels, multiplier])
    dx = depthwise_input_gradient(height, width, kernel, dy, strides=strides, padding=padding,
                                  dilations=dilations, explicit_paddings=explicit_paddings)
    return dx, dkernel


def depthwise_input_gradient(height: int, width: int, kernel, dy, *, strides, padding: str,
                             dilations, explicit_paddings=()):
    """dx of `tf.nn.depthwise_conv2d(x, kernel, ...)` for an input `x` of
    `height` x `width` (NHWC): it needs no values of x."""
    k_h, k_w, channels, multiplier = kernel.shape
    _, out_h, out_w, _ = dy.shape
    s_h, s_w, d_h, d_w = strides[1], strides[2], dilations[1], dilations[2]
    top, bottom = _pads(padding, explicit_paddings, height, out_h, k_h, s_h, d_h, 1)
    left, right = _pads(padding, explicit_paddings, width, out_w, k_w, s_w, d_w, 2)
    padded_h, padded_w = height + top + bottom, width + left + right
    rows, cols = (out_h - 1) * s_h + 1, (out_w - 1) * s_w + 1   # the taps' extent
    # dx_pad[p] = Σ_i dy_spread[p - i·d] · W[i]: a full correlation of the
    # output gradient, spread to stride 1, with the flipped kernel, i.e. the
    # forward depthwise op (which DTensor lays out) on C·M channels.
    spread = _spread(dy, s_h, s_w, rows, cols)
    spread = tf.pad(spread, [[0, 0], [(k_h - 1) * d_h, padded_h - rows],
                             [(k_w - 1) * d_w, padded_w - cols], [0, 0]])
    flipped = tf.reshape(kernel[::-1, ::-1], [k_h, k_w, channels * multiplier, 1])  # no ReverseV2
    dx_pad = tf.nn.depthwise_conv2d(spread, flipped, [1, 1, 1, 1], "VALID",
                                    dilations=[d_h, d_w])
    dx_pad = tf.reduce_sum(tf.reshape(dx_pad, [-1, padded_h, padded_w, channels, multiplier]),
                           axis=-1)
    return dx_pad[:, top:top + height, left:left + width, :]


def avg_pool_input_gradient(x_shape, dy, *, ksize, strides, padding: str):
    """dx of `tf.nn.avg_pool2d(x, ksize, strides, padding)` (NHWC): each
    output's gradient divided by the number of inputs its window averaged
    (k·k, fewer at a SAME border), then handed back to those inputs, which
    is the input gradient of a depthwise convolution with a kernel of ones."""
    _, height, width, channels = x_shape
    k_h, k_w = ksize[1], ksize[2]
    if padding == "SAME":
        counts = tf.nn.depthwise_conv2d(tf.ones([1, height, width, 1], dy.dtype),
                                        tf.ones([k_h, k_w, 1, 1], dy.dtype), strides, "SAME")
        dy = dy / counts
    else:
        dy = dy / tf.cast(k_h * k_w, dy.dtype)
    ones = tf.ones([k_h, k_w, channels, 1], dy.dtype)
    return depthwise_input_gradient(height, width, ones, dy, strides=strides, padding=padding,
                                    dilations=[1, 1, 1, 1])


def _attr(op, name):
    value = op.get_attr(name)
    return value.decode() if isinstance(value, bytes) else value


def _depthwise_grad(op, grad):
    """The registered gradient of `DepthwiseConv2dNative`, as `depthwise_gradients`."""
    x, kernel = op.inputs[0], op.inputs[1]
    fmt = _attr(op, "data_format")
    strides, dilations = list(_attr(op, "strides")), list(_attr(op, "dilations"))
    explicit = list(_attr(op, "explicit_paddings"))
    if fmt == "NCHW":   # to NHWC and back
        x, grad = tf.transpose(x, [0, 2, 3, 1]), tf.transpose(grad, [0, 2, 3, 1])
        strides = [strides[0], strides[2], strides[3], strides[1]]
        dilations = [dilations[0], dilations[2], dilations[3], dilations[1]]
        if explicit:
            explicit = explicit[0:2] + explicit[4:8] + explicit[2:4]
    dx, dkernel = depthwise_gradients(x, kernel, grad, strides=strides,
                                      padding=_attr(op, "padding"), dilations=dilations,
                                      explicit_paddings=explicit)
    if fmt == "NCHW":
        dx = tf.transpose(dx, [0, 3, 1, 2])
    return dx, dkernel


def _avg_pool_grad(op, grad):
    """The registered gradient of `AvgPool`, as `avg_pool_input_gradient`."""
    x = op.inputs[0]
    ksize, strides = list(_attr(op, "ksize")), list(_attr(op, "strides"))
    if None in x.shape[1:] or _attr(op, "data_format") != "NHWC":
        raise ValueError("an average pooling's gradient on a mesh needs NHWC and static "
                         f"spatial shapes; got input {x.shape}, {_attr(op, 'data_format')}")
    return avg_pool_input_gradient(x.shape, grad, ksize=ksize, strides=strides,
                                   padding=_attr(op, "padding"))


@contextlib.contextmanager
def shardable_gradients():
    """Within: gradients of the ops above are taken as written here."""
    with compat.gradient_overridden(DEPTHWISE, _depthwise_grad), \
            compat.gradient_overridden(AVG_POOL, _avg_pool_grad):
        yield


# -- what DTensor cannot lay out, found before it compiles ------------------------

# Op types seen to fail DTensor's lowering on TF 2.21 ("does not implement
# layout propagation"; `make audit`, docs/dtensor_coverage.md): RNN layers'
# TensorLists, Bidirectional's ReverseV2, the softplus gradient, ZeRO-3's
# RNN MatrixDiagPartV3, SpectralNormalization's OptionalNone. An op outside
# `rules.OPS_WITH_RULES` is refused only once it was seen to fail:
# many others (variable reads, the input iterator) are lowered by DTensor's
# passes without a rule.
SEEN_WITHOUT_RULE = frozenset({
    "DepthwiseConv2dNativeBackpropFilter", "DepthwiseConv2dNativeBackpropInput", "AvgPoolGrad",
    "SoftplusGrad",
    "ReverseV2", "MatrixDiagPartV3", "OptionalNone", "TensorListFromTensor",
    "TensorListStack", "TensorListLength", "TensorListElementShape", "TensorListPushBack",
    "TensorListPopBack", "TensorListConcatV2", "TensorListSplit", "TensorListGather",
    "TensorListScatterIntoExistingList", "TensorListResize"})


class Unlowerable(UsageError):
    """A traced program holds op `op` (in `layer`), which DTensor cannot lay out."""

    def __init__(self, op: str, layer: str):
        super().__init__(
            f"layer {layer!r} uses the TensorFlow op {op}, which DTensor (TensorFlow "
            f"{tf.__version__}) cannot lay out; --strategy=dtensor cannot train this model "
            "(docs/dtensor_coverage.md): train it under default, mirrored, multi_worker or "
            "horovod")
        self.op, self.layer = op, layer


def ops_without_rules(graph_def) -> list:
    """(op type, node name) of every op of `graph_def` (its functions too)
    that DTensor has no layout rule for and was seen to fail."""
    from tfdist.strategies.dtensor import rules as dtensor_rules
    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    return [(n.op, n.name) for n in nodes
            if n.op in SEEN_WITHOUT_RULE and n.op not in dtensor_rules.OPS_WITH_RULES]


def layer_of(node_name: str, layer_names) -> str:
    """The model layer whose name scope holds `node_name` (the longest layer
    name among its path's parts), else the node's name scope."""
    parts = node_name.split("/")
    # Keras's name scopes may add a call count: `my_lstm_1` for `my_lstm`.
    stems = {*parts, *(re.sub(r"_\d+$", "", part) for part in parts)}
    found = [name for name in layer_names if name in stems]
    return max(found, key=len) if found else "/".join(parts[:-1]) or node_name


def lowering_error(message: str):
    """(op, one-line reason) from a DTensor compile error's text, or None
    when it is not one."""
    if "dtensor" not in message.lower() and "layout propagation" not in message:
        return None
    found = re.search(r"'tf\.(\w+)' op (.+)", message) or \
        re.search(r'see current operation: .*?"tf\.(\w+)"', message)
    reason = re.search(r"error: ([^\n]+)", message)
    if not found or not reason:
        return None
    return found.group(1), reason.group(1).split("\n")[0].strip()[:300]
