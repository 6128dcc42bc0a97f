"""`make resume-matrix`: a checkpoint written under any synchronous engine and
size resumes under any other, continuing as if it had never stopped.

    .venv/bin/python conformance/resume_matrix.py --out docs/resume_matrix.md
        [--writers=default,zero3] [--readers=mirrored2] [--workdir=DIR] [--reuse]

The user's own absl script (`conformance/resume_script.py`: a residual tower
of Dense, Add and LayerNormalization layers, regression with sample weights,
momentum SGD so the optimizer's slots must be resharded) runs as real
processes under each engine (`tfdist-launch`, `horovodrun`, virtual CPU
devices):

- the reference: one device, uninterrupted, to step 8;
- each writer: to step 2, with a checkpoint there;
- each (writer, reader): a copy of the writer's run directory resumed by
  the reader to step 8 (a 96-example epoch is 6 steps of 16: the resumed run
  crosses an epoch and reads the next epoch's shuffle);
- each engine fresh from the seed alone to step 8 (the same initial weights
  and the same global batches);
- an Adam row: one device's checkpoint, resumed by every reader.

Every run exports its model; the cell is the largest |w - w_ref| over all
weights relative to the reference's largest weight. Within 1e-5 passes: the
engines sum the same products in other orders, so they agree to float32
rounding grown over a few steps (measured 1e-7 to 1e-6); another batch or
initial weight moves the weights by 1e-2 or more. The parameter server
(asynchronous: its workers update with stale weights) resumes from every
writer and is reported, not held to equality.

Each run is one JSON file in the work directory; `--reuse` keeps those there.
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
SCRIPT = os.path.join(HERE, "resume_script.py")
STEPS, RESUME_AT = 8, 2
TOLERANCE = 1e-5
TIMEOUT_S = 600


def _launch(workers, ps=0):
    return [os.path.join(BIN, "tfdist-launch"), f"--workers={workers}", f"--ps={ps}",
            "--grace_s=10", "--"]


HOROVOD = [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"]
# name: (title, launcher prefix, engine flags)
ENGINES = {
    "default": ("default (1 device)", [], ["--strategy=default"]),
    "mirrored2": ("mirrored ×2 vCPU", [], ["--strategy=mirrored", "--virtual_devices=2"]),
    "multi_worker2": ("multi_worker ×2", _launch(2), ["--strategy=multi_worker"]),
    "multi_worker4": ("multi_worker ×4", _launch(4), ["--strategy=multi_worker"]),
    "horovod2": ("horovod ×2", HOROVOD, ["--strategy=horovod"]),
    "zero1": ("dtensor 2x2 ZeRO-1", [], ["--strategy=dtensor", "--virtual_devices=4",
                                         "--mesh=batch:2,model:2", "--zero_stage=1"]),
    "zero3": ("dtensor 2x2 ZeRO-3", [], ["--strategy=dtensor", "--virtual_devices=4",
                                         "--mesh=batch:2,model:2", "--zero_stage=3"]),
    "pipeline2": ("pipeline, 2 processes", _launch(2),
                  ["--strategy=pipeline", "--pipeline_stages=2", "--accum_steps=2"]),
    "parameter_server": ("parameter_server (2 workers, 1 ps; async)", _launch(2, ps=1),
                         ["--strategy=parameter_server"]),
}
SYNCHRONOUS = [name for name in ENGINES if name != "parameter_server"]
COMMON = ["--global_batch_size=16", "--steps_per_loop=2", "--checkpoint_every=2",
          "--jit_compile=off", "--seed=7", "--optimizer=momentum", "--learning_rate=0.05",
          "--shuffle_buffer=32", "--collective_timeout_s=60"]


def _run(workdir, key, engine, steps, optimizer, source=None, reuse=False):
    """Run `engine` to `steps` (resuming a copy of `source`'s directory when
    given); return its record {status, seconds, weights path, log tail}."""
    record_path = os.path.join(workdir, "records", f"{key}.json")
    if reuse and os.path.exists(record_path):
        with open(record_path) as f:
            return json.load(f)
    model_dir = os.path.join(workdir, "runs", key)
    shutil.rmtree(model_dir, ignore_errors=True)
    if source is not None:
        shutil.copytree(source, model_dir, ignore=shutil.ignore_patterns("export"))
    _, launcher, flags = ENGINES[engine]
    argv = [*launcher, sys.executable, SCRIPT, *COMMON, *flags, f"--train_steps={steps}",
            f"--model_dir={model_dir}", f"--export_dir={os.path.join(model_dir, 'export')}"]
    if optimizer != "momentum":
        argv.append(f"--optimizer={optimizer}")
    os.makedirs(os.path.dirname(record_path), exist_ok=True)
    log = os.path.join(workdir, "logs", f"{key}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as out:
        try:
            code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=TIMEOUT_S, env=_env())
            code = code.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    with open(log) as f:
        text = f.read()
    record = {"key": key, "engine": engine, "code": code,
              "seconds": round(time.monotonic() - start, 1),
              "weights": os.path.join(model_dir, "export", "model.keras"),
              "restored": f"restored {os.path.join(model_dir, 'checkpoints', 'ckpt-')}"
              f"{RESUME_AT}" in text and "input position:" in text,
              "tail": text.strip().splitlines()[-3:] if code != 0 else []}
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{key}: exit {code} in {record['seconds']} s", flush=True)
    return record


def _env():
    """This checkout's tfdist first (a clone run with another's virtualenv)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": REPO + (os.pathsep + path if path else "")}


def _weights(path):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    return [np.asarray(w) for w in keras.saving.load_model(path, compile=False).weights]


