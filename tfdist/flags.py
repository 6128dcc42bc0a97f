"""The only module that defines or reads absl flags: flags -> `RunConfig`.

Every flag of a run option is generated from the option's one declaration in
`tfdist/config/` (its default, help, valid values and help group: one source
of truth for the CLI and the Python API), with one declared exception:
`--virtual_devices` is 2, so
`tfdist-train` on a CPU-only host runs 2 replicas, where the API's None leaves
the devices of a process that may already have started TensorFlow alone.
The main job's choices live in `configs/demo.cfg`; canned runs are flagfiles
in `configs/` (`--flagfile=configs/NAME.cfg`); flags after it override it.

A script of your own imports this module (`from tfdist import flags`), defines
its own flags beside these and calls `flags.run_config()` after absl parsed
the command line. A flag name defined twice (yours and tfdist's) ends the
program with one line naming it, exit status 2.
"""

from __future__ import annotations

import dataclasses
import re
import sys

from absl import flags

from tfdist import config as config_lib
from tfdist.config.options import SAME
from tfdist.errors import UsageError

CLI_VIRTUAL_DEVICES = config_lib.declaration(
    config_lib.StrategyConfig.__dataclass_fields__["virtual_devices"]).cli_default


def _clash_hook(previous):
    """sys.excepthook: a flag defined by both tfdist and the user's script is
    reported in one line (absl raises DuplicateFlagError at import time)."""

    def hook(kind, error, traceback):
        if issubclass(kind, flags.DuplicateFlagError):
            found = re.search(r"flag '([^']+)' is defined twice\. First from (.+?), "
                              r"[Ss]econd from (.+?)\.(?:\s|$)", str(error))
            what = (f"--{found[1]} is defined twice, by {found[2]} and by {found[3]}"
                    if found else str(error).splitlines()[0])
            print(f"error: {what}: tfdist defines the flags of docs/reference/flags.md; "
                  "rename yours", file=sys.stderr)
            sys.exit(2)
        previous(kind, error, traceback)
    return hook


sys.excepthook = _clash_hook(sys.excepthook)

# Every option of the run configuration is a flag, generated from its one
# declaration (`tfdist/config/`): name, default, help, valid values, bounds
# and help group. Registry names (--strategy, --model) are listed in help text
# but checked after parsing (by the registries themselves), so this module
# never imports TensorFlow.
_FLAG_OF = {}   # (part, field name) -> the flag's holder


def _help(opt) -> str:
    """The declared help; the engines' own summaries for --strategy."""
    if opt.registry != "strategy":
        return opt.help
    from tfdist import strategies   # no TensorFlow: the engines' records only
    return " ".join([opt.help, *(f"{e.name}: {e.summary}." for e in strategies.engines()),
                     f"{strategies.AUTO}: {strategies.AUTO_SUMMARY}."])


def _define(field: dataclasses.Field):
    opt = config_lib.declaration(field)
    name = config_lib.flag_name(field)
    default = field.default if opt.cli_default is SAME else opt.cli_default
    kind = str(field.type)
    if kind == "bool":
        return flags.DEFINE_boolean(name, default, opt.help)
    if opt.registry:
        return flags.DEFINE_string(name, default, _help(opt))
    if opt.choices:
        return flags.DEFINE_enum(name, str(default), [str(c) for c in opt.choices], opt.help)
    if kind == "tuple":
        return flags.DEFINE_list(name, list(default), opt.help)
    if "int" in kind:
        return flags.DEFINE_integer(name, default, opt.help, lower_bound=opt.lower,
                                    upper_bound=opt.upper)
    if "float" in kind:
        return flags.DEFINE_float(name, default, opt.help, lower_bound=opt.lower,
                                  upper_bound=opt.upper)
    return flags.DEFINE_string(name, default, opt.help)


for _part, _field in config_lib.options():
    _FLAG_OF[_part, _field.name] = _define(_field)

# Command-line actions and spellings that are not options of the run.
_PRINT_LAYOUTS = flags.DEFINE_boolean(
    "print_layouts", False,
    "dtensor: print every variable's path, global shape, sharding spec and per-device "
    "bytes (and the per-device totals) for --model and --mesh, then exit.")
