"""This host's matmul peak (TFLOP/s per dtype), measured once and cached.

MFU needs a peak to divide by, and a CPU's datasheet peak says little about
what TensorFlow reaches on it: oneDNN's kernels, the ISA it may use (AVX2,
AVX-512, AMX; bf16 is emulated without AVX512-BF16/AMX) and the cores this
process gets decide it. So the peak is measured: a large square `tf.matmul` in
a `tf.function` on TensorFlow's default (oneDNN, not XLA) path, the path a
training step's matmuls take.

A probe takes about a second per dtype; the result is cached in
`$TFDIST_CACHE_DIR/peak.json` (default `~/.cache/tfdist`), keyed by everything
that changes it: CPU model, core count, ISA features and oneDNN's ISA cap,
TensorFlow version, dtype, and the probe's own version. `tfdist-peak` prints
the figures; `--refresh` measures again and keeps the higher of the two
figures: a probe that shares the cores with other work (a test suite, a
cluster's other processes starting up) can only measure too low, and a peak
too low shows as an MFU above 100% (an entry of 0.515 TFLOP/s bf16 on a
2-core EPYC whose quiet figure is 0.84-0.88 made an mlp run read 102%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from absl import logging

from tfdist.errors import UsageError
from tfdist.observe import hardware

DTYPES = ("float32", "bfloat16", "float16")
_PRECISION_DTYPES = {"float32": "float32", "mixed_bfloat16": "bfloat16",
                     "mixed_float16": "float16"}

# Matrix size each probe starts at. Emulated 16-bit matmuls (bf16 without
# AVX512-BF16/AMX, fp16 on every CPU here) run ~10x slower than float32, so
# they start smaller; native bf16 starts at float32's size, where oneDNN
# reaches its rate (2-core EPYC, AVX512-BF16: 0.79 TFLOP/s at 1024, 0.88 at
# 2048, 0.86 at 4096; float32 0.35, 0.48, 0.51).
_START_SIZE = 2048
_EMULATED_START_SIZE = 1024
# Bumped when the probe changes what it measures: older cached entries are
# then measured again rather than trusted.
_PROBE_VERSION = 2
# Halve the size while one matmul takes longer than this, down to the minimum:
# with at most _TIMINGS timed runs, a dtype's probe stays within ~1.5 s.
_MAX_MATMUL_S = 0.25
_MIN_SIZE = 256
_TIMINGS = 5
_TIMING_BUDGET_S = 1.0


def compute_dtype(precision: str) -> str:
    """The dtype matmuls run in under a tfdist precision (e.g. mixed_bfloat16 -> bfloat16)."""
    try:
        return _PRECISION_DTYPES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; valid: "
                         f"{', '.join(_PRECISION_DTYPES)}") from None


def matmul_peak_tflops(dtype: str, *, refresh: bool = False) -> float:
    """This host's dense matmul TFLOP/s in `dtype`: cached, else measured
    (about a second) and cached. `refresh` measures again."""
    return _peak(dtype, refresh=refresh)[0]


def precision_peak_tflops(precision: str, *, measure: bool = True):
    """The peak MFU divides by under a tfdist precision, or None if it is not
    cached and `measure` is False (workers other than the chief: several
    processes probing one host's cores at once would cache a peak too low).

    A 16-bit policy's matmuls can always run at float32 speed (XLA on CPU
    computes bf16/fp16 dots in float32; on CPUs without native bf16 that is
    the fast path), so its peak is the faster of its own dtype's and
    float32's: otherwise an XLA bf16 step could show an MFU above 1.
    """
    peaks = []
    dtypes = {compute_dtype(precision), "float32"}
    if hardware.bf16_refusal():   # bf16 matmuls would abort: float32's speed is the peak
        dtypes.discard("bfloat16")
    for dtype in dtypes:
        if measure:
            peaks.append(matmul_peak_tflops(dtype))
        else:
            cached = _read_cache().get(_cache_key(dtype))
            if not isinstance(cached, (int, float)) or cached <= 0:
                return None
            peaks.append(float(cached))
    return max(peaks)


def cache_path() -> str:
    return os.path.join(hardware.cache_dir(), "peak.json")


def _peak(dtype: str, *, refresh: bool) -> tuple[float, str]:
    """(TFLOP/s, how it was found: 'measured', 'cached', or with `refresh`
    'measured X.XXX, kept the cached figure' when the new probe was lower)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    if dtype == "bfloat16" and hardware.bf16_refusal():
        raise UsageError(hardware.bf16_refusal())
    key = _cache_key(dtype)
    cached = _read_cache().get(key)
    if not (isinstance(cached, (int, float)) and not isinstance(cached, bool) and cached > 0):
        cached = None
    if cached is not None and not refresh:
        return float(cached), "cached"
    measured = _measure_tflops(dtype)
    if cached is not None and cached > measured:   # a probe sharing the cores measures low
        return float(cached), f"measured {measured:.3f}, kept the cached figure"
    _write_cache_entry(key, measured)
    return measured, "measured"


