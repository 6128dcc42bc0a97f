"""FLOPs per example (checked against hand counts) and the cached matmul peak."""

import json
import logging

import keras
import pytest
import tensorflow as tf
from keras import layers

from common import IMAGE_SPEC, TOKEN_SPEC
from tfdist import models
from tfdist.config import ModelConfig
from tfdist.observe import flops, peak


def _model(input_shape, *stack):
    x = inputs = keras.Input(input_shape)
    for layer in stack:
        x = layer(x)
    return keras.Model(inputs, x)


def _conv(out_h, out_w, out_c, kernel, in_c):
    """Hand count of a 2-D convolution: 2 FLOPs per multiply-add."""
    return 2 * out_h * out_w * out_c * kernel * kernel * in_c


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_stack_is_2_in_out_per_layer_times_3(use_bias):
    model = _model((784,), *(layers.Dense(units, use_bias=use_bias) for units in (256, 128, 10)))
    forward = 2 * (784 * 256 + 256 * 128 + 128 * 10)
    assert flops.forward_flops(model) == forward
    assert flops.training_flops_per_example(model) == 3 * forward


def test_strided_same_padding_conv2d():
    # 9x9 at stride 2 with 'same' padding: ceil(9 / 2) = 5 rows and columns.
    model = _model((9, 9, 3), layers.Conv2D(4, 3, strides=2, padding="same"),
                   layers.Conv2D(6, 1))
    assert flops.forward_flops(model) == _conv(5, 5, 4, 3, 3) + _conv(5, 5, 6, 1, 4)


@pytest.mark.parametrize("layer,input_shape,expected", [
    # Conv1D lowers to a Conv2D of height 1: 10 outputs x 8 channels x (5 x 3).
    (layers.Conv1D(8, 5, strides=2, padding="same"), (20, 3), 2 * 10 * 8 * 5 * 3),
    # Depthwise: each of 4 x 2 output channels sees one input channel.
    (layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same"), (10, 10, 4),
     2 * 10 * 10 * 8 * 3 * 3),
    # Grouped: Keras runs it in a nested function; 2 input channels per group.
    (layers.Conv2D(6, 3, groups=2, padding="same"), (10, 10, 4), _conv(10, 10, 6, 3, 2)),
    # Transposed: the 5x5x4 input gradient of a conv to 6 channels, as costly as that conv.
    (layers.Conv2DTranspose(6, 3, strides=2, padding="same"), (5, 5, 4), _conv(5, 5, 4, 3, 6)),
])
def test_other_convolutions(layer, input_shape, expected):
    assert flops.forward_flops(_model(input_shape, layer)) == expected


def test_dense_einsum_dense_and_attention_on_sequences():
    length, dim, heads, head_dim = 6, 8, 2, 4
    inputs = keras.Input((length, dim))
    x = layers.Dense(12)(inputs)                                            # Tensordot MatMul
    x = layers.EinsumDense("...b,bc->...c", output_shape=(12,))(x)          # ellipsis Einsum
    x = layers.MultiHeadAttention(heads, head_dim)(x, x)                    # BatchMatMul + Einsum
    model = keras.Model(inputs, x)
    inner = heads * head_dim
    expected = (2 * length * dim * 12 + 2 * length * 12 * 12
                + 3 * 2 * length * 12 * inner      # query, key, value projections
                + 2 * 2 * length * length * inner  # scores and scores x values
                + 2 * length * inner * 12)         # output projection
    assert flops.forward_flops(model) == expected


