"""The main job's flagfile (configs/demo.cfg) and the canned configs parse, and the
docs document every flag (the demo's accuracy runs: tests/integration/test_demo_runs.py)."""

import os

from absl import flags

from tfdist import flags as tfdist_flags

from conftest import REPO, demo_config


def test_flagfile_values_and_overrides():
    config = demo_config("--train_steps=7")
    assert config.strategy.name == "mirrored" and config.strategy.virtual_devices == 2
    assert config.model.name == "cnn" and config.data.dataset == "tfdist_shapes"
    assert config.train.train_steps == 7  # a later flag overrides the flagfile


def test_every_canned_config_parses():
    configs = sorted(f for f in os.listdir(os.path.join(REPO, "configs")) if f.endswith(".cfg"))
    assert "demo.cfg" in configs and len(configs) >= 4
    for name in configs:
        config = demo_config(f"--flagfile={os.path.join(REPO, 'configs', name)}")
        assert config.train.global_batch_size > 0, name


def test_the_docs_document_every_flag():
    """The flag reference (generated: tests/unit/test_options.py holds it to the
    declarations) lists every flag, and the README points to it."""
    with open(os.path.join(REPO, "docs", "reference", "flags.md")) as f:
        reference = f.read()
    defined = [flag.name for flag in flags.FLAGS.get_flags_for_module(tfdist_flags)]
    assert len(defined) > 20
    missing = [name for name in defined if f"`--{name}`" not in reference]
    assert not missing, f"docs/reference/flags.md lacks {missing}"
    with open(os.path.join(REPO, "README.md")) as f:
        assert "(docs/reference/flags.md)" in f.read()


