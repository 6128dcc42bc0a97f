"""The conformance matrix's models: real users' classes at tiny sizes.

Each entry of MODELS is a `Case`: how to build the Keras model (random init,
dropout 0), its DatasetSpec and dataset_fn (fixed random data, the same
stream under every engine), its tensor-parallel layout rules, and for the
keras-hub CausalLMs the class whose `generate` is checked after training.

Nothing here starts TensorFlow at import: `conformance/cells.py` imports it
after configuring the virtual CPU devices.
"""

import dataclasses
import re
from typing import Callable, Optional

import numpy as np

SEQ = 16          # token sequence length
BATCH = 8         # global batch
STEPS = 4         # training steps
IMAGE = (32, 32, 3)
CLASSES = 10


@dataclasses.dataclass
class Case:
    name: str
    family: str                       # "causal_lm" | "text_classifier" | "image"
    build: Callable                   # build(spec) -> keras.Model
    spec_args: dict
    layout: Callable                  # layout(model) -> (rules, description)
    causal_lm: Optional[str] = None   # keras_hub.models.<name> for the generate check
    batch_norm: bool = False          # has BatchNormalization (per-replica batch statistics)
    learning_rate: Optional[float] = None   # instead of cells.py's default for its optimizer
    lora: bool = False                # keras-hub LoRA enabled: only the adapters train
    steps: Optional[int] = None       # instead of STEPS


def _spec(**kw):
    from tfdist.data.spec import DatasetSpec
    return DatasetSpec(**kw)


# -- data ---------------------------------------------------------------------------
def token_dataset_fn(vocab, with_segments=False, classify=False):
    """Random token sequences; targets the next ids (or, to classify, whether
    the first token is in the lower half of the vocabulary)."""
    import tensorflow as tf
    import tfdist

    def dataset_fn(split, context):
        rng = np.random.default_rng(2 if split == "train" else 3)
        n = BATCH * STEPS if split == "train" else BATCH
        seq = rng.integers(vocab, size=(n, SEQ + 1)).astype(np.int32)
        x = {"token_ids": seq[:, :-1], "padding_mask": np.ones((n, SEQ), np.int32)}
        if with_segments:
            x["segment_ids"] = np.zeros((n, SEQ), np.int32)
        y = (seq[:, 0] < vocab // 2).astype(np.int32) if classify else seq[:, 1:]
        return tfdist.shard(tf.data.Dataset.from_tensor_slices((x, y)), context)

    return dataset_fn


def image_dataset_fn(split, context):
    import tensorflow as tf
    import tfdist
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = BATCH * STEPS if split == "train" else BATCH
    x = rng.normal(size=(n, *IMAGE)).astype(np.float32)
    y = rng.integers(CLASSES, size=n).astype(np.int32)
    return tfdist.shard(tf.data.Dataset.from_tensor_slices((x, y)), context)


def dataset_fn_for(case):
    if case.family == "image":
        return image_dataset_fn
    vocab = case.spec_args["num_classes"] if case.family == "causal_lm" else 64
    return token_dataset_fn(vocab if case.family == "causal_lm" else 64,
                            with_segments=case.name.startswith("bert"),
                            classify=case.family == "text_classifier")


def spec_for(case):
    return _spec(name=f"conformance_{case.name}", **case.spec_args)


# -- keras-hub CausalLMs ---------------------------------------------------------------
def _token_inputs(segments=False):
    import keras
    inputs = {"token_ids": keras.Input((SEQ,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((SEQ,), dtype="int32", name="padding_mask")}
    if segments:
        inputs["segment_ids"] = keras.Input((SEQ,), dtype="int32", name="segment_ids")
    return inputs


def _causal_lm(backbone_cls, **kwargs):
    """The keras-hub CausalLM itself, preprocessor=None: a functional model
    from the backbone's inputs (token_ids, padding_mask) to next-token logits
    (`backbone.token_embedding(hidden, reverse=True)`)."""
    def build(spec):
        import keras_hub
        backbone = getattr(keras_hub.models, backbone_cls)(
            vocabulary_size=spec.num_classes, name="backbone", **kwargs)
        lm_cls = getattr(keras_hub.models, backbone_cls.replace("Backbone", "CausalLM"))
        return lm_cls(backbone=backbone, preprocessor=None)
    return build


def _hub_layout(backbone_cls):
    """The backbone's own `get_layout_map` (keras-hub 0.32.0), on a 2x2 mesh."""
    def layout(model):
        import keras
        import keras_hub
        mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"],
                                             devices=[f"cpu:{i}" for i in range(4)])
        return (getattr(keras_hub.models, backbone_cls).get_layout_map(mesh),
                f"keras_hub.models.{backbone_cls}.get_layout_map")
    return layout


def split_large_kernels(model, share=0.02):
    """Documented regex rules (tfdist.sharding, `re.search`) splitting each
    large kernel's last dimension on `model`: every rank-2/3/4 `kernel` or
    `embeddings` variable holding at least `share` of the parameters whose
    last dimension is even. Depthwise kernels (last dimension 1) stay
    replicated."""
    total = sum(int(np.prod(v.shape)) for v in model.weights)
    rules = []
    for v in model.weights:
        shape = tuple(v.shape)
        leaf = v.path.rsplit("/", 1)[-1]
        if leaf not in ("kernel", "embeddings") or len(shape) < 2 or shape[-1] % 2:
            continue
        if np.prod(shape) < share * total:
            continue
        rules.append(("(^|/)" + re.escape(v.path) + "$", (None,) * (len(shape) - 1) + ("model",)))
    return rules


def _regex_layout(model):
    rules = split_large_kernels(model)
    return rules, f"{len(rules)} regex rules: each kernel >= 2% of the parameters split on model"


# -- classifiers ------------------------------------------------------------------------
def _bert(spec):
    import keras
    import keras_hub
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=SEQ, name="backbone")
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None,
                                               dropout=0.0)