_PRINT_STAGES = flags.DEFINE_boolean(
    "print_stages", False,
    "pipeline: print each stage's device, layers, parameters and forward FLOPs for --model "
    "and --pipeline_stages, then exit.")
# The pipeline's name for --accum_steps (GPipe's M). Its own flag, not an
# absl alias, so that an error names the flag the user gave.
_MICROBATCHES = flags.DEFINE_integer(
    "microbatches", None, "pipeline: the micro-batches that flow through the stages per "
    "update (GPipe's M); the same number as --accum_steps, which it sets.", lower_bound=1,
    upper_bound=config_lib.INT_MAX)
_CLI_ONLY = {"engine and cluster": (_PRINT_LAYOUTS.name, _PRINT_STAGES.name),
             "training": (_MICROBATCHES.name,)}

# tfdist-plan's own flags (beside every run flag, which describe the run to plan).
_MEMORY_BUDGET = flags.DEFINE_string(
    "memory_budget", None, "tfdist-plan and --strategy=auto: the memory each process may "
    "use, in bytes with an optional K, M or G suffix (powers of 1024, e.g. 6G); default: "
    "this process's cgroup limit, else the machine's memory (shared among --plan_workers).")
_PLAN_TRIALS = flags.DEFINE_integer(
    "plan_trials", 5, "tfdist-plan and --strategy=auto: the most candidates measured in "
    "trial processes.", lower_bound=1)
_SEARCH_SECONDS = flags.DEFINE_float(
    "search_seconds", 180.0, "tfdist-plan and --strategy=auto: the seconds the search may "
    "take, measurements included (no new trial starts after them).", lower_bound=10.0,
    upper_bound=86400.0)
_ALLOW_LOSSY = flags.DEFINE_boolean(
    "allow_lossy", False, "tfdist-plan and --strategy=auto: also consider choices that "
    "change what is computed (mixed precision; each option declared as changing the "
    "math); default: only choices that train the same model as one device.")
_EXPLAIN = flags.DEFINE_boolean(
    "explain", False, "tfdist-plan: print the chosen candidate's predicted memory and time "
    "term by term.")
_PLAN_FILE = flags.DEFINE_string(
    "plan_file", "plan.cfg", "tfdist-plan: where the winner is written as a flagfile "
    "(tfdist-train --flagfile=FILE runs it).")
_PLAN_WORKERS = flags.DEFINE_integer(
    "plan_workers", 1, "tfdist-plan: plan for this many worker processes (tfdist-launch "
    "--workers=N), on this host or over --plan_hosts; 1: one process and its devices.",
    lower_bound=1)
_PLAN_HOSTS = flags.DEFINE_integer(
    "plan_hosts", 1, "tfdist-plan: the hosts the --plan_workers processes are spread over "
    "(evenly; each like this one); more than 1 needs --link_bandwidth. Trials run on this "
    "host; the links between hosts are predicted.", lower_bound=1)
_LINK_BANDWIDTH = flags.DEFINE_string(
    "link_bandwidth", None, "tfdist-plan and --strategy=auto: the bandwidth of the link "
    "between hosts, each way, e.g. 10gbit, 100mbit (bits/s, as tc writes them) or 125MB "
    "(bytes/s); needed to plan for more than one host.")
_CAP_TRIALS = flags.DEFINE_boolean(
    "cap_trials", False, "tfdist-plan and --strategy=auto: run each trial under a memory "
    "cap of --memory_budget (tfdist-launch --worker_memory): a candidate that would not "
    "fit is OOM-killed, a row with its reason.")
PLAN_GROUP = "planner"   # tfdist-plan's
PLAN_FLAGS = (_MEMORY_BUDGET.name, _PLAN_TRIALS.name, _SEARCH_SECONDS.name, _ALLOW_LOSSY.name,
              _EXPLAIN.name, _PLAN_FILE.name, _PLAN_WORKERS.name, _PLAN_HOSTS.name,
              _LINK_BANDWIDTH.name, _CAP_TRIALS.name)

