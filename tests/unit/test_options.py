"""Each option declared once (`tfdist/config/`): the flags, their defaults,
the Python API's checks, the flagfile a run writes and the flag reference all
come from the declarations. In one process, no TensorFlow."""

import dataclasses
import json
import os

import pytest
from absl import flags

from tfdist import config as config_lib
from tfdist import flags as tfdist_flags
from tfdist import help as help_lib
from tfdist.config.options import option
from tfdist.errors import ConfigError

from conftest import REPO

REFERENCE = os.path.join(REPO, "docs", "reference", "flags.md")
COMMAND_LINE_ONLY = {"print_layouts", "print_stages", "microbatches", *tfdist_flags.PLAN_FLAGS}


def _tfdist_flags():
    return {flag.name: flag for flag in flags.FLAGS.get_flags_for_module(tfdist_flags.__name__)}


def test_the_flags_and_their_defaults_are_those_users_have():
    """The committed list of tfdist-train's flags and defaults (taken before the
    flags were generated from the declarations); a deliberate change updates
    it and says so in CHANGELOG.md."""
    with open(os.path.join(REPO, "tests", "data", "cli_flags.json")) as f:
        committed = json.load(f)
    now = {name: list(flag.default) if isinstance(flag.default, (list, tuple)) else flag.default
           for name, flag in _tfdist_flags().items()}
    assert now == committed


def test_every_option_is_a_flag_and_every_flag_an_option_or_an_action():
    flag_names = set(_tfdist_flags())
    declared = {config_lib.flag_name(field) for _, field in config_lib.options()}
    assert declared <= flag_names
    assert flag_names - declared == COMMAND_LINE_ONLY
    for _, field in config_lib.options():   # each declaration is complete
        opt = config_lib.declaration(field)
        assert opt.help and opt.group in config_lib.GROUPS, field.name
        assert set(opt.tunable) <= set(opt.choices) or not opt.choices, field.name


def test_the_flag_reference_is_the_one_generated(monkeypatch):
    with open(REFERENCE) as f:
        assert f.read() == help_lib.markdown_reference(), (
            "docs/reference/flags.md is out of date: run `make reference`")
    # Control: a changed help text changes the generated reference.
    monkeypatch.setattr(flags.FLAGS["seed"], "help", "Another text.")
    assert "Another text." in help_lib.markdown_reference()


@pytest.mark.parametrize("part,key,message", [
    (config_lib.TrainConfig, "global_batchsize", "did you mean global_batch_size?"),
    (config_lib.TrainConfig, "mesh", "it is an option of StrategyConfig"),
    (config_lib.ModelConfig, "qqq", "valid: name, width, depth, num_heads, recompute"),
])
def test_an_unknown_option_names_the_nearest_or_its_part(part, key, message):
    with pytest.raises(ConfigError, match=f"is not an option of {part.__name__}; ") as caught:
        part(**{key: 1})
    assert message in str(caught.value)
    with pytest.raises(ConfigError, match="not an option"):   # replace() too
        config_lib.RunConfig().train.replace(**{key: 1})


def test_declared_checks_run_on_construction():
    with pytest.raises(ConfigError, match="precision='fp8' is not known; valid: float32, "):
        config_lib.TrainConfig(train_steps=1, precision="fp8")
    with pytest.raises(ConfigError, match="keep_checkpoints=0 must be a positive integer"):
        config_lib.TrainConfig(train_steps=1, keep_checkpoints=0)
    assert config_lib.TrainConfig(train_steps=1, epochs=None).epochs is None  # None allowed


def test_a_run_flagfile_replays_the_same_config(tmp_path):
    config = config_lib.RunConfig(
        strategy=config_lib.StrategyConfig(name="dtensor", mesh="batch:2,model:2",
                                           zero_stage=3, virtual_devices=4),
        model=config_lib.ModelConfig(name="transformer", width=48, recompute=True),
        optimizer=config_lib.OptimizerConfig(name="momentum", learning_rate=3e-5,
                                             clip_grad_norm=1.5),
        train=config_lib.TrainConfig(epochs=2, metrics=("accuracy", "crossentropy"),
                                     profile_steps=(3, 4), model_dir="/tmp/run",
                                     checkpoint_input=False, seed=9))
    path = tmp_path / "run.cfg"
    path.write_text(config_lib.flagfile(config))
    try:
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["tfdist-train", f"--flagfile={path}"])
        assert tfdist_flags.run_config() == config
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["tfdist-train", f"--flagfile={path}", "--seed=10"])
        assert tfdist_flags.run_config() == dataclasses.replace(
            config, train=config.train.replace(seed=10))   # control: a flag after it wins
    finally:
        flags.FLAGS.unparse_flags()


def test_the_readme_engine_table_is_the_one_generated():
    """README.md's engine table comes from the engines' records (`make reference`)."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert readme == help_lib.with_engine_table(readme), (
        "README.md's engine table is out of date: run `make reference`")
    # Control: a table that lacks an engine is rewritten.
    stale = readme.replace("| `pipeline` |", "| `pipe` |")
    assert help_lib.with_engine_table(stale) == readme


def _misplaced(cls) -> list:
    """Fields of `cls` read by one engine but declared outside that engine's
    options module, or read by several and declared inside one."""
    owners = {}
    for base in reversed(cls.__mro__):
        for name in vars(base).get("__annotations__", {}):
            owners[name] = base.__module__
    wrong = []
    for field in dataclasses.fields(cls):
        engines = config_lib.declaration(field).engines
        home = (f"tfdist.strategies.{engines[0]}.options" if len(engines) == 1 else None)
        if (owners[field.name] != home) if home else (".strategies." in owners[field.name]):
            wrong.append(field.name)
    return wrong


def test_an_option_only_one_engine_reads_is_declared_in_that_engine():
    """Engines own their options: a `StrategyConfig` field read by one engine
    comes from `tfdist/strategies/<engine>/options.py`, and such a module
    declares only its own engine's."""
    assert _misplaced(config_lib.StrategyConfig) == []
    single = {f.name for f in dataclasses.fields(config_lib.StrategyConfig)
              if len(config_lib.declaration(f).engines) == 1}
    assert {"mesh", "shard_optimizer_state", "pipeline_stages", "elastic", "ps_hosts"} <= single
    zero = next(f for f in dataclasses.fields(config_lib.StrategyConfig) if f.name == "zero_stage")
    assert config_lib.declaration(zero).engines == ("dtensor", "pipeline")   # shared: not in one
    # The control: a dtensor-only option declared here, outside dtensor's package.
    stray = dataclasses.make_dataclass("Stray", [(
        "stray_option", int, option(
            0, engines=("dtensor",), group="engine and cluster", help="x."))],
        bases=(config_lib.StrategyConfig,), frozen=True)
    assert _misplaced(stray) == ["stray_option"]