def _difference(record, reference):
    """Largest |w - w_ref| relative to the reference's largest weight, or None."""
    import numpy as np
    if record["code"] != 0 or not os.path.exists(record["weights"]):
        return None
    got, want = _weights(record["weights"]), _weights(reference["weights"])
    scale = max(float(np.abs(w).max()) for w in want)
    return max(float(np.abs(a - b).max()) for a, b in zip(got, want)) / scale


def _cell(record, reference, equal, resumed=True):
    diff = _difference(record, reference)
    if diff is None:
        reason = " ".join(record["tail"])[-160:].replace("|", "/")
        return f"**failed** ({record['code']}: {reason})", False
    if resumed and not record["restored"]:
        return f"**{diff:.1e}, did not resume from step {RESUME_AT} and its position**", False
    if not equal:
        return f"{diff:.2f} (async)", True
    return (f"{diff:.1e}", True) if diff <= TOLERANCE else (f"**{diff:.1e}**", False)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "docs", "resume_matrix.md"))
    p.add_argument("--workdir", default=None)
    p.add_argument("--writers", default=",".join(SYNCHRONOUS))
    p.add_argument("--readers", default=",".join(ENGINES))
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--no-adam", dest="adam", action="store_false")
    opts = p.parse_args()
    writers, readers = opts.writers.split(","), opts.readers.split(",")
    for name in writers + readers:
        if name not in ENGINES:
            sys.exit(f"unknown engine {name!r}; valid: {', '.join(ENGINES)}")
    workdir = opts.workdir or tempfile.mkdtemp(prefix="tfdist-resume-")
    print(f"work directory: {workdir}", flush=True)
    rows, failures = {}, 0
    for optimizer in ["momentum"] + (["adam"] if opts.adam else []):
        reference = _run(workdir, f"{optimizer}-reference", "default", STEPS, optimizer,
                         reuse=opts.reuse)
        if reference["code"] != 0:
            sys.exit(f"the reference run failed: {reference['tail']}")
        for writer in writers if optimizer == "momentum" else ["default"]:
            written = _run(workdir, f"{optimizer}-{writer}-written", writer, RESUME_AT,
                           optimizer, reuse=opts.reuse)
            row = {}
            if optimizer == "momentum" and writer in SYNCHRONOUS:
                fresh = _run(workdir, f"{optimizer}-{writer}-fresh", writer, STEPS, optimizer,
                             reuse=opts.reuse)
                row["fresh"] = _cell(fresh, reference, True, resumed=False)
            for reader in readers:
                if written["code"] != 0:
                    row[reader] = ("writer failed", False)
                    continue
                resumed = _run(workdir, f"{optimizer}-{writer}-to-{reader}", reader, STEPS,
                               optimizer, source=os.path.join(workdir, "runs", written["key"]),
                               reuse=opts.reuse)
                row[reader] = _cell(resumed, reference, reader in SYNCHRONOUS)
            failures += sum(not ok for _, ok in row.values())
            rows[(optimizer, writer)] = row
    _write(opts.out, rows, readers, _run_seconds(workdir), workdir)
    print(f"{failures} cell(s) outside tolerance or failed; table in {opts.out}")
    return 1 if failures else 0


def _run_seconds(workdir):
    """The runs' own time, summed over every record (reused ones included)."""
    total = 0.0
    for name in os.listdir(os.path.join(workdir, "records")):
        with open(os.path.join(workdir, "records", name)) as f:
            total += json.load(f)["seconds"]
    return total


def _describe_hardware():
    out = subprocess.run([sys.executable, "-c", "from tfdist.observe import hardware; "
                          "print(hardware.describe())"], capture_output=True, text=True,
                         cwd=REPO, env=_env())
    return out.stdout.strip() or "unknown CPU"


def _write(out, rows, readers, seconds, workdir):
    titles = [ENGINES[r][0] for r in readers]
    lines = [
        "# Resume matrix: a checkpoint of any engine and size, resumed under any other",
        "",
        "Generated by `make resume-matrix` (`conformance/resume_matrix.py`; its docstring "
        "describes the model, the runs and the tolerance). Each cell: the largest weight "
        "difference from one device's uninterrupted run, relative to the largest weight, "
        f"after a checkpoint at step {RESUME_AT} written by the row's engine was resumed to "
        f"step {STEPS} by the column's. Within {TOLERANCE:g} passes; **bold** is outside. "
        "`fresh`: the row's engine from the seed alone, no checkpoint. 1e-7 is about one "
        "float32 rounding (2^-23) of the largest weight: the engines split and sum the same "
        "products in other orders. The parameter server is asynchronous (its workers step "
        "with stale weights and read their own orders): it resumes from every checkpoint, "
        "and its distance from the synchronous run is reported, not held to a tolerance.",
        "",
        f"Measured {datetime.date.today()} on {_describe_hardware()}, "
        f"{seconds / 60:.0f} minutes of runs (one at a time) for the whole matrix.",
        "",
        "| written by ↓ resumed by → | fresh | " + " | ".join(titles) + " |",
        "|---|---|" + "---|" * len(titles),
    ]
    for (optimizer, writer), row in rows.items():
        name = ENGINES[writer][0] + (", Adam" if optimizer == "adam" else "")
        fresh = row.get("fresh", ("—", True))[0]
        lines.append(f"| {name} | {fresh} | " +
                     " | ".join(row.get(r, ("—", True))[0] for r in readers) + " |")
    lines += ["", f"Runs' logs: `{workdir}/logs` (not kept in the repository).", ""]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
