"""Fuzzed input end to end: a seeded sample of real `tfdist-train` runs, each
of which trains or exits 2 in one line writing nothing (the in-process fuzzing
of flags, flagfiles and TF_CONFIG: tests/unit/test_fuzz.py)."""

import random
import re

import pytest

from conftest import run_clis

PROG = "tfdist-train"

# -- 4. end to end ------------------------------------------------------------
# Extra flags for real runs: (flag, values). Chosen so that no draw can run
# long or allocate much (no sizes, step counts or batch sizes that grow the
# work), nor write outside --model_dir. Invalid values are over-represented.
E2E_FLAGS = [
    ("learning_rate", ["0.01", "0", "-1", "nan", "inf", "abc", "1e400"]),
    ("optimizer", ["sgd", "adamw", "momentum", "rmsprop", "", "SGD"]),
    ("seed", ["0", "7", "-1", str(2**32), str(2**64), "x"]),
    ("shuffle_buffer", ["1", "64", "0", str(2**63), "٣"]),
    ("lr_scaling", ["linear", "sqrt", "cubic"]),
    ("warmup_steps", ["0", "1", "-1", str(2**70)]),
    ("clip_grad_norm", ["1.0", "0", "inf", "nan"]),
    ("weight_decay", ["0.0", "nan", "-1"]),
    ("mesh", ["batch:1,model:2", "batch:2", "", "x:1,y:2"]),
    ("strategy", ["default", "mirrored", "bogus", "", "DEFAULT"]),
    ("model", ["mlp", "bogus", "transformer"]),
    ("dataset", ["tfdist_shapes", "no_such_dataset", "a\nb", "a b"]),
    ("metrics", ["accuracy", "accuracy,crossentropy", "bogus", "accuracy,,"]),
    ("label_smoothing", ["0.0", "0.1", "1.0", "nan"]),
    ("accum_steps", ["1", "2", "3", "0"]),
    ("jit_compile", ["off", "auto", "maybe"]),
    ("log_every", ["0", "1", "-1", str(2**70)]),
    ("checkpoint_every", ["0", "1", "-5"]),
    ("preemption_grace_s", ["5", "0", "inf"]),
    ("synthetic", None),   # boolean: --synthetic / --nosynthetic / --synthetic=maybe
]
# Seed 2: 3 valid runs, 4 errors found before TensorFlow starts, 1 after (no_such_dataset).
E2E_EXAMPLES, E2E_SEED = 8, 2


def _e2e_examples():
    """E2E_EXAMPLES argv tails from a seeded generator: every 4th example takes
    each flag's first value (valid), the others one of the rest (mostly invalid)."""
    rng = random.Random(E2E_SEED)
    examples = []
    for i in range(E2E_EXAMPLES):
        extra = []
        for name, values in rng.sample(E2E_FLAGS, rng.randint(1, 3)):
            if values is None:   # a boolean flag
                values = [f"--{name}", f"--no{name}", f"--{name}=maybe", f"--{name}=0"]
                extra.append(values[0] if i % 4 == 0 else rng.choice(values[1:]))
            else:
                extra.append(f"--{name}={values[0] if i % 4 == 0 else rng.choice(values[1:])}")
        examples.append(extra)
    return examples


def test_e2e_sample_is_fixed():
    """The integration sample is the same every run (seeded), a fixed size."""
    assert _e2e_examples() == _e2e_examples() and len(_e2e_examples()) == E2E_EXAMPLES


TF_LOG_PREFIXES = ("WARNING: All log messages", "I0000", "E0000", "W0000")
# Progress and library INFO/WARNING lines of absl logging (e.g. TFDS's "Failed to load
# dataset ..." before tfdist's own error for an unknown --dataset); E/F lines count.
LOG_LINE = re.compile(r"[IW]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ ]+:\d+\] ")


@pytest.mark.slow   # ~25 CPU-s; make test: tests/unit/test_fuzz.py in one process, test_cli.py
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_fuzzed_cli_runs_or_exits_2_in_one_line_writing_nothing(tmp_path, data_dir):
    examples = _e2e_examples()
    model_dirs = [tmp_path / f"run{i}" / "model" for i in range(len(examples))]
    base = ["--strategy=default", "--model=mlp", "--model_width=4", "--model_depth=1",
            "--train_steps=1", "--steps_per_loop=1", "--global_batch_size=8",
            # No XLA compile unless the sample asks (its --jit_compile comes later).
            "--jit_compile=off", f"--data_dir={data_dir}"]
    results = run_clis([[*base, f"--model_dir={d}", *extra]
                        for d, extra in zip(model_dirs, examples)], timeout=120)
    for extra, model_dir, result in zip(examples, model_dirs, results):
        what = f"extra flags {extra}: exit {result.returncode}\n{result.stderr[-3000:]}"
        assert "Traceback" not in result.stderr, what
        assert result.returncode in (0, 2), what
        if result.returncode == 0:
            assert any(line.startswith("{") for line in result.stdout.splitlines()), what
            continue
        lines = [line for line in result.stderr.split("\n")
                 if line and not line.startswith(TF_LOG_PREFIXES) and not LOG_LINE.match(line)]
        assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: "), what
        assert not model_dir.exists() or not any(model_dir.iterdir()), (
            what, sorted(p.name for p in model_dir.iterdir()))
