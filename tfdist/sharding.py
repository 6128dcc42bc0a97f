"""Tensor-sharding layout rules for `--strategy=dtensor`, in the shape of
Keras 3's `LayoutMap`: an ordered list of (regex over the variable path,
sharding spec).

A spec has one entry per dimension of the variable: a mesh axis name
("batch", "model") to split that dimension over, or None to keep it whole.
Variables no rule matches are replicated. A path matched by two rules, an
unknown mesh axis, an axis used twice, a spec of the wrong rank or a
dimension not divisible by its axis size is a `UsageError` naming the
variable, raised while the model is built, before any training.

Pure Python: no TensorFlow here, so rules can be checked and printed cheaply.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

from tfdist.errors import UsageError

Spec = tuple  # e.g. (None, "model")
BATCH, MODEL = "batch", "model"


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """`--mesh=batch:2,model:2` -> (("batch", 2), ("model", 2))."""
    axes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition(":")
        if not name or not (size.isascii() and size.isdigit()) or int(size) < 1:
            raise UsageError(f"--mesh={text!r}: {part!r} is not name:size with a size >= 1; "
                             "expected e.g. batch:2,model:2")
        axes.append((name, int(size)))
    names = [n for n, _ in axes]
    if sorted(names) != [BATCH, MODEL]:
        raise UsageError(f"--mesh={text!r} must name exactly the axes {BATCH} and {MODEL} "
                         "once each, e.g. batch:2,model:2")
    return tuple(axes)


class LayoutRules:
    """Ordered (regex, spec) rules; `spec_for(path, shape, axes)` picks one."""

    def __init__(self, rules: Iterable[tuple[str, Sequence[Optional[str]]]] = ()):
        self.rules = [(re.compile(pattern), tuple(spec)) for pattern, spec in rules]

    def __iter__(self):
        return ((p.pattern, s) for p, s in self.rules)

    def __len__(self):
        return len(self.rules)

    def spec_for(self, path: str, shape: Sequence[int], axes: dict[str, int]) -> Spec:
        """The checked spec of variable `path` of `shape` on a mesh of `axes` sizes."""
        matches = [(p.pattern, s) for p, s in self.rules if p.search(path)]
        if len(matches) > 1:
            raise UsageError(f"layout rules: variable {path} is matched by more than one rule "
                             f"({matches[0][0]!r} and {matches[1][0]!r}); make them exclusive")
        if not matches:
            return (None,) * len(shape)
        pattern, spec = matches[0]
        check_spec(path, spec, shape, axes, rule=pattern)
        return spec


def check_spec(path: str, spec: Spec, shape: Sequence[int], axes: dict[str, int],
               rule: str = "") -> None:
    where = f"variable {path} (shape {tuple(shape)}, rule {rule!r})" if rule else \
        f"variable {path} (shape {tuple(shape)})"
    if len(spec) != len(shape):
        raise UsageError(f"layout rules: {where} has rank {len(shape)} but the spec "
                         f"{spec} has {len(spec)} entries")
    used = [a for a in spec if a is not None]
    for axis in used:
        if axis not in axes:
            raise UsageError(f"layout rules: {where}: unknown mesh axis {axis!r}; "
                             f"valid: {', '.join(axes)}")
    if len(set(used)) != len(used):
        raise UsageError(f"layout rules: {where}: spec {spec} uses a mesh axis twice")
    for dim, axis in enumerate(spec):
        if axis is not None and shape[dim] % axes[axis]:
            raise UsageError(f"layout rules: {where}: dimension {dim} of size {shape[dim]} "
                             f"is not divisible by mesh axis {axis}={axes[axis]}")


def zero_spec(spec: Spec, shape: Sequence[int], axes: dict[str, int]) -> Spec:
    """An optimizer slot's spec under `--shard_optimizer_state` (ZeRO-1).

    The variable's own spec, with the first whole dimension divisible by the
    batch axis also split over it, so the slot's memory falls with the whole
    mesh. Unchanged if no dimension qualifies (tiny or odd-sized variables).
    """
    if axes.get(BATCH, 1) == 1 or BATCH in spec:
        return spec
    for dim, axis in enumerate(spec):
        if axis is None and shape[dim] % axes[BATCH] == 0 and shape[dim] >= axes[BATCH]:
            return spec[:dim] + (BATCH,) + spec[dim + 1:]
    return spec


def describe_spec(spec: Spec) -> str:
    return "(" + ", ".join(a or "-" for a in spec) + ")" if spec else "()"