# `--help` lists tfdist's flags in these groups, in this order (tfdist/help.py):
# each option's declared group, then the command-line actions of that group.
HELP_GROUPS = {group: tuple(config_lib.flag_name(field) for _, field in config_lib.options()
                            if config_lib.declaration(field).group == group)
               + _CLI_ONLY.get(group, ()) for group in config_lib.GROUPS}
HELP_GROUPS[PLAN_GROUP] = PLAN_FLAGS


@flags.multi_flags_validator(
    ["train_steps", "epochs"], message="--train_steps and --epochs: set only one of them")
def _one_length(values) -> bool:
    return values["train_steps"] is None or values["epochs"] is None


def _value(field: dataclasses.Field, holder):
    """The field's value from its flag's parsed value, as declared: a list's
    items of their type, an integer enum's choice, the value standing for None."""
    value, opt = holder.value, config_lib.declaration(field)
    if str(field.type) == "tuple":
        try:
            return tuple(opt.item(item) for item in value)
        except ValueError:
            raise UsageError(f"--{holder.name}={','.join(value)}: each item must be "
                             f"{'an integer' if opt.item is int else opt.item.__name__}"
                             ) from None
    if opt.choices and isinstance(field.default, int):
        return int(value)
    if opt.cli_none is not None and value == opt.cli_none:
        return None
    return value


def _accum_steps(accum_steps: int, present: bool) -> int:
    """--accum_steps, or --microbatches, its pipeline name (not both, unequal)."""
    if _MICROBATCHES.value is None:
        return accum_steps
    if present and accum_steps != _MICROBATCHES.value:
        raise UsageError(f"--microbatches={_MICROBATCHES.value} and --accum_steps="
                         f"{accum_steps} name the same number; give one of them")
    return _MICROBATCHES.value


def run_config() -> config_lib.RunConfig:
    """The `RunConfig` the parsed flags describe. Raises `UsageError`."""
    values = {part: {} for part in config_lib.PART_NAMES}
    for (part, name), holder in _FLAG_OF.items():
        values[part][name] = _value(config_lib.PART_NAMES[part].__dataclass_fields__[name],
                                    holder)
    train = values["train"]
    if train["train_steps"] is None and train["epochs"] is None:
        train["train_steps"] = config_lib.DEFAULT_TRAIN_STEPS
    train["accum_steps"] = _accum_steps(train["accum_steps"],
                                        _FLAG_OF["train", "accum_steps"].present)
    try:
        return config_lib.RunConfig(**{part: cls(**values[part])
                                       for part, cls in config_lib.PART_NAMES.items()})
    except config_lib.ConfigError as error:  # a rule flags alone cannot express
        raise UsageError(str(error)) from None


def run_config_of(args: list) -> config_lib.RunConfig:
    """The `RunConfig` a list of tfdist-train flags describes (a planner
    trial's), parsed afresh; `UsageError` for a flag absl refuses."""
    flags.FLAGS.unparse_flags()
    try:
        flags.FLAGS([sys.argv[0], *args])
    except flags.Error as error:
        raise UsageError(f"trial flags: {error}") from None
    return run_config()


def plan_options() -> dict:
    """tfdist-plan's own flags as `tfdist.plan` keywords."""
    from tfdist.planner import parse_rate, parse_size
    return {"memory_budget": parse_size(_MEMORY_BUDGET.value, "--memory_budget"),
            "trials": _PLAN_TRIALS.value, "search_seconds": _SEARCH_SECONDS.value,
            "allow_lossy": _ALLOW_LOSSY.value, "processes": _PLAN_WORKERS.value,
            "hosts": _PLAN_HOSTS.value,
            "link_bandwidth": parse_rate(_LINK_BANDWIDTH.value, "--link_bandwidth"),
            "cap_trials": _CAP_TRIALS.value}


def plan_output() -> tuple:
    """(--plan_file, --explain)."""
    return _PLAN_FILE.value, _EXPLAIN.value


def print_stages() -> bool:
    """--print_stages: describe the pipeline's stages and exit instead of training."""
    return _PRINT_STAGES.value


def print_layouts() -> bool:
    """--print_layouts: describe the dtensor layouts and exit instead of training."""
    return _PRINT_LAYOUTS.value
