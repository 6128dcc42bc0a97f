"""`--help` of tfdist's absl programs: tfdist's flags grouped by concern.

absl's `--help` lists the key flags of `__main__`, which for a console script
is pip's wrapper and defines none, so `tfdist-train --help` said only "Try
--helpfull", and `--helpfull` mixes tfdist's flags with absl's and
TensorFlow's. Here `--help`, `-h`, `-?` and `--helpshort` print tfdist's flags
in the groups declared beside them (`tfdist.flags.HELP_GROUPS`), each with its
default and valid values (enum choices, registry names, a validator's
bounds), then the flags of the user's own script; `--helpfull` stays absl's
full list. All help goes to stdout with exit status 0.

This module only renders and installs help: it reads flag definitions, never
a flag's parsed value, and imports no TensorFlow (`--help` must be instant).
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from typing import Callable, Iterable

from absl import app as absl_app
from absl import flags

from tfdist import flags as tfdist_flags

SCRIPT_GROUP = "this script"
OTHER_GROUP = "other"
_HELP_NAMES = ("help", "helpshort", "helpfull")
_FOOTER = (
    ("--flagfile=FILE", "read flags from FILE, one per line; flags after it override it "
                        "(canned runs: configs/*.cfg)"),
    ("--helpfull", "every flag, absl's and TensorFlow's included"),
)
_MAX_WIDTH = 100


def _registry_choices() -> dict[str, list[str]]:
    """Flags whose valid names are a registry's (checked after parsing, so
    they are string flags, not enums); the registries import no TensorFlow."""
    from tfdist import config as config_lib
    from tfdist import models, strategies
    names = {"strategy": strategies.names, "model": models.names}
    return {config_lib.flag_name(field): names[config_lib.declaration(field).registry]()
            for _, field in config_lib.options() if config_lib.declaration(field).registry}


def _bound(value) -> str:
    """A bound as written in help: 2^63-1 rather than its 19 digits."""
    if isinstance(value, int) and value >= 2**31 - 1 and (value + 1) & value == 0:
        return f"2^{value.bit_length()}-1"
    return str(value)


def _valid(flag: flags.Flag) -> str:
    """What the flag accepts beyond its type's name: a validator's bounds, a list."""
    parser = flag.parser
    if isinstance(parser, (flags.IntegerParser, flags.FloatParser)):
        kind = "an integer" if isinstance(parser, flags.IntegerParser) else "a number"
        low, high = parser.lower_bound, parser.upper_bound
        if low is not None and high is not None:
            return f"{kind} in [{_bound(low)}, {_bound(high)}]"
        if low is not None:
            return f"{kind} >= {_bound(low)}"
        if high is not None:
            return f"{kind} <= {_bound(high)}"
        return kind
    if isinstance(parser, flags.ListParser):
        return "a comma-separated list"
    return ""


def _default(flag: flags.Flag) -> str:
    value = flag.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "empty"
    return str(value) if value != "" else '""'


def _synopsis(flag: flags.Flag, choices: Iterable[str] | None) -> str:
    """`--[no]name`, `--name={a,b}` or `--name=N`: the flag as a user types it."""
    if flag.boolean:
        return f"--[no]{flag.name}"
    if choices is None and isinstance(flag.parser, flags.EnumParser):
        choices = flag.parser.enum_values
    if choices is not None:
        return f"--{flag.name}={{{','.join(choices)}}}"
    if isinstance(flag.parser, flags.IntegerParser):
        return f"--{flag.name}=N"
    if isinstance(flag.parser, flags.FloatParser):
        return f"--{flag.name}=X"
    if isinstance(flag.parser, flags.ListParser):
        return f"--{flag.name}=A,B,..."
    return f"--{flag.name}=TEXT"


def _entry(flag: flags.Flag, choices, width: int) -> list[str]:
    """One flag: its synopsis and facts (default, valid values), then its help text."""
    synopsis = _synopsis(flag, choices)
    if flag.short_name:
        synopsis += f" (-{flag.short_name})"
    facts = "; ".join(part for part in (f"default: {_default(flag)}", _valid(flag)) if part)
    head = f"  {synopsis}  [{facts}]"
    if len(head) <= width:
        lines = [head]
    else:   # the facts whole on the next line(s) rather than broken after "default:"
        lines = textwrap.wrap(f"  {synopsis}", width, subsequent_indent=" " * 6,
                              break_on_hyphens=False)
        lines += textwrap.wrap(f"[{facts}]", width, initial_indent=" " * 6,
                               subsequent_indent=" " * 6, break_on_hyphens=False)
    text = " ".join((flag.help or "").split())
    if isinstance(flag.parser, flags.EnumParser):   # absl prefixes "<a|b|c>: "; shown above
        text = text.removeprefix(f"<{'|'.join(flag.parser.enum_values)}>: ")
    lines += textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                           break_on_hyphens=False)
    return lines


def _width() -> int:
    return max(60, min(_MAX_WIDTH, shutil.get_terminal_size((_MAX_WIDTH, 24)).columns - 1))


def ungrouped() -> list[str]:
    """Flags tfdist.flags defines that no group lists (tests/unit/test_help.py
    requires none; --help still shows them, under "other")."""
    grouped = {name for names in tfdist_flags.HELP_GROUPS.values() for name in names}
    return [flag.name for flag in flags.FLAGS.get_flags_for_module(tfdist_flags.__name__)
            if flag.name not in grouped]


def sections(only: Iterable[str] | None = None) -> list[tuple[str, list[flags.Flag]]]:
    """(title, flags) of tfdist's groups, in order; `only` keeps those names."""
    keep = None if only is None else set(only)
    table = [*tfdist_flags.HELP_GROUPS.items(), (OTHER_GROUP, ungrouped())]
    found = [(title, [flags.FLAGS[name] for name in names if keep is None or name in keep])
             for title, names in table]
    return [(title, group) for title, group in found if group]


