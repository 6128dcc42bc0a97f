"""BatchNormalization's statistics across replicas (`--sync_batchnorm`).

Under replicated engines each replica normalises with the statistics of its
own share of the batch (tfdist averages the moving statistics once per loop);
with `--sync_batchnorm`, or a layer's own `synchronized=True`, the engine
makes them the global batch's (`capabilities.GlobalBatchStatistics`), or the
run is refused where it cannot."""

from __future__ import annotations

import keras
from absl import logging

from tfdist import compat
from tfdist.errors import UsageError
from tfdist.strategies.capabilities import GlobalBatchStatistics, require
from tfdist.training import xla

FLAG = "--sync_batchnorm"


def check(train_config, strategy) -> None:
    """Before anything is built: `--sync_batchnorm` where the engine cannot,
    or with a step XLA compiles whole around the statistics' collective."""
    if not train_config.sync_batchnorm:
        return
    engine = require(strategy, GlobalBatchStatistics, FLAG)
    if train_config.jit_compile == "on" and _collective(engine):
        raise UsageError(_NO_XLA.format(what=FLAG))


_NO_XLA = ("{what} with --jit_compile=on: the statistics' all-reduce sits in the forward "
           "pass, which XLA cannot compile on CPU; use --jit_compile=auto (the optimizer "
           "update alone is compiled) or off")


def _collective(engine) -> bool:
    return engine.statistics_collective and engine.num_replicas > 1


def layers(model) -> list:
    """The model's BatchNormalization layers, nested ones included."""
    return [layer for layer in compat.model_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization)]


def prepare(train_config, strategy, model, jit_level: str) -> str:
    """After the model is built, before its step is traced: the statistics
    made global where asked (`synchronize`), the other layers fused (`fuse`);
    returns the XLA level."""
    jit_level = synchronize(train_config, strategy, model, jit_level)
    fuse(train_config, strategy, model)
    return jit_level


def synchronize(train_config, strategy, model, jit_level: str) -> str:
    """After the model is built, before its step is traced: the engine makes
    the statistics global where asked (by the flag, or by a layer the user
    built with `synchronized=True`); returns the XLA level, the optimizer
    update alone where the whole step would hold the statistics' collective."""
    norms = layers(model)
    own = [layer.name for layer in norms if layer.synchronized]
    if not (train_config.sync_batchnorm or own):
        return jit_level
    what = FLAG if train_config.sync_batchnorm else f"synchronized=True on layer {own[0]!r}"
    engine = require(strategy, GlobalBatchStatistics, what)
    if not norms:
        _log(strategy, f"{what}: the model has no BatchNormalization layer")
        return jit_level
    if train_config.jit_compile == "on" and _collective(engine):
        raise UsageError(_NO_XLA.format(what=what))
    _log(strategy, engine.synchronize_batch_statistics(norms))
    if _collective(engine) and jit_level == xla.STEP:
        _log(strategy, "--jit_compile=auto: the optimizer update alone is compiled (the "
                       "BatchNorm statistics' all-reduce sits in the forward pass)")
        return xla.OPTIMIZER
    return jit_level


def fuse(train_config, strategy, model) -> None:
    """With --fused_batchnorm (the default), every BatchNormalization layer
    whose statistics are its replica's own normalises with TensorFlow's fused
    kernel (`compat.fuse_batchnorm` says what and why); layers whose moments
    an engine reduces across replicas (`synchronize`, which runs first) keep
    Keras's call."""
    if not train_config.fused_batchnorm or not strategy.fused_kernels:
        return
    fused = [layer for layer in layers(model) if compat.fuse_batchnorm(layer)]
    if fused:
        _log(strategy, f"BatchNorm: {len(fused)} layer(s) use TensorFlow's fused kernel "
                       "(--nofused_batchnorm: Keras's own)")


def _log(strategy, line: str) -> None:
    if strategy.is_chief:
        logging.info("%s", line)
