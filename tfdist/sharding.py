"""Tensor-sharding layout rules for `--strategy=dtensor`, in the shape of
Keras 3's `LayoutMap`: an ordered list of (regex over the variable path,
sharding spec).

A spec has one entry per dimension of the variable: a mesh axis name
("batch", "model") to split that dimension over, or None to keep it whole.
Variables no rule matches are replicated. A path matched by two rules, an
unknown mesh axis, an axis used twice, a spec of the wrong rank or a
dimension not divisible by its axis size is a `UsageError` naming the
variable, raised while the model is built, before any training.

A `keras.distribution.LayoutMap` (e.g. keras-hub's `get_layout_map(mesh)`,
written for Keras on JAX) is accepted too (`as_layout_rules`): its keys are
matched as Keras matches them, which differs from tfdist's own rules (an
exact key, else `re.fullmatch` over the whole path; tfdist's rules use
`re.search`). Only its keys and layouts' axes are used, never its mesh.

Pure Python: no TensorFlow here, so rules can be checked and printed cheaply
(Keras is only looked at if the caller has already imported it).
"""

from __future__ import annotations

import re
import sys
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


# How a rule's pattern is matched against a variable path.
SEARCH = "search"   # tfdist's rules: re.search anywhere in the path
KERAS = "keras"     # a Keras LayoutMap's keys: the exact key, else re.fullmatch


class LayoutRules:
    """Ordered (regex, spec) rules; `spec_for(path, shape, axes)` picks one.

    match=SEARCH (tfdist's rules): a rule applies if its regex matches
    anywhere in the path (`re.search`). match=KERAS (made by `from_keras`):
    Keras's `LayoutMap` semantics, see `from_keras`.
    """

    def __init__(self, rules: Iterable[tuple[str, Sequence[Optional[str]]]] = (), *,
                 match: str = SEARCH):
        if match not in (SEARCH, KERAS):
            raise ValueError(f"match={match!r}: expected {SEARCH!r} or {KERAS!r}")
        self.match = match
        self.rules = [(re.compile(pattern), tuple(spec)) for pattern, spec in rules]

    @classmethod
    def from_keras(cls, layout_map) -> "LayoutRules":
        """A `keras.distribution.LayoutMap` as rules with Keras's semantics.

        Keras 3.15.1, keras/src/distribution/distribution_lib.py,
        `LayoutMap.__getitem__`: a path equal to a key takes that key's
        layout (no other key is consulted); otherwise every key is tried
        with `re.fullmatch(key, path)`, and more than one match raises.
        Values are `TensorLayout`s (`LayoutMap.__setitem__` wraps tuples);
        their `.axes` become the specs. The map's `DeviceMesh` is ignored:
        the run's mesh (`--mesh`, axes batch and model) is the one used, so
        an axis it lacks is a `UsageError` here, before anything is built.
        """
        rules = []
        for key in layout_map:
            layout = layout_map[key]          # the exact key: its own layout
            axes = tuple(getattr(layout, "axes", layout))
            for axis in axes:
                if axis is not None and axis not in (BATCH, MODEL):
                    raise UsageError(
                        f"LayoutMap key {key!r}: axis {axis!r} is not a mesh axis; tfdist's "
                        f"mesh has {BATCH} and {MODEL} (rename it to one of them, e.g. build "
                        f"the DeviceMesh with axis_names=({BATCH!r}, {MODEL!r}) for keras-hub's "
                        "get_layout_map, or use None to keep that dimension whole)")
            try:
                re.compile(key)
            except re.error as error:
                raise UsageError(f"LayoutMap key {key!r} is not a regular expression "
                                 f"({error})") from None
            rules.append((key, axes))
        return cls(rules, match=KERAS)

    def __iter__(self):
        return ((p.pattern, s) for p, s in self.rules)

    def __len__(self):
        return len(self.rules)

    def _matches(self, path: str) -> list[tuple[str, Spec]]:
        if self.match == SEARCH:
            return [(p.pattern, s) for p, s in self.rules if p.search(path)]
        exact = [(p.pattern, s) for p, s in self.rules if p.pattern == path]
        return exact or [(p.pattern, s) for p, s in self.rules if p.fullmatch(path)]

    def spec_for(self, path: str, shape: Sequence[int], axes: dict[str, int]) -> Spec:
        """The checked spec of variable `path` of `shape` on a mesh of `axes` sizes."""
        matches = self._matches(path)
        if len(matches) > 1:
            if self.match == KERAS:
                raise UsageError(
                    f"LayoutMap: variable {path} matches more than one key ({matches[0][0]!r} "
                    f"and {matches[1][0]!r}; Keras matches a key with re.fullmatch over the "
                    "whole path); make the keys exclusive")
            raise UsageError(f"layout rules: variable {path} is matched by more than one rule "
                             f"({matches[0][0]!r} and {matches[1][0]!r}); make them exclusive")
        if not matches:
            return (None,) * len(shape)
        pattern, spec = matches[0]
        check_spec(path, spec, shape, axes, rule=pattern)
        return spec