def _start_size(dtype: str) -> int:
    native = dtype == "float32" or (dtype == "bfloat16" and hardware.bf16_support() != "emulated")
    return _START_SIZE if native else _EMULATED_START_SIZE


def _cache_key(dtype: str) -> str:
    import tensorflow as tf

    return " | ".join([
        hardware.cpu_model(), f"{os.cpu_count()} cores",
        " ".join(hardware.isa_features()) or "no AVX2",
        f"oneDNN ISA cap {hardware.isa_limit() or 'none'}",
        f"TensorFlow {tf.__version__}", dtype, f"probe {_PROBE_VERSION}"])


def _read_cache() -> dict:
    """The cached entries; {} if the file is missing, unreadable or corrupt
    (it is then rewritten on the next measurement)."""
    try:
        with open(cache_path()) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_cache_entry(key: str, tflops: float) -> None:
    """Add one entry. The file is replaced atomically (temporary file, then
    `os.replace`), so a concurrent reader sees the old or the new file, never
    half of one. Two concurrent writers may drop one's entry: it is measured
    again next time. A cache that cannot be written only costs that."""
    path = cache_path()
    entries = {**_read_cache(), key: tflops}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), prefix=".peak.",
                                         suffix=".tmp", delete=False) as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(f.name, path)
    except OSError as error:
        logging.warning("Cannot cache the matmul peak in %s: %s", path, error)


def _measure_tflops(dtype: str) -> float:
    """Best TFLOP/s of a few timed square matmuls, after one warm-up (tracing
    and oneDNN's kernel set-up). The size shrinks until one matmul is short."""
    import tensorflow as tf

    @tf.function(jit_compile=False, autograph=False)
    def matmul(a, b):
        return tf.matmul(a, b)

    def time_one(a, b) -> float:
        start = time.perf_counter()
        float(matmul(a, b)[0, 0])  # fetch one element: the matmul has finished
        return time.perf_counter() - start

    n = _start_size(dtype)
    while True:
        a = tf.cast(tf.random.uniform((n, n), seed=1), dtype)
        b = tf.cast(tf.random.uniform((n, n), seed=2), dtype)
        time_one(a, b)  # warm-up
        first = time_one(a, b)
        if first <= _MAX_MATMUL_S or n <= _MIN_SIZE:
            break
        n //= 2
    repeats = max(0, min(_TIMINGS, int(_TIMING_BUDGET_S / first)) - 1)
    best = min([first, *(time_one(a, b) for _ in range(repeats))])
    return 2 * n**3 / best / 1e12


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is one line and exit status 2 (argparse prints its usage too)."""

    def error(self, message):
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    """Options grouped and described in the style of tfdist-train --help."""
    parser = _Parser(prog="tfdist-peak", allow_abbrev=False,
                     description="This host's matmul peak per dtype, measured once and cached "
                                 "(MFU divides by it).",
                     epilog=f"Cache: {cache_path()} ($TFDIST_CACHE_DIR overrides the folder).")
    measure = parser.add_argument_group("measurement")
    measure.add_argument("--dtype", default=",".join(DTYPES), metavar="DTYPE,...",
                         help=f"comma-separated dtypes, each one of {', '.join(DTYPES)} "
                              "[default: %(default)s]")
    measure.add_argument("--refresh", action="store_true",
                         help="measure again and keep the higher of the new and the cached "
                              "figure (run on a quiet machine) [default: false]")
    return parser


def _parse_args(argv) -> tuple:
    args = _parser().parse_args(argv)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise UsageError(f"--dtype={args.dtype}: unknown dtype; valid: {', '.join(DTYPES)}")
    return dtypes, args.refresh


def main(argv=None) -> int:
    """`tfdist-peak`: print the host and its matmul peak per dtype."""
    try:
        dtypes, refresh = _parse_args(argv)
    except UsageError as error:
        print(f"tfdist-peak: error: {error}", file=sys.stderr)
        sys.exit(2)   # SystemExit, as argparse's own exit was: callers rely on it
    # Quiet TensorFlow's C++ start-up chatter unless the user asked for it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    print(hardware.describe())
    for dtype in dtypes:
        tflops, how = _peak(dtype, refresh=refresh)
        print(f"{dtype}: {tflops:.3f} TFLOP/s ({how})", flush=True)
    return 0
