"""Where the DTensor engine's variables, gradients and optimizer slots live,
read from their shards: `--print_layouts` and the run summary."""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist import sharding
from tfdist.observe import logs
from tfdist.strategies.dtensor.variables import _lay_out, _read


class LayoutReport:
    """The introspection of `DTensorStrategy` (a part of it: it reads the
    engine's `mesh`, `axes` and `zero`)."""

    def device_bytes(self, variables) -> int:
        """Bytes of `variables` held by the first device of the mesh."""
        return sum(_shard_bytes(_read(v))[0] for v in variables)

    def summary_fields(self, model, optimizer) -> dict:
        return {"mesh": f"batch:{self.axes['batch']},model:{self.axes['model']}",
                # DTensor reduces inside its SPMD program, by layout; there is no
                # per-update gradient all-reduce whose size tfdist could state.
                "bytes_reduced_per_update": None,
                "zero_stage": self.zero,
                "shard_optimizer_state": self.zero >= 1,
                "device_parameter_bytes": self.device_bytes(model.variables),
                "device_optimizer_bytes": self.device_bytes(optimizer.variables)}

    def gradient_shards(self, model) -> Optional[list]:
        """The gradients of every trainable variable, as the trainer's backward
        pass leaves them (in `compute_scope`, then `shard_gradients`), for a
        stand-in loss (the sum of the outputs) on a batch of zeros: DTensors
        whose shards can be read. None for a model without symbolic inputs."""
        inputs = getattr(model, "inputs", None)
        if not inputs:
            return None
        batch = self.axes[sharding.BATCH]
        xs = [_lay_out(tf.zeros([batch, *i.shape[1:]], i.dtype),
                       dtensor.Layout.batch_sharded(self.mesh, sharding.BATCH, len(i.shape)))
              for i in inputs]
        variables = model.trainable_variables

        @tf.function(autograph=False)
        def gradients(*xs):
            with self.compute_scope(), tf.GradientTape() as tape:
                out = model(list(xs) if len(xs) > 1 else xs[0], training=True)
                loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                                 for o in tf.nest.flatten(out)])
            grads = tape.gradient(loss, variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return self.shard_gradients([tf.convert_to_tensor(g) for g in grads], variables)

        with dtensor.default_mesh(self.mesh), logs.quiet_absl():
            return gradients(*xs)

    def layout_rows(self, model, optimizer, gradients: bool = True) -> list:
        """One row per variable, gradient and optimizer slot: where it lives,
        read from its shards (`dtensor.unpack`), not computed from layouts.

        Each row: kind ("variable", "gradient", "slot"), path, shape, stored
        spec, compute spec (the layout a ZeRO-3 variable is gathered to for
        use; a gradient's is its variable's), global bytes, and the largest
        shard on a local device in bytes (`whole`: that shard is the whole).
        """
        rows = []

        def row(kind, path, value, compute=None):
            spec = _spec_of(value)
            shards = _shard_bytes(value)
            global_bytes = int(np.prod(value.shape)) * value.dtype.size
            rows.append({"kind": kind, "path": path, "shape": tuple(value.shape),
                         "stored": spec, "compute": compute or spec,
                         "global_bytes": global_bytes, "device_bytes": max(shards),
                         "whole": max(shards) == global_bytes})

        computes = {}
        for variable in model.variables:
            inner = variable.value if isinstance(variable, keras.Variable) else variable
            layout = getattr(inner, "compute_layout", None)
            computes[id(variable)] = _spec_of(layout) if layout is not None else None
            row("variable", variable.path, _read(variable), computes[id(variable)])
        grads = self.gradient_shards(model) if gradients else None
        for variable, grad in zip(model.trainable_variables, grads or ()):
            row("gradient", variable.path, grad, computes[id(variable)] or
                _spec_of(_read(variable)))
        for variable in optimizer.variables:
            row("slot", variable.path, _read(variable))
        return rows

    def layout_report(self, model, optimizer) -> str:
        """A table of every variable, gradient and optimizer slot, and the
        per-device totals against one device's."""
        rows = self.layout_rows(model, optimizer)
        table = [("kind", "path", "shape", "stored", "compute", "global bytes", "bytes/device")]
        totals = {}
        for r in rows:
            total = totals.setdefault(r["kind"], [0, 0])
            total[0] += r["global_bytes"]
            total[1] += r["device_bytes"]
            table.append((r["kind"], r["path"], "x".join(map(str, r["shape"])) or "scalar",
                          sharding.describe_spec(r["stored"]), sharding.describe_spec(r["compute"]),
                          f"{r['global_bytes']:,}", f"{r['device_bytes']:,}"))
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) if i < 5 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(t, widths))).rstrip() for t in table]
        lines.insert(1, "-" * len(lines[0]))
        stage = {0: "", 1: " (ZeRO-1: optimizer slots also split over batch)",
                 2: " (ZeRO-2: optimizer slots and gradients also split over batch)",
                 3: " (ZeRO-3: variables, gradients and optimizer slots also split over "
                    "batch; variables gathered for use)"}[self.zero]
        lines.append(f"mesh batch:{self.axes['batch']} x model:{self.axes['model']}{stage}")
        names = {"variable": "parameters", "gradient": "gradients", "slot": "optimizer"}
        for kind, (global_bytes, device) in totals.items():
            lines.append(f"{names[kind]} total: {global_bytes:,} bytes; per device {device:,} "
                         f"({device / max(global_bytes, 1):.2f}x)")
        gathered = [r for r in rows if r["kind"] == "variable" and r["compute"] != r["stored"]]
        if gathered:
            top = max(gathered, key=lambda r: r["global_bytes"] // _split(r["compute"], self.axes))
            lines.append(f"largest gathered weight: {top['path']}, "
                         f"{top['global_bytes'] // _split(top['compute'], self.axes):,} bytes "
                         f"per device while in use")
        both = [sum(t[i] for t in totals.values()) for i in (0, 1)]
        what = " + ".join(names[k] for k in totals)
        lines.append(f"{what} per device: {both[1]:,} bytes "
                     f"({both[1] / max(both[0], 1):.2f}x of {both[0]:,})")
        return "\n".join(lines)


def _spec_of(value_or_layout) -> tuple:
    layout = (value_or_layout if isinstance(value_or_layout, dtensor.Layout)
              else dtensor.fetch_layout(value_or_layout))
    return tuple(None if a == dtensor.UNSHARDED else a for a in layout.sharding_specs)


def _shard_bytes(value) -> list:
    """Bytes of each local device's shard of DTensor `value`."""
    return [int(np.prod(t.shape)) * t.dtype.size for t in dtensor.unpack(value)]


def _split(spec, axes) -> int:
    return int(np.prod([axes[a] for a in spec if a]))
