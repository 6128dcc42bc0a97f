"""Does it fit: a model that cannot train in one process's memory trains across several.

    .venv/bin/python bench/fits.py [--width=4096] [--depth=18] [--cap=3328M]
        [--meshes=batch:4,model:1;batch:2,model:2] [--pipelines=2x1;2x2] [--steps=2]
        [--timeout=1200] [--work_dir=DIR]

The mlp WIDTH x DEPTH with Adam (float32: 16 bytes of parameters, gradients
and optimizer state per parameter) is sized so that this state is at least
1.3x the per-process cap. Every run is a `tfdist-launch` cluster of
`tests/fits_worker.py` processes:

1. the reference: one process, no cap (`--mesh=batch:1,model:1`), trains 1
   step and snapshots that checkpoint, then trains to --steps;
2. one process under `--worker_memory=CAP`, from the snapshot: it must be
   killed, with the launcher's one-line out-of-memory message;
3. for each mesh, its processes, each under the same cap, `--zero_stage=3`,
   from the snapshot to --steps;
4. for each pipeline S x R (`--pipelines`, none by default), S x R processes,
   each under the same cap, `--strategy=pipeline --pipeline_stages=S`
   (`--zero_stage=1` where R > 1), from the snapshot to --steps. Each process
   builds and holds its stage only, restores its part of the snapshot and
   writes its part of the final checkpoint; the chief gathers the trained
   model at the end only where it fits its cap (it does not here). Then
   `tfdist-export` exports that checkpoint, uncapped: the consolidation a
   machine with the memory runs.

Suggested pipeline proof (the state 1.5x the cap; a stage process holds half
the model's state, or under ZeRO-1 half its weights and a quarter of its
slots): `--width=4096 --depth=36 --cap=6G --meshes= --pipelines="2x1;2x2"`.

Printed per run: exit, each process's peak resident memory (the summary's
`peak_rss_bytes`, getrusage), the loss, and for each four-process run the
largest difference of its final weights from the reference's with the count
outside 1e-5 (the tolerance rules of tests/integration/test_dtensor.py). Snapshots and
checkpoints stay in --work_dir (a fresh temporary directory by default; each
run's copy of the snapshot is hard links). Also printed into
bench/results/fits.md (bench/results/fits_pipeline.md with --meshes= and --pipelines). `tests/integration/test_zero.py` runs the same
procedure at a scale the suite affords.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

WORKER = os.path.join(REPO, "tests", "fits_worker.py")
BIN = os.path.dirname(sys.executable)


def parse_size(text: str) -> int:
    """--cap in bytes, as `tfdist-launch --worker_memory` reads it."""
    from tfdist_launch import UsageError, parse_memory
    try:
        return parse_memory(text)
    except UsageError as error:
        raise SystemExit(str(error)) from None


def launch(work, name, workers, cap, mesh, stage, width, depth, steps, timeout, snapshot=None,
           strategy="dtensor"):
    """One `tfdist-launch` cluster of fits_worker.py: (exit status, the launcher's
    last line, the workers' summaries, seconds)."""
    out = os.path.join(work, name)
    os.makedirs(out, exist_ok=True)
    model_dir = os.path.join(out, "model")
    if snapshot is None and name != "reference":   # links: a run only adds files
        shutil.copytree(os.path.join(work, "snapshot"), model_dir, copy_function=os.link)
    cmd = [os.path.join(BIN, "tfdist-launch"), f"--workers={workers}"]
    cmd += [f"--worker_memory={cap}"] if cap else []
    cmd += ["--", sys.executable, WORKER, out, model_dir, strategy, mesh, str(stage),
            str(width), str(depth), str(steps)]
    cmd += [snapshot] if snapshot else []
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    start = time.monotonic()
    with open(os.path.join(out, "log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout)
    seconds = time.monotonic() - start
    with open(os.path.join(out, "log")) as log:
        lines = [line.rstrip() for line in log if line.startswith("tfdist-launch:")]
    summaries = []
    for index in range(workers):
        path = os.path.join(out, f"summary-{index}.json")
        if os.path.exists(path):
            with open(path) as f:
                summaries.append(json.load(f))
    return proc.returncode, (lines[-1] if lines else ""), summaries, seconds


def weights(model_dir):
    """The trained weights in `model_dir`'s latest checkpoint, by checkpoint key."""
    import tensorflow as tf
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    keys = [k for k in reader.get_variable_to_shape_map()
            if k.startswith("optimizer/_trainable_variables/")]
    return {k: reader.get_tensor(k) for k in keys}


def compare(got_dir, want_dir, start_dir):
    """(largest |difference|, elements outside 1e-5 rel/abs, elements, largest
    move from the start): the weights of two runs from the same checkpoint.
    Read one variable at a time, never the whole model twice."""
    import numpy as np
    import tensorflow as tf
    readers = [tf.train.load_checkpoint(os.path.join(d, "checkpoints"))
               for d in (got_dir, want_dir, start_dir)]
    keys = [k for k in readers[1].get_variable_to_shape_map()
            if k.startswith("optimizer/_trainable_variables/")]
    largest = outside = total = moved = 0.0
    for key in keys:
        got, want, start = (r.get_tensor(key) for r in readers)
        largest = max(largest, float(np.abs(got - want).max()))
        outside += int((~np.isclose(got, want, rtol=1e-5, atol=1e-5)).sum())
        total += got.size
        moved = max(moved, float(np.abs(want - start).max()))
    return largest, int(outside), int(total), moved


def prove(work, width, depth, cap, meshes, steps, timeout, log=print, pipelines=(),
          export=True, keep=True):
    """The whole procedure; returns its results (see the module doc).
    `export`: whether each pipeline's checkpoint is then exported; `keep`:
    whether each capped run's directory stays once compared (each adds about
    the model's state with Adam to the disk)."""
    results = {"width": width, "depth": depth, "cap": cap}
    rc, line, summaries, seconds = launch(work, "reference", 1, None, "batch:1,model:1", 0,
                                          width, depth, steps, timeout,
                                          snapshot=os.path.join(work, "snapshot"))
    if rc != 0 or not summaries:
        raise RuntimeError(f"the uncapped reference failed ({rc}): {line}")
    results["reference"] = dict(summary=summaries[0], seconds=seconds)
    log(f"reference (1 process, no cap): {seconds:.0f} s, peak "
        f"{summaries[0]['peak_rss_bytes'] / 2**30:.2f} GiB, loss {summaries[0]['loss']:.6f}")
    rc, line, summaries, seconds = launch(work, "single_capped", 1, cap, "batch:1,model:1", 0,
                                          width, depth, steps, timeout)
    results["single_capped"] = dict(rc=rc, line=line, seconds=seconds)
    log(f"1 process under {cap}: exit {rc} after {seconds:.0f} s: {line}")
    for mesh in meshes:
        processes = 1
        for axis in mesh.split(","):
            processes *= int(axis.split(":")[1])
        results[mesh] = _capped(work, "stage3_" + mesh.replace(":", "").replace(",", "_"),
                                f"{processes} processes, stage 3, {mesh}", processes, cap,
                                mesh, 3, width, depth, steps, timeout, log, keep)
    for layout in pipelines:
        results[f"pipeline {layout}"] = _pipeline(work, layout, width, depth, cap, steps,
                                                  timeout, log, export, keep)
    return results


def _capped(work, name, title, processes, cap, mesh, stage, width, depth, steps, timeout, log,
            keep=True, strategy="dtensor") -> dict:
    """One run of `processes` under the cap from the snapshot, compared with
    the reference's weights; logged as `title`; its directory removed once
    it succeeded unless `keep`."""
    rc, line, summaries, seconds = launch(work, name, processes, cap, mesh, stage, width, depth,
                                          steps, timeout, strategy=strategy)
    entry = dict(rc=rc, line=line, seconds=seconds,
                 peaks=[s["peak_rss_bytes"] for s in summaries],
                 loss=summaries[0]["loss"] if summaries else None)
    if rc == 0:
        entry["largest"], entry["outside"], entry["elements"], entry["moved"] = compare(
            os.path.join(work, name, "model"), os.path.join(work, "reference", "model"),
            os.path.join(work, "snapshot"))
    if rc == 0 and not keep:   # a failed run's log stays
        shutil.rmtree(os.path.join(work, name))
    log(f"{title}, each under {cap}: exit {rc} after {seconds:.0f} s"
        + (f", peaks {', '.join(f'{p / 2**30:.2f}' for p in entry['peaks'])} GiB, loss "
           f"{entry['loss']:.6f}, weights vs reference: largest difference "
           f"{entry['largest']:.2e}, {entry['outside']} of {entry['elements']:,} outside "
           f"1e-5 (largest move from the snapshot {entry['moved']:.2e})" if rc == 0
           else f": {line}"))
    return entry


def _pipeline(work, layout, width, depth, cap, steps, timeout, log, export=True,
              keep=True) -> dict:
    """One pipeline S x R under the cap from the snapshot (`_capped`), then
    its final checkpoint (written in parts) exported by tfdist-export, uncapped."""
    stages, replicas = (int(n) for n in layout.split("x"))
    name, zero = f"pipeline_{layout}", " --zero_stage=1" if replicas > 1 else ""
    entry = _capped(work, name, f"pipeline {layout}{zero}, {stages * replicas} processes",
                    stages * replicas, cap, str(stages), int(replicas > 1), width, depth,
                    steps, timeout, log, keep=keep or export, strategy="pipeline")
    if entry["rc"] != 0 or not export:
        return entry
    start = time.monotonic()
    exported = subprocess.run([os.path.join(BIN, "tfdist-export"),
                               f"--model_dir={os.path.join(work, name, 'model')}",
                               f"--export_dir={os.path.join(work, name, 'export')}"],
                              capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    entry["export"] = dict(rc=exported.returncode, seconds=time.monotonic() - start,
                           line=(exported.stderr.strip().splitlines() or [""])[-1])
    log(f"pipeline {layout}: tfdist-export of its checkpoint, uncapped: exit "
        f"{exported.returncode} after {entry['export']['seconds']:.0f} s")
    if not keep:
        shutil.rmtree(os.path.join(work, name))
    return entry


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=18)
    parser.add_argument("--cap", default="3328M")
    parser.add_argument("--meshes", default="batch:4,model:1;batch:2,model:2",
                        help="dtensor meshes, ';'-separated (empty: none)")
    parser.add_argument("--pipelines", default="",
                        help="pipeline layouts S x R, ';'-separated, e.g. 2x1;2x2 (default none)")
    parser.add_argument("--steps", type=int, default=2,
                        help="the last step (the four-process runs train from step 1)")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--work_dir", default=None)
    args = parser.parse_args()
    from tfdist.observe import hardware
    cap = parse_size(args.cap)
    params = 192 * args.width + args.width + (args.depth - 1) * (args.width ** 2 + args.width) \
        + 5 * args.width + 5
    state = 16 * params
    lines = [f"# does it fit, on {hardware.describe()}",
             f"mlp {args.width}x{args.depth}: {params / 1e6:.0f}M parameters; float32 parameters "
             f"+ gradients + Adam state {state / 2**30:.2f} GiB = {state / cap:.2f}x the "
             f"per-process cap of {args.cap} ({cap / 2**30:.2f} GiB)"]
    print("\n".join(lines), flush=True)
    work = args.work_dir or tempfile.mkdtemp(prefix="tfdist-fits-")

    def log(line):
        print(line, flush=True)
        lines.append(line)

    prove(work, args.width, args.depth, args.cap, [m for m in args.meshes.split(";") if m],
          args.steps, args.timeout, log, pipelines=[p for p in args.pipelines.split(";") if p])
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    name = "fits_pipeline.md" if args.pipelines and not args.meshes else "fits.md"
    with open(os.path.join(HERE, "results", name), "w") as f:
        f.write("\n\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