class _Branchy(layers.Layer):
    """A matmul, then an If with a 1- and a 2-matmul branch, then a While."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], input_shape[-1]))

    def call(self, x):
        x = tf.matmul(x, self.w)
        x = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, self.w),
                    lambda: tf.matmul(tf.matmul(x, self.w), self.w))
        _, x = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.matmul(y, self.w)),
                             (tf.constant(0), x))
        return x


def test_nested_functions_costlier_branch_and_one_loop_pass():
    per_matmul = 2 * 5 * 5
    assert flops.forward_flops(_model((5,), _Branchy())) == (1 + 2 + 1) * per_matmul


def test_dict_inputs_and_an_explicit_signature():
    a, b = keras.Input((3,), name="a"), keras.Input((4,), name="b")
    model = keras.Model({"a": a, "b": b}, layers.Dense(2)(layers.Concatenate()([a, b])))
    assert flops.forward_flops(model) == 2 * 7 * 2
    signature = {"a": tf.TensorSpec((1, 3)), "b": tf.TensorSpec((1, 4))}
    assert flops.forward_flops(model, signature) == 2 * 7 * 2


def test_uncountable_model_warns_and_returns_none(caplog):
    model = _model((None, 4), layers.Dense(3))  # sequence length unknown: no static shape
    with caplog.at_level(logging.WARNING):
        assert flops.try_training_flops_per_example(model) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "MFU will not be reported" in warnings[0]


def test_an_open_length_is_counted_on_the_data_shape():
    """keras-hub's models take any sequence length: the FLOPs are counted for
    one example of the data instead (the control: without it, none)."""
    model = _model((None, 4), layers.Dense(3))
    assert flops.try_forward_flops_by_op(model) is None
    by_op = flops.try_forward_flops_by_op(model, lambda: tf.TensorSpec((1, 5, 4)))
    assert sum(by_op.values()) == 2 * 5 * 4 * 3


def test_mlp_builder():
    config = ModelConfig(name="mlp", width=16, depth=2)
    model = models.build(config, IMAGE_SPEC)
    pixels = 8 * 8 * 3
    forward = 2 * (pixels * 16 + 16 * 16 + 16 * IMAGE_SPEC.num_classes)
    assert flops.training_flops_per_example(model) == 3 * forward


def test_cnn_builder():
    width, depth = 8, 2
    model = models.build(ModelConfig(name="cnn", width=width, depth=depth), IMAGE_SPEC)
    # 8x8 images: the stem (stride 2) leaves 4x4, the stage-1 transition 2x2.
    expected = (_conv(4, 4, width, 3, 3)                                   # stem
                + 2 * depth * _conv(4, 4, width, 3, width)                 # stage 0
                + _conv(2, 2, 2 * width, 3, width)                         # transition conv_a
                + _conv(2, 2, 2 * width, 1, width)                         # projection
                + _conv(2, 2, 2 * width, 3, 2 * width)                     # transition conv_b
                + 2 * (depth - 1) * _conv(2, 2, 2 * width, 3, 2 * width)   # stage 1 rest
                + 2 * 2 * width * IMAGE_SPEC.num_classes)                  # logits
    assert flops.forward_flops(model) == expected


def test_transformer_builder():
    config = ModelConfig(name="transformer", width=16, depth=2, num_heads=2)
    model = models.build(config, TOKEN_SPEC)
    length = TOKEN_SPEC.input_shape[0]
    # Every Dense/EinsumDense kernel multiplies each position once: 2 x size x
    # length (embeddings are lookups: none). Attention adds scores (T x T x
    # width) and scores x values per block, masked or not (the causal mask
    # does not skip work). The count must be exactly their sum: no tolerance.
    kernels = sum(2 * int(tf.size(w)) * length
                  for w in model.trainable_weights if w.path.endswith("kernel"))
    attention = config.depth * 2 * 2 * length * length * config.width
    count = flops.forward_flops(model)
    assert 0 < kernels <= count == kernels + attention


def test_mfu_arithmetic():
    assert flops.model_tflops(1000, 3e9) == pytest.approx(3.0)
    assert flops.mfu(1000, 3e9, peak_tflops=6.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_tflops"):
        flops.mfu(1000, 3e9, peak_tflops=0)


def _no_probe(dtype):
    raise AssertionError(f"measured {dtype} although it was cached")


def test_peak_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    measured = peak.matmul_peak_tflops("float32")
    assert measured > 0
    assert (tmp_path / "peak.json").exists()
    monkeypatch.setattr(peak, "_measure_tflops", _no_probe)
    assert peak.matmul_peak_tflops("float32") == measured


def test_corrupt_cache_is_ignored_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    (tmp_path / "peak.json").write_text('{"half a fi')
    monkeypatch.setattr(peak, "_measure_tflops", lambda dtype: 1.25)
    assert peak.matmul_peak_tflops("bfloat16") == 1.25
    assert list(json.loads((tmp_path / "peak.json").read_text()).values()) == [1.25]
    monkeypatch.setattr(peak, "_measure_tflops", _no_probe)
    assert peak.matmul_peak_tflops("bfloat16") == 1.25


def test_refresh_keeps_the_higher_peak(tmp_path, monkeypatch, capsys):
    """A probe that shares the cores measures low: a refresh never lowers the entry."""
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    for measured, kept in ((0.5, 0.5), (0.3, 0.5), (0.8, 0.8)):
        monkeypatch.setattr(peak, "_measure_tflops", lambda dtype: measured)
        assert peak.matmul_peak_tflops("float32", refresh=True) == kept
    monkeypatch.setattr(peak, "_measure_tflops", _no_probe)
    assert peak.matmul_peak_tflops("float32") == 0.8
    monkeypatch.setattr(peak, "_measure_tflops", lambda dtype: 0.25)
    assert peak.main(["--dtype=float32", "--refresh"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "float32: 0.800 TFLOP/s (measured 0.250, kept the cached figure)")


def test_native_bf16_is_probed_at_float32_size(monkeypatch):
    from tfdist.observe import hardware
    for support, size in (("AMX", 2048), ("AVX-512", 2048), ("emulated", 1024)):
        monkeypatch.setattr(hardware, "bf16_support", lambda: support)
        assert peak._start_size("bfloat16") == size
        assert peak._start_size("float32") == 2048
        assert peak._start_size("float16") == 1024


def test_peak_cli_prints_measured_then_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TFDIST_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(peak, "_measure_tflops", lambda dtype: 0.5)
    assert peak.main(["--dtype=float32,float16"]) == 0
    assert peak.main(["--dtype=float16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["float32: 0.500 TFLOP/s (measured)", "float16: 0.500 TFLOP/s (measured)"]
    assert lines[4] == "float16: 0.500 TFLOP/s (cached)"
    with pytest.raises(SystemExit) as exit_info:
        peak.main(["--dtype=float64"])
    assert exit_info.value.code == 2


def test_compute_dtype_of_each_precision():
    assert [peak.compute_dtype(p) for p in ("float32", "mixed_bfloat16", "mixed_float16")] == [
        "float32", "bfloat16", "float16"]
    with pytest.raises(ValueError, match="mixed_bfloat16"):
        peak.compute_dtype("float64")
    with pytest.raises(ValueError, match="bfloat16"):
        peak.matmul_peak_tflops("float64")


def test_convolution_share_splits_the_count_by_op():
    """The cnn builder is nearly all convolution; the mlp none."""
    from tfdist import models
    from tfdist.config import ModelConfig
    from tfdist.data.spec import DatasetSpec

    spec = DatasetSpec(name="images", kind="image", input_shape=(32, 32, 3), num_classes=10)
    cnn = flops.forward_flops_by_op(models.build(ModelConfig(name="cnn"), spec))
    mlp = flops.forward_flops_by_op(models.build(ModelConfig(name="mlp"), spec))
    assert set(cnn) >= {"Conv2D", "MatMul"} and flops.convolution_share(cnn) > 0.99
    assert flops.convolution_share(mlp) == 0.0 and set(mlp) == {"MatMul"}
    assert sum(cnn.values()) == flops.forward_flops(models.build(ModelConfig(name="cnn"), spec))
