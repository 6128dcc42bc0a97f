"""Training across a slow network: gradient compression and local SGD on a
shaped link between two "hosts".

    sudo .venv/bin/python bench/slow_link.py
        [--configs none,bf16,powersgd,powersgd16,topk,topk10,localsgd]
        [--rates 1gbit,100mbit] [--steps 24] [--width 256] [--delay 1ms]
        [--learning_rate 0.001] [--accuracy_steps 400] [--warmup_fraction 0] [--quick]

The two hosts are two network namespaces joined by a veth pair
(tests/netns.py `Link`), each direction limited by a `tbf` qdisc on its end
(`tc qdisc replace ... tbf rate R burst B latency 100ms`: B is 10 ms of R,
at least 64 KiB). A `--delay` is added with `netem` where the kernel has it;
where `tc` refuses netem, the bench says why in one line and runs without
delay. One `tfdist-train --strategy=multi_worker --worker_hosts=... --task_index=i`
worker runs in each namespace, training the transformer on tfdist_tokens
(--model_width=--width, depth 2, global batch --batch (64), Adam at
--learning_rate (0.001), 8 steps per loop, XLA as --jit_compile=auto picks),
for each configuration:

- none: gradients all-reduced in float32;
- bf16: `--grad_compression=bf16` (cast for the sum);
- powersgd r4, powersgd r16: `--grad_compression=powersgd --powersgd_rank=4` (16);
- topk 1%, topk 10%: `--grad_compression=topk --topk_fraction=0.01` (0.1);
- local SGD K=8: `--sync_every=8` (weights averaged every 8 steps).

A configuration this tfdist-train does not know (it exits 2 on the flag)
gets the row "not available: <its error>" and the bench goes on.

What each row reports, for each rate:

- ex/s: `examples_per_sec` of the chief's run summary (the timed loops after
  the first, compiling one), and its ratio to `none` at that rate;
- bytes/step: bytes actually sent over the link per training step, from the
  interface counters (tx bytes of both veth ends: every header and TCP
  retransmission included), never computed from the model. Each
  configuration trains twice with identical flags but --train_steps, N and
  N + --steps (N = one loop); start-up, the initial broadcast of the weights,
  evaluation, the final checkpoint and the exit are the same in both, so
  (bytes_long - bytes_short) / --steps is what the extra steps sent. The
  heartbeats and coordination traffic of the long run's extra wall time
  remain in that difference: they are subtracted as the idle rate times the
  wall-time difference. The idle rate is measured on the same runs: the
  counters are sampled every 0.25 s, and the idle rate is the bytes per
  second of the stretches of at least 2 s, between the first and the last
  bulk transfer, in which no sample saw more than 4 KB (TensorFlow's
  heartbeats, and small coordination and metric reductions). It is printed
  (idle B/s): a few hundred bytes a second here (about 1.5 KB/s with local
  SGD, whose quiet stretches include the steps between its averages), under
  0.1% of any row's bytes per second. Also printed in units of the model's
  float32 gradient bytes per worker (a ring all-reduce over 2 workers sends
  one model's bytes per worker per step), and as a reduction against `none`;
- link busy: bytes/step x steps/s of the timed loops / (2 directions x rate),
  the share of the step time the link is carrying data (1.0: saturated);
- test accuracy: the summary's test `accuracy` after the long run (the same
  number of examples for every row). With the default steps that is early
  training: a sanity check that a row still learns, not a convergence study.

Then the accuracy phase (`--accuracy_steps`, default 400; 0 skips it): each
configuration trains that many steps once more on the unshaped link (the
accuracy of an exchange does not depend on the link's rate), evaluated every
eighth of them; with --warmup_fraction > 0, the compressions warm up over
that share of the steps (`--compression_warmup_steps`: PowerSGD sums
uncompressed first, as PyTorch's `start_powerSGD_iter`; top-k's density falls
from 25% in DGC's four stages). Its table gives each configuration's final
test accuracy, the difference to `none` in percentage points, and the first
evaluations at which it came within 0.5 pp (parity) and within 2 pp of
`none`'s final accuracy. Last, the time to accuracy at each rate: those steps
times the configuration's seconds per step measured on that shaped link
(training steps only: start-up, compilation and evaluation excluded; warm-up
steps at none's seconds per step). The link decides when the bytes arrive,
not what is summed, so the steps to an accuracy are the same at every rate
and are measured once, unshaped.

The default width 256 (1.63 M parameters, 6.5 MB of float32 gradients,
13.1 MB over the link per uncompressed step) makes the uncompressed run
link-bound at 100mbit, measured: the link carries data for 0.6-0.7 of its
step time (the step's compute does not overlap it) and it trains 2.8-3.7x
slower than at 1gbit, where the link is busy 0.17-0.25 of the time and
compute bounds it. Figures: bench/results/slow_link.md. About 40 minutes at
the defaults on a 2-core Xeon (seven configurations: 28 shaped runs and 7 of
400 steps), 6 with --quick (most of a shaped run is TensorFlow's start-up and
XLA compilation, ~20 s, twice per row); the step rates are noisy when the
machine is shared, the bytes repeat to 0.2%.

Every run has a hard timeout (--timeout) and a fresh --model_dir; the
namespaces (slowns0 and slowns1; left-overs of an earlier run deleted first)
are deleted however the bench ends. Needs root, `ip netns`, veth and `tc`
with `tbf`: otherwise it says why in one line and exits 0. The table goes to
bench/results/slow_link.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# tests/ after bench/: both have a common.py.
sys.path.append(os.path.join(os.path.dirname(HERE), "tests"))

import netns  # noqa: E402
from common import (Clock, finish, hardware_header, markdown_table, print_row,  # noqa: E402
                    table)

CONFIGS = {   # --configs name: (row label, flags)
    "none": ("none", []),
    "bf16": ("bf16", ["--grad_compression=bf16"]),
    "powersgd": ("powersgd r4", ["--grad_compression=powersgd", "--powersgd_rank=4"]),
    "powersgd16": ("powersgd r16", ["--grad_compression=powersgd", "--powersgd_rank=16"]),
    "topk": ("topk 1%", ["--grad_compression=topk", "--topk_fraction=0.01"]),
    "topk10": ("topk 10%", ["--grad_compression=topk", "--topk_fraction=0.1"]),
    "localsgd": ("local SGD K=8", ["--sync_every=8"]),
}
PREFIX = "slow"   # namespaces slowns0/slowns1, veth slowv0/slowv1: fixed, so left-overs are found
ADDRESSES = ("10.235.0.1", "10.235.0.2")
PORT = 23456
LOOP = 8          # steps per loop; the short run is one loop (a multiple of K=8)
SAMPLE_S = 0.25   # counter sampling period, for the idle rate
QUIET_BYTES = 4000        # a sample interval with at most this much is quiet
QUIET_STRETCH_S = 2.0     # idle: quiet stretches at least this long
HEADER = ["rate", "config", "ex/s", "speed-up", "MB/step", "per worker (x model)",
          "bytes reduction", "link busy", "test acc", "idle B/s"]
# The accuracy phase: compressions that may warm up (--warmup_fraction;
# PowerSGD: summed uncompressed, PyTorch's start_powerSGD_iter; top-k: DGC's
# density warm-up).
WARMED = ("powersgd", "powersgd16", "topk", "topk10")
ACCURACY_HEADER = ["config", "steps", "test acc", "vs none (pp)", "within 0.5 pp of none's "
                   "final from step", "within 2 pp from step", "evaluations (step: acc)"]
TIME_HEADER = ["rate", "config", "s/step", "steps to parity", "time to parity (s)",
               "vs none", "steps to -2 pp", "time to -2 pp (s)", "vs none (-2 pp)"]
PARITY, NEAR = 0.005, 0.02   # "reached": within 0.5 and within 2 points of none's final
_EVALUATION = re.compile(r"\] step (\d+)/\d+ .*test_accuracy=([0-9.]+)")


class RunFailed(Exception):
    """A run that could not be measured; str() is what its row says."""


def model_flags(args) -> list:
    return ["--model=transformer", "--dataset=tfdist_tokens", f"--model_width={args.width}",
            "--model_depth=2", f"--global_batch_size={args.batch}",
            f"--learning_rate={args.learning_rate}",
            f"--steps_per_loop={LOOP}", "--collective_timeout_s=120"]


def run(link, directory, name, flags, steps, timeout) -> dict:
    """One two-worker run of `steps` steps: the chief's summary, the bytes the
    link carried from start to exit, the wall time and the counter samples."""
    model_dir = os.path.join(directory, name)
    workers = netns.Workers(link, directory, [*flags, f"--train_steps={steps}",
                                              f"--model_dir={model_dir}"], port=PORT)
    before, start = link.tx_bytes(), time.monotonic()
    samples = [(0.0, 0)]
    workers.start(name)
    try:
        while any(p.poll() is None for p in workers.procs):
            if time.monotonic() - start > timeout:
                raise RunFailed(f"timed out (> {timeout:.0f} s)")
            time.sleep(SAMPLE_S)
            samples.append((time.monotonic() - start, link.tx_bytes() - before))
    finally:
        workers.kill()
    seconds = time.monotonic() - start
    sent = link.tx_bytes() - before
    codes = [p.returncode for p in workers.procs]
    if codes != [0, 0]:
        lines = [line.strip() for line in workers.text(0, "err").splitlines() if line.strip()]
        errors = [line for line in lines if "rror" in line] or lines or ["no output"]
        why = errors[-1][-160:]
        raise RunFailed(f"not available: {why}" if 2 in codes else f"fails (exit {codes}): {why}")
    return {"summary": workers.summary(), "bytes": sent, "seconds": seconds,
            "samples": samples}


def quiet(samples) -> tuple:
    """(bytes, seconds) of the quiet stretches (every sample interval <=
    QUIET_BYTES, together >= QUIET_STRETCH_S) between the first and the last
    bulk transfer of a run's counter samples."""
    steps = [(t1 - t0, b1 - b0) for (t0, b0), (t1, b1) in zip(samples, samples[1:])]
    bulk = [i for i, (_, sent) in enumerate(steps) if sent > QUIET_BYTES]
    if not bulk:
        return 0, 0.0
    total_bytes, total_s, stretch = 0, 0.0, []
    for dt, sent in steps[bulk[0] + 1:bulk[-1]] + [(0.0, QUIET_BYTES + 1)]:
        if sent <= QUIET_BYTES:
            stretch.append((dt, sent))
            continue
        if sum(dt for dt, _ in stretch) >= QUIET_STRETCH_S:
            total_s += sum(dt for dt, _ in stretch)
            total_bytes += sum(sent for _, sent in stretch)
        stretch = []
    return total_bytes, total_s