def _with_lora(build, rank=2):
    """`build`'s keras-hub model with `backbone.enable_lora(rank)` (query and
    value projections): its other weights are frozen."""
    def build_lora(spec):
        model = build(spec)
        model.backbone.enable_lora(rank)
        return model
    return build_lora


def _vit(spec):
    import keras
    import keras_hub
    backbone = keras_hub.models.ViTBackbone(
        image_shape=IMAGE, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
        name="backbone")
    return keras_hub.models.ViTImageClassifier(backbone, num_classes=CLASSES,
                                               preprocessor=None, dropout=0.0)


def _no_dropout(model):
    """keras.applications constructors (EfficientNetB0) take no dropout rate:
    their Dropout layers (top dropout, drop-connect) get rate 0 instead, so
    every engine computes the same function (Keras draws dropout masks the
    shape of the local batch: engines with other local batches drop other
    units)."""
    import keras
    from tfdist import compat
    for layer in compat.model_layers(model):
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def _application(fn_name, **kwargs):
    def build(spec):
        import keras
        fn = getattr(keras.applications, fn_name)
        return _no_dropout(fn(weights=None, input_shape=IMAGE, classes=CLASSES,
                              classifier_activation=None, **kwargs))
    return build


_LM = dict(kind="tokens", input_shape=(SEQ,), num_classes=32,
           train_examples=BATCH * STEPS, eval_examples=BATCH)
_IMG = dict(kind="image", input_shape=IMAGE, num_classes=CLASSES,
            train_examples=BATCH * STEPS, eval_examples=BATCH)

MODELS = {c.name: c for c in [
    Case("llama", "causal_lm",
         _causal_lm("LlamaBackbone", num_layers=1, num_query_heads=2, num_key_value_heads=2,
                    hidden_dim=16, intermediate_dim=32),
         _LM, _hub_layout("LlamaBackbone"), causal_lm="LlamaCausalLM"),
    Case("gemma", "causal_lm",
         _causal_lm("GemmaBackbone", num_layers=1, num_query_heads=2, num_key_value_heads=1,
                    hidden_dim=16, intermediate_dim=32, head_dim=8),
         _LM, _hub_layout("GemmaBackbone"), causal_lm="GemmaCausalLM"),
    Case("gpt2", "causal_lm",
         _causal_lm("GPT2Backbone", num_layers=1, num_heads=2, hidden_dim=16,
                    intermediate_dim=32, dropout=0.0, max_sequence_length=SEQ),
         _LM, _regex_layout, causal_lm="GPT2CausalLM"),
    Case("qwen", "causal_lm",
         _causal_lm("QwenBackbone", num_layers=1, num_query_heads=2, num_key_value_heads=2,
                    hidden_dim=16, intermediate_dim=32),
         _LM, _hub_layout("QwenBackbone"), causal_lm="QwenCausalLM"),
    Case("bert", "text_classifier", _bert,
         dict(kind="tokens", input_shape=(SEQ,), num_classes=2,
              train_examples=BATCH * STEPS, eval_examples=BATCH), _regex_layout),
    Case("vit", "image", _vit, _IMG, _regex_layout),
    # Fine-tuning with LoRA: a Llama (every engine but the pipeline, which
    # refuses its tied embedding) and a BERT classifier (the pipeline too).
    Case("llama_lora", "causal_lm",
         _with_lora(_causal_lm("LlamaBackbone", num_layers=1, num_query_heads=2,
                               num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)),
         _LM, _hub_layout("LlamaBackbone"), causal_lm="LlamaCausalLM", lora=True),
    Case("bert_lora", "text_classifier", _with_lora(_bert),
         dict(kind="tokens", input_shape=(SEQ,), num_classes=2,
              train_examples=BATCH * STEPS, eval_examples=BATCH), _regex_layout, lora=True),
    # EfficientNetB0 at 32x32 is chaotic: on the default engine alone, initial
    # weights perturbed by 1e-7 (relative) end 1.2e-2 of the weights' scale
    # apart after 4 SGD steps at lr 1e-3 (6.6e-2 for 1e-6), so 4 steps cannot
    # tell another engine's float32 reordering from an error; one step can.
    # lr 1e-6: with BatchNorm over 4 examples per replica (its last feature
    # maps are 1x1) the gradient reaches 1.4e3, and one SGD step of that very
    # function, taken on the host, raises its loss at lr 1e-4 and 1e-5 (5.47 ->
    # 7.69, 6.80) and lowers it only at 1e-6 (4.61).
    Case("efficientnetb0", "image", _application("EfficientNetB0"), _IMG, _regex_layout,
         batch_norm=True, learning_rate=1e-6, steps=1),
    Case("mobilenetv3small", "image",
         _application("MobileNetV3Small", include_preprocessing=False, dropout_rate=0.0),
         _IMG, _regex_layout, batch_norm=True),
    # DenseNet121 too: perturbed by 1e-7, its default-engine weights end 1.4e-1
    # apart after 4 SGD steps at lr 0.01; one step.
    Case("densenet121", "image", _application("DenseNet121"), _IMG, _regex_layout,
         batch_norm=True, steps=1),
]}