def script_flags() -> list[flags.Flag]:
    """The flags of the user's script: `__main__`'s key flags (those it defines,
    and any it adopted with `flags.adopt_module_key_flags`) that are not tfdist's."""
    tfdist_names = {flag.name for flag in flags.FLAGS.get_flags_for_module(tfdist_flags.__name__)}
    return [flag for flag in flags.FLAGS.get_key_flags_for_module("__main__")
            if flag.name not in tfdist_names and flag.name not in _HELP_NAMES]


def render(*, usage: str, description: str = "",
           groups: list[tuple[str, list[flags.Flag]]], width: int | None = None) -> str:
    """The help text: usage, description, each group's flags, then absl's two
    flags a tfdist user needs (--flagfile, --helpfull)."""
    width = width or _width()
    choices = _registry_choices()
    out = [usage, ""]
    for paragraph in description.strip().split("\n\n") if description.strip() else ():
        if paragraph.startswith(" "):   # an indented example: keep it as written
            out += [paragraph.rstrip(), ""]
        else:
            out += textwrap.wrap(" ".join(paragraph.split()), width) + [""]
    for title, group in groups:
        out.append(f"{title}:")
        for flag in group:
            out += _entry(flag, choices.get(flag.name), width)
        out.append("")
    out.append("absl:")
    for synopsis, text in _FOOTER:
        out += textwrap.wrap(f"  {synopsis}  {text}", width, subsequent_indent=" " * 6)
    return "\n".join(out) + "\n"


def program_help(prog: str, *, usage: str | None = None, description: str = "",
                 only: Iterable[str] | None = None, script: bool = False) -> str:
    """Help of a tfdist program: tfdist's groups (or those of its flags in
    `only`; the planner's too, which tfdist-plan and --strategy=auto read),
    plus, for a user's script, its own flags under "this script"."""
    groups = list(sections(only))
    if script:
        own = script_flags()
        if own:
            groups.append((SCRIPT_GROUP, own))
    return render(usage=usage or f"usage: {prog} [--flag=value ...]",
                  description=description, groups=groups)


class _GroupedHelpFlag(flags.BooleanFlag):
    """--help (and its aliases): print the grouped help to stdout and exit 0."""

    def __init__(self, name: str, short_name: str | None, text: Callable[[], str]):
        super().__init__(name, False, "show tfdist's flags by group, with defaults and "
                         "valid values, and exit", short_name=short_name)
        self._text = text

    def parse(self, argument) -> None:
        super().parse(argument)
        if self.value:
            _write_and_exit(self._text())


class _FullHelpFlag(flags.BooleanFlag):
    """--helpfull: absl's own list of every flag, but exit 0 (absl exits 1)."""

    def __init__(self):
        super().__init__("helpfull", False, "show every flag (absl's and TensorFlow's "
                         "included) and exit")

    def parse(self, argument) -> None:
        super().parse(argument)
        if self.value:
            try:
                absl_app.usage(writeto_stdout=True)
            finally:
                sys.stdout.flush()
            sys.exit(0)