def measure(link, directory, args, rate, name) -> dict:
    """Bytes per step, idle rate and the long run's summary of one configuration."""
    flags = [*model_flags(args), *CONFIGS[name][1]]
    short = run(link, directory, f"{rate}-{name}-short", flags, LOOP, args.timeout)
    long = run(link, directory, f"{rate}-{name}-long", flags, LOOP + args.steps, args.timeout)
    idle_bytes, idle_s = map(sum, zip(quiet(short["samples"]), quiet(long["samples"])))
    idle_rate = idle_bytes / idle_s if idle_s else None
    extra_s = long["seconds"] - short["seconds"]
    difference = long["bytes"] - short["bytes"] - (idle_rate or 0.0) * max(extra_s, 0.0)
    return {"bytes_per_step": difference / args.steps, "idle_rate": idle_rate,
            "summary": long["summary"]}


def row(rate, label, result, none) -> list:
    s = result["summary"]
    per_step = result["bytes_per_step"]
    model_bytes = none["summary"]["bytes_reduced_per_update"] if none else None  # float32
    steps_per_s = s["examples_per_sec"] / s["global_batch_size"]
    busy = per_step * steps_per_s / (2 * netns.rate_bits(rate) / 8)
    idle = result["idle_rate"]
    return [rate, label, f"{s['examples_per_sec']:.1f}",
            f"{s['examples_per_sec'] / none['summary']['examples_per_sec']:.2f}x" if none else "",
            f"{per_step / 1e6:.3f}", f"{per_step / 2 / model_bytes:.3f}" if model_bytes else "",
            f"{none['bytes_per_step'] / per_step:.1f}x" if none else "",
            f"{busy:.2f}", f"{s['accuracy']:.4f}" if s.get("accuracy") is not None else "n/a",
            f"{idle:.0f}" if idle is not None else "n/a"]


