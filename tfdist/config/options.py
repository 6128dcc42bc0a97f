"""One declaration per option: `option(...)` on a config dataclass field.

Each field of the run configuration's parts (`StrategyConfig`, ...) is
declared once, with its default, help, group, valid values and what a
planner needs to know (the engines that read it, the values a search may try,
whether changing it changes the math). Everything else is generated from
those declarations: the absl flags and their grouped `--help`
(`tfdist/flags.py`, `tfdist/help.py`), the field checks of the dataclasses
(an unknown keyword names the nearest option), the flagfile a run writes and
the Markdown flag reference (`tfdist/config/reference.py`).

No TensorFlow here: flags and `--help` must be instant.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import types
from typing import Any, Callable, Optional

from tfdist.errors import ConfigError

# Integers end up in TensorFlow int64 tensors (and the seed in NumPy's
# 32-bit legacy seeding), so larger ones fail deep inside a run.
INT_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1
# Timeouts beyond a week are a typo, and beyond ~2**31 s they overflow
# time.sleep and TensorFlow's int64 microsecond timeouts deep inside a run.
SECONDS_MAX = 7 * 24 * 3600

ENGINE = "engine and cluster"
SAME = "same as the API's"   # an option's command-line default, unless declared
GROUPS = ("engine and cluster", "model and data", "training", "precision and speed",
          "slow network", "faults", "output")


@dataclasses.dataclass(frozen=True)
class Option:
    """What is declared about one option (a field's metadata)."""

    help: str
    group: str
    flag: Optional[str] = None          # the command-line name (default: the field's)
    choices: tuple = ()                 # the valid values, if a fixed set
    lower: Optional[float] = None       # the flag's bounds (absl validates them)
    upper: Optional[float] = None
    check: Optional[Callable] = None    # check(name, value): raise ConfigError
    engines: tuple = ()                 # the engines that read it (empty: every engine)
    tunable: tuple = ()                 # values a search over plans may try
    math: bool = False                  # changing it changes what is computed
    cli_default: Any = SAME             # the flag's default, where it is not the API's
    registry: Optional[str] = None      # "strategy" or "model": a name its registry checks
    item: type = str                    # a list option's item type (on the command line)
    cli_none: Any = None                # the command-line value that stands for None


def option(default, *, help: str, group: str, **declared) -> dataclasses.Field:
    """A config field with its declaration (see `Option`)."""
    if group not in GROUPS:
        raise ValueError(f"option group {group!r} is not one of {GROUPS}")
    return dataclasses.field(default=default, metadata={"option": Option(help=help, group=group,
                                                                          **declared)})


def declaration(field: dataclasses.Field) -> Option:
    return field.metadata["option"]


def flag_name(field: dataclasses.Field) -> str:
    return declaration(field).flag or field.name


# -- checks ---------------------------------------------------------------------

def finite(value) -> bool:
    """A real number other than inf and nan (nan and inf pass `> 0` checks)."""
    return (not isinstance(value, bool) and isinstance(value, numbers.Real)
            and math.isfinite(value))


def _too_large(name: str, value, most: int) -> None:
    if value > most:
        raise ConfigError(f"{name}={value!r} is too large; at most {most}")


def positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer")
    _too_large(name, value, INT_MAX)


def non_negative(name: str, value, most: int = INT_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}={value!r} must be an integer >= 0")
    _too_large(name, value, most)


def seed(name: str, value) -> None:
    non_negative(name, value, most=SEED_MAX)


def seconds(name: str, value) -> None:
    if not (finite(value) and 0 < value <= SECONDS_MAX):
        raise ConfigError(f"{name}={value!r} must be a number of seconds > 0 and at most "
                          f"{SECONDS_MAX} (a week)")


def finite_positive(name: str, value) -> None:
    if not (finite(value) and value > 0):
        raise ConfigError(f"{name}={value!r} must be a finite number > 0")


def finite_non_negative(name: str, value) -> None:
    if not (finite(value) and value >= 0):
        raise ConfigError(f"{name}={value!r} must be a finite number >= 0")


def one_of(name: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{name}={value!r} is not known; valid: {', '.join(map(str, valid))}")


def check_fields(part) -> None:
    """The checks each field of `part` declares: its `check`, else its
    `choices`. A field whose default is None may be None."""
    for field in dataclasses.fields(part):
        opt, value = declaration(field), getattr(part, field.name)
        if value is None and field.default is None:
            continue
        if opt.check is not None:
            opt.check(field.name, value)
        elif opt.choices:
            one_of(field.name, value, opt.choices)


# -- the parts --------------------------------------------------------------------

def _replace(self, **changes):
    """A checked copy with some fields changed: `part.replace(field=value)`."""
    return dataclasses.replace(self, **changes)


def _unknown(cls, key: str, names: tuple) -> str:
    nearest = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    owner = next((other.__name__ for other in PARTS if other is not cls and key in
                  {f.name for f in dataclasses.fields(other)}), None)
    hint = (f"it is an option of {owner}" if owner else
            f"did you mean {nearest[0]}?" if nearest else f"valid: {', '.join(names)}")
    return f"{cls.__name__}({key}=...) is not an option of {cls.__name__}; {hint}"


PARTS: list = []   # the declared parts, in the order they were declared


def engine_options(*engines: str):
    """Declare `cls` the options engines `engines` read: a frozen dataclass of
    `option` fields, each marked as read by `engines` unless it names its
    own. Each engine declares its options beside its adapter
    (`tfdist/strategies/<engine>/options.py`); `StrategyConfig` inherits
    them, so the Python API and the flags stay flat. Keyword-only, so the
    shared fields keep their positions."""
    def declare(cls):
        for name, value in list(vars(cls).items()):
            if isinstance(value, dataclasses.Field) and "option" in value.metadata:
                opt = declaration(value)
                value.metadata = types.MappingProxyType(
                    {"option": dataclasses.replace(opt, engines=opt.engines or engines)})
        return dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    return declare


def part(cls):
    """Declare `cls` a frozen, checked part of the run configuration: every
    field must be an `option`, and an unknown keyword raises `ConfigError`
    naming the nearest option (or the part that has it)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    for field in fields:
        if "option" not in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name} is not declared with option()")
    names = tuple(field.name for field in fields)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for key in kwargs:
            if key not in names:
                raise ConfigError(_unknown(cls, key, names))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    cls.replace = _replace
    PARTS.append(cls)
    return cls