def _write_and_exit(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:   # `tfdist-train --help | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(0)


def install(text: Callable[[], str]) -> None:
    """Make --help, -h, -?, --helpshort print `text()` and --helpfull exit 0.

    Called before `absl.app.run`: absl's help flags are defined first (its
    `define_help_flags` is idempotent, so `app.run` then leaves ours alone),
    removed through absl's public `del FLAGS.name`, and replaced. Calling it
    again replaces the text.
    """
    absl_app.define_help_flags()
    for name in ("help", "?", "h", "helpshort", "helpfull"):
        if name in flags.FLAGS and (name != "h"
                                    or isinstance(flags.FLAGS[name], _GroupedHelpFlag)):
            delattr(flags.FLAGS, name)
    short = None if "h" in flags.FLAGS else "h"   # a script's own -h keeps it
    flags.DEFINE_flag(_GroupedHelpFlag("help", short, text), module_name=__name__)
    flags.DEFINE_flag(_GroupedHelpFlag("helpshort", "?", text), module_name=__name__)
    flags.DEFINE_flag(_FullHelpFlag(), module_name=__name__)


# -- the flag reference (docs/reference/flags.md) -----------------------------------

REFERENCE_HEADER = """# Reference: engines and flags

Generated from the options' declarations (`tfdist/config/`) by `make reference`;
`tests/unit/test_help.py` fails when this file and the declarations differ. Every
flag here is also a field of the Python API's configuration: the part and
field are given where the names differ (`--model_width` is
`ModelConfig.width`). "Read by" lists the engines that use an option (the
others ignore or refuse it); "math" marks options whose change changes what is
computed, not only how fast or where.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _fields_by_flag() -> dict:
    """{flag name: (part class name, field, declaration)} of every option."""
    from tfdist import config as config_lib
    return {config_lib.flag_name(field): (config_lib.PART_NAMES[part].__name__, field,
                                          config_lib.declaration(field))
            for part, field in config_lib.options()}


def markdown_engines() -> list[str]:
    """The engines' table, from their own records."""
    from tfdist import strategies
    from tfdist.strategies import records
    out = ["## Engines (`--strategy`)", "",
           "| `--strategy` | What it is | Updates | Started by |", "|---|---|---|---|"]
    for engine in strategies.engines():
        updates = "synchronous" if engine.synchronous else "asynchronous"
        out.append(f"| `{engine.name}` | {_cell(engine.summary)} | {updates} | "
                   f"`{_cell(records.command(engine))}` |")
    return out + [""]


README_ENGINES = ("<!-- engines: generated from the engines' records by `make reference` -->",
                  "<!-- end engines -->")


def with_engine_table(readme: str) -> str:
    """`readme` with the engines' table (`markdown_engines`) between its markers."""
    start, end = README_ENGINES
    head, rest = readme.split(start + "\n", 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n" + "\n".join(markdown_engines()[2:]) + f"{end}{tail}"


def markdown_reference() -> str:
    """The engines and every tfdist-train flag, by help group, as Markdown."""
    choices = _registry_choices()
    declared = _fields_by_flag()
    out = [REFERENCE_HEADER, *markdown_engines()]
    for title, group in sections():
        out += [f"## {title[0].upper()}{title[1:]}", "",
                "| Flag | Default | Valid | Read by | Math | Description |",
                "|---|---|---|---|---|---|"]
        for flag in group:
            found = declared.get(flag.name)
            valid = (", ".join(choices[flag.name]) if flag.name in choices else
                     ", ".join(flag.parser.enum_values)
                     if isinstance(flag.parser, flags.EnumParser) else _valid(flag))
            engines = "every engine"
            math = ""
            text = " ".join((flag.help or "").split())
            if isinstance(flag.parser, flags.EnumParser):
                text = text.removeprefix(f"<{'|'.join(flag.parser.enum_values)}>: ")
            if found:
                part, field, opt = found
                engines = ", ".join(opt.engines) or engines
                math = "yes" if opt.math else ""
                if field.name != flag.name:
                    text += f" (`{part}.{field.name}`)"
            else:
                engines = "command line only"
            out.append(f"| `--{flag.name}` | `{_cell(_default(flag))}` | {_cell(valid)} | "
                       f"{_cell(engines)} | {math} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)
