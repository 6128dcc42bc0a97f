"""`make conformance`: real users' models x every tfdist engine.

    .venv/bin/python conformance/matrix.py --out docs/conformance.md
        [--models=llama,efficientnetb0] [--engines=default,dtensor_tp] [--no-bf16]
        [--workdir=DIR] [--reuse]

Runs conformance/cells.py once per single-process engine (all models in
one process: the CPU is split into 4 virtual devices before TensorFlow
starts, so one process serves every model; a process that dies or overruns
its bound loses only the model it was on, and a new process takes the rest),
and once per model for the multi-process engines (`tfdist-launch --workers=2`,
`horovodrun -np 2 --gloo`, `tfdist-launch --workers=2 --ps=1`). The `default`
column runs first: it writes the initial weights every engine starts from and
the trained weights every engine is compared with. Every process runs alone
(2-core machines). Each cell is one JSON file in the work directory; the
table in --out is generated from them (`--reuse` keeps the cells already
there and runs only the missing ones).
"""

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
sys.path.insert(0, HERE)

from models import MODELS  # noqa: E402  (no TensorFlow at import)

ENGINES = ["default", "mirrored", "multi_worker", "horovod", "dtensor_dp", "dtensor_tp",
           "zero3", "parameter_server", "pipeline"]
MULTI_PROCESS = {
    "multi_worker": [os.path.join(BIN, "tfdist-launch"), "--workers=2", "--grace_s=10", "--"],
    "horovod": [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"],
    "parameter_server": [os.path.join(BIN, "tfdist-launch"), "--workers=2", "--ps=1",
                         "--grace_s=10", "--"],
}
ENGINE_TITLES = {
    "default": "default (1 device)",
    "mirrored": "mirrored (2 vCPU)",
    "multi_worker": "multi_worker (2 proc)",
    "horovod": "horovod (2 ranks, gloo)",
    "dtensor_dp": "dtensor DP (batch:4)",
    "dtensor_tp": "dtensor TP (batch:2,model:2)",
    "zero3": "ZeRO-3 (batch:4)",
    "parameter_server": "parameter_server (2 workers, 1 ps)",
    "pipeline": "pipeline (2 stages)",
    "default-mixed_bfloat16": "default, mixed_bfloat16",
    "dtensor_tp-mixed_bfloat16": "dtensor TP, mixed_bfloat16",
}
BF16 = [("default", "llama"), ("dtensor_tp", "llama")]   # (engine, model) under mixed_bfloat16
PROCESS_TIMEOUT_S = 900      # one process's bound per model it has left (EfficientNetB0
                             # under dtensor: ~6 minutes on 2 busy cores)
LAUNCH_TIMEOUT_S = 300       # one cluster (one model)


def _env():
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


def _reason_from(stderr):
    """The most telling line of a dead process's stderr."""
    lines = [l.strip() for l in stderr.splitlines()
             if l.strip() and "oneDNN" not in l and "I0000" not in l]
    for pattern in (r"fault:", r"^(\[\w+ \d+\] )?\w+(Error|Exception|Fault)\b:", r"Error",
                    r"error"):
        hits = [l for l in lines if re.search(pattern, l)]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else "no output"


def _column(engine, precision):
    return engine if precision == "float32" else f"{engine}-{precision}"


def _missing(workdir, column, names):
    return [n for n in names if not os.path.exists(os.path.join(workdir, column, f"{n}.json"))]


def _write_cell(workdir, column, name, status, reason, seconds=None):
    os.makedirs(os.path.join(workdir, column), exist_ok=True)
    with open(os.path.join(workdir, column, f"{name}.json"), "w") as f:
        json.dump({"model": name, "engine": column, "status": status, "reason": reason,
                   "seconds": seconds, "checks": {}}, f, indent=1)


def run_column(workdir, engine, names, precision, log, timings):
    """Every model of `names` under `engine`; cells land in workdir."""
    column = _column(engine, precision)
    extra = [] if precision == "float32" else [f"--precision={precision}"]
    cells = [os.path.join(HERE, "cells.py"), workdir, engine]
    todo = _missing(workdir, column, names)
    while todo:
        if engine in MULTI_PROCESS:
            batch = todo[:1]
            command = [*MULTI_PROCESS[engine], sys.executable, *cells, batch[0], *extra]
            timeout = LAUNCH_TIMEOUT_S
        else:
            batch = todo
            command = [sys.executable, *cells, ",".join(batch), *extra]
            timeout = PROCESS_TIMEOUT_S * len(batch)
        print(f"[conformance] {column}: {','.join(batch)}", flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            died = None if proc.returncode == 0 else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            died = f"timed out after {timeout}s"
        elapsed = time.monotonic() - start
        timings.append({"column": column, "models": batch, "seconds": round(elapsed, 1),
                        "died": died})
        with open(os.path.join(workdir, "timings.jsonl"), "a") as f:
            f.write(json.dumps(timings[-1]) + "\n")
        log.write(f"==== {column} {batch} ({elapsed:.0f}s, {died or 'ok'})\n{out}\n{err}\n")
        log.flush()
        done = [n for n in batch if n not in _missing(workdir, column, batch)]
        left = [n for n in batch if n not in done]
        for line in out.splitlines():
            if line.startswith("conformance: end"):
                print(f"[conformance]   {line[len('conformance: end '):]}", flush=True)
        if left:
            began = [l.split()[-1] for l in out.splitlines()
                     if re.search(r"conformance: begin", l)]
            current = began[-1] if began and began[-1] in left else left[0]
            if died and died.startswith("timed out"):
                reason = (f"process {died} during this model (bound: {timeout // len(batch)} s "
                          f"per model left when the process started)")
            else:
                reason = f"process {died or 'ended'} during this model: " + _reason_from(err)
            _write_cell(workdir, column, current, "fail", reason[:300])
            print(f"[conformance]   {column} {current} fail {reason[:200]}", flush=True)
        todo = _missing(workdir, column, names)


def _describe_hardware():
    code = "from tfdist.observe import hardware; print(hardware.describe())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


def _version(name):
    for dist in (name, name.replace("-", "_")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _fmt_cell(cell):
    if cell is None:
        return "not run"
    status = cell["status"]
    parts = [f"**{status}**" if status == "pass" else status]
    if status != "pass" and cell.get("reason"):
        parts = [f"{status} ({_short(cell['reason'])})"]
    diff = cell.get("rel_diff_vs_default")
    if diff is not None:
        mark = "" if cell.get("match_expected", True) else " (n/c)"
        parts.append(f"Δ {diff:.1e}{mark}")
    if cell.get("loss_before") is not None:
        parts.append(f"loss {cell['loss_before']:.3f}→{cell['loss_after']:.3f}")
    if cell.get("examples_per_sec"):
        parts.append(f"{cell['examples_per_sec']:.1f} ex/s")
    return "<br>".join(parts)


def _short(reason):
    reason = re.sub(r"\S+\.py:\d+:\d+: error: ", "", reason).replace("|", "/")
    reason = reason.replace("{{", "").replace("}}", "")
    return reason if len(reason) < 90 else reason[:87] + "..."


def write_table(workdir, out, names, engines, wall_s, timings):
    cells = {}
    for path in glob.glob(os.path.join(workdir, "*", "*.json")):
        with open(path) as f:
            cell = json.load(f)
        if cell.get("reason"):   # a timeout's reason is the bound, not stderr's last line
            cell["reason"] = re.sub(r"(timed out after \d+s during this model):.*",
                                    r"\1", cell["reason"])
        cells[(cell["engine"], cell["model"])] = cell
    columns = list(engines) + [_column(e, "mixed_bfloat16") for e, m in BF16
                               if e in engines and m in names
                               and (_column(e, "mixed_bfloat16"), m) in cells]
    columns = list(dict.fromkeys(columns))
    hardware = _describe_hardware()
    every = []   # every engine process that made these cells, over all invocations
    if os.path.exists(os.path.join(workdir, "timings.jsonl")):
        with open(os.path.join(workdir, "timings.jsonl")) as f:
            every = [json.loads(line) for line in f if line.strip()]
    lines = [
        "# Conformance matrix: real users' models x every engine",
        "",
        f"Generated by `conformance/matrix.py` (`make conformance`) on "
        f"{datetime.date.today().isoformat()}; do not edit by hand.",
        "",
        f"- CPU: {hardware}",
        f"- TensorFlow {_version('tensorflow-cpu') if _version('tensorflow-cpu') != 'not installed' else _version('tensorflow')}, "
        f"Keras {_version('keras')}, keras-hub {_version('keras-hub')}, "
        f"Horovod {_version('horovod')}",
        f"- Total wall time: {sum(t['seconds'] for t in every) / 60:.1f} minutes of engine "
        f"processes ({len(every)} processes, run one at a time, over every invocation that "
        f"made these cells; this invocation {wall_s / 60:.1f} minutes)",
        f"- Each cell: {4} Adam steps (lr 1e-3; BatchNorm models: SGD, lr 0.01, as a "
        "BatchNorm beta before a 1x1 convolution and another BatchNorm has an exact gradient "
        "of 0, which Adam turns into noise-sized steps; EfficientNetB0: 1 SGD step at 1e-6, "
        "as at 32x32 it is chaotic: on the default engine alone, initial weights perturbed "
        "by 1e-7 end 1.2e-2 of their scale apart after 4 steps; DenseNet121: 1 step, 1.4e-1 "
        "so), global batch 8, float32 "
        "unless the "
        "column says otherwise, `jit_compile=\"off\"`, fixed random data in file order "
        "(shuffle_buffer=1), every engine from the same initial weights.",
        "",
        "Cell contents: status; **Δ**: the largest |w - w_default| over all final weights "
        "divided by the largest |w_default| (the model's weight scale); (n/c): not compared, "
        "the engine computes another function of the batch (see below); loss: mean "
        "cross-entropy on the training examples read (32; EfficientNetB0 and DenseNet121 8) in training mode before → after "
        "training, computed on the host from the trained model; ex/s: the run "
        "summary's `examples_per_sec` (4 steps: dominated by tracing, not a throughput "
        "figure).",
        "",
        "| model | " + " | ".join(ENGINE_TITLES.get(c, c) for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in names:
        bf16 = {_column(e, "mixed_bfloat16"): m for e, m in BF16}
        row = ["—" if bf16.get(c, name) != name else _fmt_cell(cells.get((c, name)))
               for c in columns]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    counts = {}
    for (c, m), cell in cells.items():
        if c in columns and m in names:
            counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    lines += ["", "Totals: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), ""]
    lines += ["## What a passing cell asserts", "",
              "1. `tfdist.train` returns under the engine.",
              "2. The loss on the training examples read falls and the weights moved (a "
              "finite, lower loss after training; the loss is computed on the host from "
              "`result.model`, so every engine is measured the same way; BatchNorm models "
              "under engines whose 2 replicas or micro-batches normalise by their own "
              "statistics are measured on half-batches, the function those engines train).",
              "3. The final weights match the `default` engine's within 1e-4 of the weight "
              "scale where the engine computes the same function of the same batches. "
              "float32 has a 24-bit mantissa: another reduction order moves each sum by a few "
              "ulps (~1e-7 relative), and 4 Adam steps of lr 1e-3 can amplify that on weights "
              "whose gradient is near zero (Adam normalises the step by the gradient's size), "
              "so 1e-4 bounds rounding while a dropped or doubled micro-batch, a wrong "
              "all-reduce or a wrongly sharded update moves weights by ~1e-3 of a 1e-3 step "
              "on weights of order 0.01-1 (bf16 columns: 2e-2, bf16 has an 8-bit mantissa). "
              "BatchNorm models first measure their sensitivity in the default column: the "
              "default engine trained again from initial weights perturbed by 1e-7 (relative, "
              "float32 rounding's size); where that spread is above 1e-4, the tolerance is 10x "
              "it (a wrong reduction or a dropped micro-batch changes the gradient itself and "
              "moves the weights by the step's size). "
              "Not compared (n/c): `parameter_server` (asynchronous: each step is one "
              "worker's global batch from its own input pipeline) and BatchNorm models under "
              "engines whose replicas or micro-batches normalise by their own batch "
              "statistics (mirrored, multi_worker, horovod, pipeline); the figure is still "
              "shown.",
              "4. `tfdist.export(result, dir)` writes model.keras and a SavedModel, and "
              "`tfdist.load_model(dir/model.keras)` predicts like `result.model(x)` "
              "(relative 1e-5); and `result.model.predict(x)` (docs/guides/python-api.md: on host data "
              "under every engine) gives `result.model(x)` (check `predict`). In clusters "
              "every process makes every check (`predict` is a collective under "
              "multi_worker); the chief's cell is recorded.",
              "5. dtensor TP and ZeRO-3: `summary['device_parameter_bytes']` is below the "
              "whole model's bytes.",
              "6. keras-hub CausalLMs: the trained model's `generate(..., "
              "stop_token_ids=None)` (preprocessor=None) returns the prompt followed by "
              "generated ids in the vocabulary.",
              "7. LoRA rows (`backbone.enable_lora(2)`): the adapters are trainable (and "
              "what keras-hub leaves trainable beside them: the adapted layers' biases, a "
              "classifier's head), every frozen weight ends bit for bit as loaded, an adapter "
              "moved, the optimizer holds two Adam slots per trainable weight and none for "
              "frozen ones, and under mirrored, multi_worker and horovod "
              "`summary['bytes_reduced_per_update']` equals the trainable weights' bytes "
              "(check `lora_only`).",
              ""]
    lines += ["## Refusals and failures", ""]
    for (c, m), cell in sorted(cells.items(), key=lambda kv: (columns.index(kv[0][0])
                                                              if kv[0][0] in columns else 99,
                                                              kv[0][1])):
        if c in columns and m in names and cell["status"] != "pass":
            lines.append(f"- {m} × {c}: **{cell['status']}**: {cell.get('reason', '')}")
    lines += ["", "## Notes per cell", ""]
    for (c, m), cell in sorted(cells.items()):
        if c in columns and m in names:
            extras = []
            if cell.get("checks"):
                extras.append("checks: " + ", ".join(
                    k + ("" if v.get("ok") else " FAILED") for k, v in cell["checks"].items()))
            if cell.get("layout"):
                extras.append(f"layout: {cell['layout']}")
            if cell.get("sensitivity") is not None:
                extras.append(f"sensitivity to a 1e-7 perturbation {cell['sensitivity']:.1e}")
            if cell.get("device_parameter_bytes") is not None:
                extras.append(f"device parameter bytes {cell['device_parameter_bytes']} of "
                              f"{cell['model_bytes']}")
            if cell.get("rel_diff_where"):
                extras.append(f"largest difference at {cell['rel_diff_where']}")
            if cell.get("seconds") is not None:
                extras.append(f"{cell['seconds']} s in `tfdist.train`")
            if extras:
                lines.append(f"- {m} × {c}: " + "; ".join(extras))
    lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "conformance.md"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--workdir", default=None,
                        help="where the cells go (default: a fresh temporary directory)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the cells already in --workdir; run the missing ones")
    parser.add_argument("--no-bf16", dest="bf16", action="store_false")
    parser.add_argument("--table-only", action="store_true",
                        help="only regenerate --out from the cells in --workdir")
    args = parser.parse_args()
    names = args.models.split(",")
    engines = args.engines.split(",")
    for n in names:
        if n not in MODELS:
            parser.error(f"--models: {n!r} is not one of {', '.join(MODELS)}")
    for e in engines:
        if e not in ENGINES:
            parser.error(f"--engines: {e!r} is not one of {', '.join(ENGINES)}")
    workdir = args.workdir or tempfile.mkdtemp(prefix="tfdist-conformance-")
    os.makedirs(workdir, exist_ok=True)
    if not args.reuse and not args.table_only:
        for path in glob.glob(os.path.join(workdir, "*", "*.json")):
            os.remove(path)
    start = time.monotonic()
    timings = []
    if not args.table_only:
        # default first: the initial weights and the reference weights.
        order = ["default"] + [e for e in engines if e != "default"]
        with open(os.path.join(workdir, "processes.log"), "a") as log:
            for engine in order:
                run_column(workdir, engine, names, "float32", log, timings)
            if args.bf16:
                for engine, model in BF16:
                    if engine in engines and model in names:
                        run_column(workdir, "default", [model], "mixed_bfloat16", log, timings)
                        run_column(workdir, engine, [model], "mixed_bfloat16", log, timings)
    wall = time.monotonic() - start
    write_table(workdir, args.out, names, engines, wall, timings)
    print(f"[conformance] {args.out} written ({wall / 60:.1f} min; cells in {workdir})")


if __name__ == "__main__":
    main()