def accuracy_curve(link, directory, args, name) -> list:
    """[(step, test accuracy)] of one run of --accuracy_steps steps on the
    unshaped link, evaluated every eighth of them (the chief's log lines)."""
    steps = args.accuracy_steps
    flags = [*model_flags(args), *CONFIGS[name][1], f"--eval_every={steps // 8}",
             f"--train_steps={steps}"]
    if name in WARMED and warmup_steps(args):
        flags.append(f"--compression_warmup_steps={warmup_steps(args)}")
    workers = netns.Workers(link, directory, [*flags, f"--model_dir={directory}/acc-{name}"],
                            port=PORT)
    workers.start(f"accuracy-{name}")
    try:
        codes = workers.wait(args.timeout * max(1, steps // 100))
    finally:
        workers.kill()
    if codes != [0, 0]:
        raise RunFailed(f"fails (exit {codes}): {workers.tails()[-300:]}")
    logged = sorted({int(step): float(accuracy) for step, accuracy
                     in _EVALUATION.findall(workers.text(0, "err"))}.items())
    return evaluations(logged, steps // 8)


def evaluations(logged: list, every: int) -> list:
    """The (step, test accuracy) of each evaluation among a run's progress
    lines `logged` (every loop's line repeats the last evaluation): the first
    line at or after each multiple of `every` (local SGD evaluates at the
    first average at or after it), and the last."""
    found = {}
    for multiple in range(every, logged[-1][0] + 1, every) if logged else ():
        first = next(((s, a) for s, a in logged if s >= multiple), None)
        if first:
            found[first[0]] = first[1]
    if logged:
        found[logged[-1][0]] = logged[-1][1]
    return sorted(found.items())


def warmup_steps(args) -> int:
    return int(args.accuracy_steps * args.warmup_fraction)


def reached(curves: dict, name: str, within: float):
    """The first evaluated step of `name` within `within` of none's final
    test accuracy, or None."""
    if not curves.get("none") or not curves.get(name):
        return None
    target = curves["none"][-1][1] - within
    return next((step for step, accuracy in curves[name] if accuracy >= target), None)


def accuracy_rows(curves: dict) -> list:
    """One row per configuration: its final accuracy, the difference to
    none's, and the first evaluations within 0.5 pp and 2 pp of none's final."""
    target = curves["none"][-1][1] if curves.get("none") else None
    rows = []
    for name, curve in curves.items():
        if not curve:
            rows.append([CONFIGS[name][0], "", "n/a", "", "", "", ""])
            continue
        step, final = curve[-1]
        found = [reached(curves, name, within) for within in (PARITY, NEAR)]
        rows.append([CONFIGS[name][0], step, f"{final:.4f}",
                     f"{100 * (final - target):+.1f}" if target is not None else "",
                     *(f if f is not None else f"not within {step}" for f in found),
                     " ".join(f"{s}:{a:.3f}" for s, a in curve)])
    return rows


def time_rows(args, curves: dict, speeds: dict) -> list:
    """Time to accuracy per rate: the steps each configuration needed (on
    the unshaped link) times its seconds per step on the shaped link (the
    same computation at any rate: the link changes when bytes arrive, not
    what is summed). Steps of a compression warm-up are counted at none's
    seconds per step (PowerSGD's sums uncompressed; top-k's sends more than
    its final density)."""
    rows = []
    for rate, by_name in speeds.items():
        none_s = by_name.get("none")
        times = {}
        for name, step_s in by_name.items():
            row = [rate, CONFIGS[name][0], f"{step_s:.3f}"]
            for within in (PARITY, NEAR):
                step = reached(curves, name, within)
                warm = min(step or 0, warmup_steps(args)) if name in WARMED else 0
                if step is None:
                    row += [f"not within {args.accuracy_steps}" if curves.get(name) else "n/a",
                            "", ""]
                    continue
                if warm and none_s is None:   # warm-up steps need none's step time
                    row += [step, "n/a (none not measured)", ""]
                    continue
                seconds = warm * (none_s or 0.0) + (step - warm) * step_s
                times[name, within] = seconds
                base = times.get(("none", within))
                row += [step, f"{seconds:.0f}", f"{base / seconds:.2f}x" if base else ""]
            rows.append(row)
    return rows


def why_skip():
    why = netns.why_not(PREFIX)
    if why is None:
        why = netns.why_no_qdisc(PREFIX, "tbf", "rate", "100mbit", "burst", "65536",
                                 "latency", "100ms")
    return why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"rows to measure, of {','.join(CONFIGS)}")
    parser.add_argument("--rates", default="1gbit,100mbit", help="tbf rates, e.g. 1gbit,100mbit")
    parser.add_argument("--steps", type=int, default=24,
                        help="measured steps: the long run's --train_steps minus the short's "
                             "(a multiple of 8 keeps local SGD's averages whole)")
    parser.add_argument("--width", type=int, default=256, help="the transformer's --model_width")
    parser.add_argument("--batch", type=int, default=64,
                        help="--global_batch_size (smaller: less compute per step for the same "
                             "bytes, a more link-bound run)")
    parser.add_argument("--delay", default="1ms", help="netem delay per direction, if netem exists")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--learning_rate", type=float, default=0.001,
                        help="Adam's learning rate (at 0.003 PowerSGD and top-k lose 21-22 "
                             "points on this transformer, at 0.001 rank-16 PowerSGD 0.3: "
                             "bench/results/compression_accuracy_transformer_adam0.001.md)")
    parser.add_argument("--accuracy_steps", type=int, default=400,
                        help="then train each configuration this many steps on the unshaped "
                             "link (0: skip) and report test accuracy every eighth of them, "
                             "and the time each needs to reach none's final accuracy at each "
                             "rate")
    parser.add_argument("--warmup_fraction", type=float, default=0.0,
                        help="the accuracy phase's --compression_warmup_steps for powersgd "
                             "and topk, as a fraction of --accuracy_steps (0.25: the papers' "
                             "way; counted at none's step time in the time to accuracy)")
    parser.add_argument("--quick", action="store_true",
                        help="100mbit only, 8 measured steps, no accuracy phase (about 6 minutes)")
    args = parser.parse_args()
    if args.quick:
        args.rates, args.steps, args.accuracy_steps = "100mbit", 8, 0
    names = args.configs.split(",")
    for name in names:
        if name not in CONFIGS:
            parser.error(f"--configs: unknown {name!r}; known: {', '.join(CONFIGS)}")
    rates = args.rates.split(",")
    for rate in rates:
        try:
            netns.rate_bits(rate)
        except ValueError as e:
            parser.error(f"--rates: {e}")
    why = why_skip()
    if why:
        print(f"slow_link.py: skipped: {why}")
        return
    print(hardware_header(), flush=True)
    delay = args.delay or None
    no_netem = netns.why_no_qdisc(PREFIX, "netem", "delay", "1ms") if delay else None
    if no_netem:
        print(f"slow_link.py: no added delay: {no_netem}")
        delay = None
    clock = Clock()
    link = netns.Link(PREFIX, ADDRESSES)
    rows = []
    link.delete()   # left-overs of an interrupted run
    try:
        link.create()
        with tempfile.TemporaryDirectory() as directory:
            speeds = {}
            for rate in rates:
                link.shape(rate, delay=delay)
                none = None
                speeds[rate] = {}
                for name in names:
                    label = CONFIGS[name][0]
                    try:
                        result = measure(link, directory, args, rate, name)
                    except RunFailed as failure:
                        rows.append([rate, label, str(failure)] + [""] * (len(HEADER) - 3))
                    else:
                        none = result if name == "none" else none
                        rows.append(row(rate, label, result, none))
                        summary = result["summary"]
                        speeds[rate][name] = (summary["global_batch_size"]
                                              / summary["examples_per_sec"])
                    print_row(rows[-1], HEADER)
            curves = {}
            if args.accuracy_steps:
                link.unshape()
                for name in names:
                    try:
                        curves[name] = accuracy_curve(link, directory, args, name)
                    except RunFailed as failure:
                        print(f"slow_link.py: accuracy of {name}: {failure}")
                        curves[name] = []
                    print(f"accuracy {name}: {curves[name]}", flush=True)
    finally:
        link.delete()
    model = (f"transformer width {args.width}, depth 2, global batch {args.batch}, Adam at "
             f"{args.learning_rate}, {LOOP} steps per loop")
    description = (
        f"Two multi_worker workers in two network namespaces over a veth pair shaped with tbf "
        f"({model}; {args.steps} measured steps: the difference of a {LOOP}- and a "
        f"{LOOP + args.steps}-step run, idle traffic subtracted; link delay: "
        f"{delay or 'none, ' + (no_netem or 'not asked')}). Bytes are the interface counters "
        "of both ends; `per worker (x model)` is bytes/step / 2 / the float32 gradient bytes; "
        "ratios are against `none` at the same rate.")
    if args.accuracy_steps:
        accuracy = accuracy_rows(curves)
        print(table(accuracy, ACCURACY_HEADER))
        warm = (f"powersgd and topk with --compression_warmup_steps={warmup_steps(args)}"
                if warmup_steps(args) else "no compression warm-up")
        description += (
            f"\n\nAccuracy ({args.accuracy_steps} steps of the same configurations on the "
            f"unshaped link; {warm}):\n\n" + markdown_table(accuracy, ACCURACY_HEADER))
        timed = time_rows(args, curves, speeds)
        print(table(timed, TIME_HEADER))
        description += (
            "\n\nTime to accuracy: the steps above (the first evaluation within 0.5 pp, "
            "and within 2 pp, of none's final test accuracy) times each configuration's "
            "seconds per step on the shaped link (the timed loops' examples/s; start-up, "
            "compilation and evaluation not counted; the link changes when bytes arrive, not "
            "what is summed, so the steps are the same at every rate"
            + ("; warm-up steps at none's seconds per step" if warmup_steps(args) else "")
            + "). `vs none`: none's time / this one's.\n\n"
            + markdown_table(timed, TIME_HEADER))
    finish("slow_link", "Training across a slow link (bench/slow_link.py)", description, rows,
           HEADER, clock)


if __name__ == "__main__":
    main()