def is_keras_layout_map(rules) -> bool:
    """Whether `rules` is a `keras.distribution.LayoutMap` (without importing
    Keras: a caller holding one has imported it already)."""
    keras = sys.modules.get("keras")
    layout_map = getattr(getattr(keras, "distribution", None), "LayoutMap", None)
    return layout_map is not None and isinstance(rules, layout_map)


def as_layout_rules(rules) -> LayoutRules:
    """`layout_rules=` as `LayoutRules`: None or [(regex, spec)] (tfdist's
    re.search rules), a `keras.distribution.LayoutMap` (Keras's semantics,
    `LayoutRules.from_keras`), or `LayoutRules` as they are."""
    if isinstance(rules, LayoutRules):
        return rules
    if is_keras_layout_map(rules):
        return LayoutRules.from_keras(rules)
    return LayoutRules(rules or ())


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
    """The spec of what ZeRO splits over the batch axis as well (slots from
    stage 1, gradients from 2, variables at 3).

    The variable's own spec, with the first whole dimension divisible by the
    batch axis also split over it, so its memory falls with the whole mesh.
    Unchanged if no dimension qualifies (tiny or odd-sized variables; see
    `check_fsdp_split`).
    """
    if axes.get(BATCH, 1) == 1 or BATCH in spec:
        return spec
    for dim, axis in enumerate(spec):
        # A dimension on an axis of size 1 is whole too (e.g. `model` on batch:4,model:1).
        whole = axis is None or axes.get(axis, 1) == 1
        if whole and shape[dim] % axes[BATCH] == 0 and shape[dim] >= axes[BATCH]:
            return spec[:dim] + (BATCH,) + spec[dim + 1:]
    return spec


# Under ZeRO-3, a variable no dimension of which the batch axis divides stays
# whole over `batch` (replicated) if it is at most this many elements (biases
# and norms of odd widths); a larger one is an error naming it.
FSDP_WHOLE_LIMIT = 1 << 16


def check_fsdp_split(path: str, spec: Spec, stored: Spec, shape: Sequence[int],
                     axes: dict[str, int]) -> None:
    """`UsageError` if ZeRO-3 leaves a large variable whole on every device
    along `batch` (`stored` is `zero_spec(spec, ...)`)."""
    batch = axes.get(BATCH, 1)
    if batch == 1 or BATCH in stored:
        return
    size = 1
    for d in shape:
        size *= d
    if size <= FSDP_WHOLE_LIMIT:
        return
    free = [d for d, a in zip(shape, spec) if a is None or axes.get(a, 1) == 1]
    raise UsageError(
        f"--zero_stage=3: variable {path} (shape {tuple(shape)}, spec {describe_spec(spec)}) "
        f"cannot be split over batch={batch}: no dimension its layout rule leaves whole "
        f"({', '.join(map(str, free)) or 'none'}) is divisible by {batch}; use a batch axis "
        f"that divides one of them, or a layout rule that splits it")


def describe_spec(spec: Spec) -> str:
    return "(" + ", ".join(a or "-" for a in spec) + ")" if spec else "()"
