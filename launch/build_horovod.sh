#!/usr/bin/env bash
# build_horovod.sh - reproducible, cached build of Horovod against the
# TensorFlow that is installed in a given virtualenv.
#
# Usage: launch/build_horovod.sh [--verify] [--rebuild] [VENV_DIR]
#
#   VENV_DIR   virtualenv holding TensorFlow (default: <repo root>/.venv,
#              where <repo root> is the parent directory of this script).
#              A relative VENV_DIR is taken relative to the current directory.
#   --verify   also run `horovodrun --check-build` and the 2-rank smoke test
#              when Horovod is already installed (the fast path skips them).
#   --rebuild  ignore both the installed Horovod and the cached wheel and
#              build from source again (the new wheel replaces the cached one).
#
# Environment:
#   TFDIST_CACHE_DIR  cache root (default: $HOME/.cache/tfdist). Wheels go to
#                     $TFDIST_CACHE_DIR/wheels/horovod-<ver>-tf<tfver>-<pytag>[-cfg<hash>]/
#                     build logs to $TFDIST_CACHE_DIR/logs/.
#   HOROVOD_*         passed through untouched; this script only fills in
#                     defaults for variables the caller has not set. Any
#                     build-relevant HOROVOD_* setting that differs from the
#                     CPU/Gloo default changes the cache key (-cfg<hash>), so
#                     e.g. a GPU build with HOROVOD_GPU_OPERATIONS=NCCL gets
#                     its own cached wheel.
#   MAKEFLAGS         default -j$(nproc) (Horovod's setup.py otherwise uses -j8).
#   TFDIST_HOROVOD_KEEP_DEBUG=1  keep DWARF debug info in the library (bigger wheel).
#   TFDIST_HOROVOD_VERIFY=0      install a cached wheel without the smoke test (make test:
#                                its Horovod tests run horovodrun themselves).
#
# Exit codes: 0 ok; 1 build/install/verification failed; 2 build prerequisites
# missing (the apt-get command to fix it is printed); 64 usage error.
#
# Why this script exists: Horovod 0.28.1 (the last release) is only published
# as an sdist, and as published it does not compile against TF 2.21: the one
# failing source is horovod/tensorflow/xla_mpi_ops.cc (it includes XLA headers
# from paths/APIs that the TF wheel no longer ships). Those XLA ops are only
# used for XLA-compiled GPU graphs, so we drop that one file from the build.
set -euo pipefail

HOROVOD_VERSION="0.28.1"
# sha256 of horovod-0.28.1.tar.gz on PyPI. PyPI files are immutable, so pinning
# the hash makes the download reproducible and tamper-evident (pip enforces it
# with --require-hashes).
HOROVOD_SDIST_SHA256="92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
# Horovod's Python-side runtime deps: horovodrun imports them, and we install
# the wheel with --no-deps. setup.py also declares them as setup_requires, so
# they are put in place before building, not left to setuptools. Each pin is
# installed only if the module is missing (a version already in the venv, e.g.
# pinned by the project, is kept). Verified with horovod 0.28.1 + TF 2.21 on
# Python 3.11. `packaging` (imported by setup.py) is already a TensorFlow
# dependency, so it is only checked for, not pinned against TF.
RUNTIME_DEPS=("cloudpickle==3.1.3" "psutil==7.2.2" "PyYAML==6.0.3")
# Only installed if the venv lacks setuptools/wheel (pip's PEP 517 fallback for
# a setup.py-only sdist needs both when build isolation is off).
BUILD_DEPS=("setuptools==80.9.0" "wheel==0.45.1")
# The exact CMake line we delete. Matched as a whole line: if a future sdist
# changes it, the patch step fails loudly instead of silently doing nothing.
# shellcheck disable=SC2016  # literal CMake text, ${...} must not expand
XLA_CMAKE_LINE='list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")'

log()  { printf '[build_horovod] %s\n' "$*"; }
warn() { printf '[build_horovod] WARNING: %s\n' "$*" >&2; }
die()  { printf '[build_horovod] ERROR: %s\n' "$*" >&2; exit 1; }
now()  { date +%s; }

# ---------------------------------------------------------------- arguments
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(dirname "$SCRIPT_DIR")"
VERIFY=0
REBUILD=0
VENV_ARG=""
while (($#)); do
    case "$1" in
        --verify)  VERIFY=1 ;;
        --rebuild) REBUILD=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        -*)        printf 'unknown option: %s (see --help)\n' "$1" >&2; exit 64 ;;
        *)         [[ -z "$VENV_ARG" ]] || { echo "only one VENV_DIR allowed" >&2; exit 64; }
                   VENV_ARG="$1" ;;
    esac
    shift
done
VENV_DIR="${VENV_ARG:-$REPO_ROOT/.venv}"
[[ -d "$VENV_DIR" ]] || { echo "[build_horovod] ERROR: venv not found: $VENV_DIR" >&2; exit 64; }
VENV_DIR="$(cd "$VENV_DIR" && pwd)"
PY="$VENV_DIR/bin/python"
[[ -x "$PY" ]] || { echo "[build_horovod] ERROR: no python at $PY" >&2; exit 64; }
# Always use the venv's own pip/horovodrun, whatever else is on PATH (horovodrun
# runs the smoke-test command through a shell, so `python` must be the venv's).
export PATH="$VENV_DIR/bin:$PATH"
PIP=("$PY" -m pip --disable-pip-version-check --no-input)
# TF is chatty on import; our checks parse stdout, TF logs to stderr, this only
# trims noise. Respect a caller's explicit setting.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

# ----------------------------------------------------- build configuration
# Fill in defaults for the CPU/Gloo build without clobbering anything the
# caller set. WITH_X/WITHOUT_X are treated as a pair: if the caller set either
# one, we set neither (e.g. HOROVOD_WITH_MPI=1 for a GPU cluster must not be
# contradicted by our HOROVOD_WITHOUT_MPI=1 default).
default_pair() {  # default_pair FEATURE WITH|WITHOUT
    local with="HOROVOD_WITH_$1" without="HOROVOD_WITHOUT_$1"
    if [[ -z "${!with+x}" && -z "${!without+x}" ]]; then
        if [[ "$2" == WITH ]]; then export "$with=1"; else export "$without=1"; fi
    fi
}
[[ "${HOROVOD_WITHOUT_TENSORFLOW:-}" != 1 ]] \
    || die "HOROVOD_WITHOUT_TENSORFLOW=1 makes no sense here: this script builds Horovod for TensorFlow"
default_pair TENSORFLOW WITH     # fail the build if TF can't be used, rather than silently skip it
default_pair GLOO WITH           # Gloo: CPU collectives + horovodrun --gloo, no MPI needed
default_pair MPI WITHOUT         # no MPI on dev/CI machines; opt in with HOROVOD_WITH_MPI=1
default_pair PYTORCH WITHOUT     # not used by tfdist; also avoids picking up a stray torch
default_pair MXNET WITHOUT
# Compile Gloo in as the *default* CPU collective backend. horovodrun --gloo
# sets it at run time anyway, but without this the compiled-in default is MPI,
# which would break any other launcher in a build that has no MPI. Only done
# when MPI is off: with MPI on, mpirun users expect MPI to stay the default.
if [[ -z "${HOROVOD_CPU_OPERATIONS+x}" && "${HOROVOD_WITHOUT_MPI:-}" == 1 \
      && "${HOROVOD_WITHOUT_GLOO:-}" != 1 ]]; then
    export HOROVOD_CPU_OPERATIONS=GLOO
fi
# Horovod's setup.py passes -j8 to make unless MAKEFLAGS is set; match the
# machine instead (each TU including TF headers needs ~1 GB of RAM).
export MAKEFLAGS="${MAKEFLAGS:--j$(nproc 2>/dev/null || echo 2)}"
# HOROVOD_BUILD_ARCH_FLAGS is deliberately left alone: Horovod then enables
# -mf16c/-mavx/-mfma only if the build host has them, which is right for a
# per-host cache. Set it yourself to build a wheel for other CPUs (it is part
# of the cache key below).

# Which features the finished install must report (used by the checks).
want_gloo=1; [[ "${HOROVOD_WITHOUT_GLOO:-}" == 1 ]] && want_gloo=0
want_mpi=0;  [[ "${HOROVOD_WITH_MPI:-}" == 1 ]] && want_mpi=1
want_nccl=0
for v in HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER HOROVOD_GPU_BROADCAST; do
    [[ "${!v:-}" == NCCL ]] && want_nccl=1
done
((want_gloo || want_mpi)) || die "neither Gloo nor MPI enabled: horovodrun would have no backend"

# Build-relevant HOROVOD_* variables after defaults. Runtime-only knobs such as
# HOROVOD_TIMELINE or HOROVOD_FUSION_THRESHOLD are excluded so that they don't
# cause pointless rebuilds.
build_config() {
    env | grep -E '^HOROVOD_(WITH|WITHOUT|GPU|CPU_OPERATIONS|BUILD_ARCH_FLAGS|CUDA|NCCL|ROCM|MPI|CCL|DDL|DEBUG|CMAKE)' \
        | LC_ALL=C sort || true
}
DEFAULT_CONFIG="$(printf '%s\n' HOROVOD_CPU_OPERATIONS=GLOO HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_TENSORFLOW=1 | LC_ALL=C sort)"
CONFIG="$(build_config)"

# ------------------------------------------------------------------ checks
# One Python run that answers "is a usable Horovod already installed?".
# Prints one reason line and exits non-zero if not. Importing
# horovod.tensorflow loads mpi_lib*.so, so an ABI break (e.g. after a TF
# upgrade) shows up here; metadata.json records the TF version it was built
# against, which we compare too (Horovod itself only warns on a mismatch).
check_installed() {
    HVD_WANT="$HOROVOD_VERSION" WANT_GLOO="$want_gloo" WANT_MPI="$want_mpi" WANT_NCCL="$want_nccl" \
    "$PY" - <<'EOF'
import json, os, sys
def fail(msg):
    print(msg); sys.exit(1)
try:
    import horovod
except ImportError:
    fail("horovod is not installed")
if horovod.__version__ != os.environ["HVD_WANT"]:
    fail(f"horovod {horovod.__version__} installed, want {os.environ['HVD_WANT']}")
import tensorflow as tf
try:
    import horovod.tensorflow as hvd
except Exception as e:  # ImportError, NotFoundError (undefined symbol), version mismatch
    fail(f"import horovod.tensorflow failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
meta_path = os.path.join(os.path.dirname(horovod.__file__), "metadata.json")
try:
    built_tf = json.load(open(meta_path)).get("tensorflow")
except Exception as e:
    fail(f"cannot read {meta_path}: {e}")
if built_tf != tf.__version__:
    fail(f"horovod was built against TF {built_tf}, installed TF is {tf.__version__}")
for flag, fn in (("WANT_GLOO", hvd.gloo_built), ("WANT_MPI", hvd.mpi_built), ("WANT_NCCL", hvd.nccl_built)):
    if os.environ[flag] == "1" and not fn():
        fail(f"installed horovod lacks {flag[5:].lower()} support required by the build config")
missing = []
for mod in ("cloudpickle", "psutil", "yaml", "packaging"):
    try:
        __import__(mod)
    except ImportError:
        missing.append(mod)
if missing:
    fail("runtime deps missing: " + " ".join(missing))
print(f"horovod {horovod.__version__} built for TF {built_tf} "
      f"(gloo={bool(hvd.gloo_built())} mpi={bool(hvd.mpi_built())} nccl={bool(hvd.nccl_built())})")
EOF
}

# horovodrun --check-build must list TensorFlow and each wanted backend as [X].
# (Its "[X] PyTorch" line is a known false positive in 0.28.1: horovod.torch
# swallows the missing-library error, so PyTorch shows as built even though we
# build without it and torch is not installed. We therefore never test it.)
verify_check_build() {
    local out
    out="$(horovodrun --check-build 2>&1)" || { printf '%s\n' "$out"; die "horovodrun --check-build failed"; }
    printf '%s\n' "$out"
    local need=("TensorFlow")
    ((want_gloo)) && need+=("Gloo")
    ((want_mpi))  && need+=("MPI")
    ((want_nccl)) && need+=("NCCL")
    local n
    for n in "${need[@]}"; do
        grep -Eq "\[X\] ${n}[[:space:]]*\$" <<<"$out" || die "horovodrun --check-build does not report $n as built"
    done
}

# Two ranks on localhost allreduce (rank+1): 1 + 2 = 3.0 must come back on
# both ranks. This exercises the launcher, rendezvous, the compiled op library
# and the collective backend end to end, which an import check cannot.
verify_smoke() {
    local launcher=--gloo out
    ((want_gloo)) || launcher=--mpi
    log "smoke test: horovodrun -np 2 -H localhost:2 $launcher (allreduce of rank+1, expect 3.0 on both ranks)"
    out="$(timeout 300 horovodrun -np 2 -H localhost:2 "$launcher" python -c \
        "import horovod.tensorflow as hvd, tensorflow as tf; hvd.init(); print(hvd.rank(), hvd.allreduce(tf.constant(float(hvd.rank()+1)), op=hvd.Sum).numpy())" \
        2>&1)" || { printf '%s\n' "$out" | tail -40; die "smoke test failed to run"; }
    # horovodrun prefixes each line with [rank]<stdout>: ; keep just the payload.
    local results
    results="$(printf '%s\n' "$out" | sed -nE 's/^.*<stdout>: ?([01]) ([0-9.]+)$/\1 \2/p' | LC_ALL=C sort)"
    printf '%s\n' "$results" | sed 's/^/[build_horovod]   rank /'
    [[ "$results" == $'0 3.0\n1 3.0' ]] || { printf '%s\n' "$out" | tail -40; die "smoke test: expected '3.0' from ranks 0 and 1"; }
    log "smoke test passed"
}

verify_all() { verify_check_build; verify_smoke; }

# Run-time deps: keep a version that is already there (the project may pin it),
# install the verified pin only for what is missing.
ensure_runtime_deps() {
    local to_install=() spec mod
    for spec in "${RUNTIME_DEPS[@]}" packaging; do
        case "$spec" in
            PyYAML*) mod=yaml ;;
            *)       mod="${spec%%==*}" ;;
        esac
        "$PY" -c "import $mod" 2>/dev/null || to_install+=("$spec")
    done
    if ((${#to_install[@]})); then
        log "installing horovod runtime deps: ${to_install[*]}"
        "${PIP[@]}" install -q "${to_install[@]}"
    fi
}

# ---------------------------------------------------------- 1. fast path
# Nothing to do if a matching Horovod is already installed. This is the common
# case (every `make` run), so it must not touch the network or the compiler.
t_start="$(now)"
if ((!REBUILD)) && reason="$(check_installed 2>/dev/null)"; then
    log "already installed in $VENV_DIR: $reason"
    ((VERIFY)) && verify_all
    log "nothing to do ($(( $(now) - t_start ))s)"
    exit 0
fi
log "horovod needs installing in $VENV_DIR: ${reason:-rebuild requested}"

# ------------------------------------------------------------ cache key
# Everything the compiled library depends on: Horovod version, the exact TF
# version (TF has no stable C++ ABI, so any TF upgrade needs a rebuild), the
# Python tag and, via the wheel's file name, the platform. A non-default build
# config (GPU/MPI/arch flags...) adds a short hash so it gets its own wheel.
# (TF's import-time log spam goes to stderr, which is dropped here; the error
# message says how to see it.)
key_info="$("$PY" - 2>/dev/null <<'EOF'
import sys, sysconfig
import tensorflow as tf
print(tf.__version__, f"cp{sys.version_info[0]}{sys.version_info[1]}",
      sysconfig.get_platform().replace("-", "_").replace(".", "_"))
EOF
)" || die "cannot import tensorflow with $PY (run: $PY -c 'import tensorflow'; install the project's requirements first)"
read -r TF_VERSION PY_TAG PLAT <<<"$key_info"
KEY="horovod-${HOROVOD_VERSION}-tf${TF_VERSION}-${PY_TAG}"
if [[ "$CONFIG" != "$DEFAULT_CONFIG" ]]; then
    KEY+="-cfg$(printf '%s\n' "$CONFIG" | sha256sum | cut -c1-8)"
fi
CACHE_ROOT="${TFDIST_CACHE_DIR:-$HOME/.cache/tfdist}"
KEY_DIR="$CACHE_ROOT/wheels/$KEY"
WHEEL_NAME="horovod-${HOROVOD_VERSION}-${PY_TAG}-${PY_TAG}-${PLAT}.whl"
CACHED_WHEEL="$KEY_DIR/$WHEEL_NAME"
mkdir -p "$CACHE_ROOT/wheels" "$CACHE_ROOT/logs" "$CACHE_ROOT/tmp"
log "cache key: $KEY  (TF $TF_VERSION, $PY_TAG, $PLAT)"
[[ "$CONFIG" == "$DEFAULT_CONFIG" ]] || log "non-default build config: $(tr '\n' ' ' <<<"$CONFIG")"

# Serialise concurrent runs (e.g. `make -j` or two shells) that share a cache:
# the second waits and then finds the first one's wheel instead of building too.
exec 9>"$CACHE_ROOT/.build_horovod.lock"
if command -v flock >/dev/null 2>&1 && ! flock -n 9; then
    log "another build_horovod.sh holds $CACHE_ROOT/.build_horovod.lock; waiting..."
    flock 9
fi

install_wheel() {  # install_wheel WHEEL_PATH
    ensure_runtime_deps
    # --force-reinstall: a same-version but broken horovod (e.g. built for an
    # older TF) would otherwise be kept as "already satisfied".
    # --no-deps: the deps are handled above; horovod's metadata would otherwise
    # let pip re-resolve (and possibly upgrade) packages the project pins.
    "${PIP[@]}" install -q --no-deps --force-reinstall "$1"
}

# ----------------------------------------------------- 2. cached wheel path
if ((!REBUILD)) && [[ -f "$CACHED_WHEEL" ]]; then
    log "installing cached wheel $CACHED_WHEEL"
    install_wheel "$CACHED_WHEEL"
    if reason="$(check_installed)"; then
        log "installed: $reason"
        # Verify here: a cached wheel may be installed into a venv that differs
        # from the one it was built in (~15 s alone, ~40 s beside the test
        # suite's first tests). TFDIST_HOROVOD_VERIFY=0 leaves it to the caller:
        # `make test` sets it, because its Horovod tests run horovodrun end to end.
        if [[ "${TFDIST_HOROVOD_VERIFY:-1}" == 0 ]]; then
            log "verification skipped (TFDIST_HOROVOD_VERIFY=0: the caller runs Horovod itself)"
        else
            ( verify_all ) || { "${PIP[@]}" uninstall -q -y horovod || true
                                die "cached wheel installed but failed verification; uninstalled it (wheel kept: $CACHED_WHEEL)"; }
        fi
        log "done from cache in $(( $(now) - t_start ))s"
        exit 0
    fi
    warn "cached wheel does not work here ($reason); discarding it and rebuilding"
    rm -f "$CACHED_WHEEL"
fi

# ---------------------------------------------------- 3. build prerequisites
# Checked only now: the fast and cached paths need no compiler, so a machine
# with a warm cache does not have to install a toolchain. Every missing item is
# reported (not just the first), each with its Debian package.
missing_pkgs=()
missing_other=0
report_missing() { printf '[build_horovod] MISSING: %-28s -> apt package: %s\n' "$1" "$2" >&2; missing_pkgs+=("$2"); }
if command -v cmake >/dev/null 2>&1; then
    cmake_ver="$(cmake --version | sed -nE '1s/.*version ([0-9]+\.[0-9]+).*/\1/p')"
    # Horovod needs >= 3.13 (it would otherwise pip-install an old cmake itself).
    if [[ "$(printf '%s\n' 3.13 "$cmake_ver" | sort -V | head -1)" != 3.13 ]]; then
        report_missing "cmake >= 3.13 (found $cmake_ver)" cmake
    fi
else
    report_missing "cmake (>= 3.13)" cmake
fi
command -v "${CXX:-g++}" >/dev/null 2>&1 || report_missing "C++17 compiler (${CXX:-g++})" g++
command -v make >/dev/null 2>&1 || report_missing "make" make
# Opt-in GPU-cluster features: catch the obvious gaps here rather than 2
# minutes into CMake. (NCCL itself is found via HOROVOD_NCCL_HOME, or the
# CUDA/system paths; CMake reports it if missing.)
if ((want_mpi)) && ! command -v mpicxx >/dev/null 2>&1; then
    report_missing "MPI (mpicxx, for HOROVOD_WITH_MPI=1)" "libopenmpi-dev openmpi-bin"
fi
if ((want_nccl)) && [[ -z "${HOROVOD_CUDA_HOME:-}" ]] && ! command -v nvcc >/dev/null 2>&1; then
    # Not one apt package on Debian (non-free nvidia-cuda-toolkit, or NVIDIA's
    # own repo), so reported without joining the apt-get command below.
    printf '[build_horovod] MISSING: %-28s -> install the CUDA toolkit or set HOROVOD_CUDA_HOME\n' "CUDA toolkit (nvcc)" >&2
    missing_other=1
fi
# Python headers are NOT needed: the TF plugin is a TensorFlow op library
# loaded via tf.load_op_library, not a CPython extension (only the PyTorch /
# MXNet plugins include Python.h).
if ((${#missing_pkgs[@]})); then
    printf '[build_horovod] install them with:  apt-get update && apt-get install -y %s\n' "${missing_pkgs[*]}" >&2
fi
if ((${#missing_pkgs[@]} || missing_other)); then
    exit 2
fi

# Build-time Python deps. setup.py imports `packaging`, declares the runtime
# deps as setup_requires, and without build isolation pip uses the venv's own
# setuptools/wheel.
ensure_runtime_deps
if ! "$PY" -c "import setuptools, wheel" 2>/dev/null; then
    log "installing build deps: ${BUILD_DEPS[*]}"
    "${PIP[@]}" install -q "${BUILD_DEPS[@]}"
fi

# --------------------------------------------------------------- 4. build
# Leftovers from a killed earlier run (we hold the lock, so nobody else is
# using them).
rm -rf "$CACHE_ROOT"/tmp/build.*
# Work dir lives inside the cache dir so the final `mv` into the cache is a
# same-filesystem rename, i.e. atomic.
WORK="$(mktemp -d "$CACHE_ROOT/tmp/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
LOG="$CACHE_ROOT/logs/${KEY}-$(date +%Y%m%d-%H%M%S).log"
fail_build() {
    printf '[build_horovod] ERROR: %s\n[build_horovod] full log: %s\n[build_horovod] last 40 lines:\n' "$1" "$LOG" >&2
    tail -n 40 "$LOG" >&2
    exit 1
}
{
    echo "# build_horovod.sh $(date -Is) on $(hostname)"
    echo "# venv=$VENV_DIR python=$("$PY" -V 2>&1) tf=$TF_VERSION key=$KEY"
    echo "# MAKEFLAGS=$MAKEFLAGS"
    printf '%s\n' "$CONFIG" | sed 's/^/# /'
} >"$LOG"

# 4a. Fetch the sdist. --no-binary :all: because 0.28.1 has no wheels anyway
# and we must never pick up some foreign binary; --require-hashes pins the
# exact file.
log "downloading horovod==$HOROVOD_VERSION sdist"
printf 'horovod==%s --hash=sha256:%s\n' "$HOROVOD_VERSION" "$HOROVOD_SDIST_SHA256" >"$WORK/req.txt"
"${PIP[@]}" download -q --no-deps --no-binary :all: --require-hashes -r "$WORK/req.txt" -d "$WORK/sdist" \
    >>"$LOG" 2>&1 || fail_build "pip download of horovod==$HOROVOD_VERSION failed"
mkdir "$WORK/src"
tar -xzf "$WORK/sdist/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK/src"
SRC="$WORK/src/horovod-$HOROVOD_VERSION"

# 4b. Patch: drop xla_mpi_ops.cc from the TF plugin's sources (see header).
# Exact whole-line match, exactly once, and no reference left afterwards;
# anything else means the source changed and a human should look.
CML="$SRC/horovod/tensorflow/CMakeLists.txt"
n="$(grep -cFx -- "$XLA_CMAKE_LINE" "$CML" || true)"
[[ "$n" == 1 ]] || die "patch: expected exactly 1 line '$XLA_CMAKE_LINE' in $CML, found $n; the Horovod source changed, review the patch"
grep -vFx -- "$XLA_CMAKE_LINE" "$CML" >"$CML.patched"
mv "$CML.patched" "$CML"
! grep -q 'xla_mpi_ops' "$CML" || die "patch: $CML still references xla_mpi_ops after patching"
log "patched $(basename "$(dirname "$CML")")/CMakeLists.txt: xla_mpi_ops.cc removed from TF_SOURCES"

# 4c. Build the wheel.
#  --no-build-isolation: CMake locates TF by importing it with this venv's
#    python (PYTHON_EXECUTABLE); an isolated build env would have no TF.
#  --no-deps: deps are handled explicitly above.
#  -v: pip hides the CMake/compiler output otherwise; it goes to the log.
#  LDFLAGS --strip-debug: setup.py always builds RelWithDebInfo; the DWARF
#    info from TF's headers inflates the library many times over. Dropping it at
#    link time keeps the cached wheel small and its install fast. Set
#    TFDIST_HOROVOD_KEEP_DEBUG=1 to keep it (e.g. to debug a crash).
build_ldflags="${LDFLAGS:-}"
[[ "${TFDIST_HOROVOD_KEEP_DEBUG:-0}" == 1 ]] || build_ldflags="${build_ldflags:+$build_ldflags }-Wl,--strip-debug"
log "building wheel (MAKEFLAGS=$MAKEFLAGS; 5-8 min on 2 cores); log: $LOG"
t_build="$(now)"
LDFLAGS="$build_ldflags" "${PIP[@]}" wheel -v --no-build-isolation --no-deps -w "$WORK/wheelhouse" "$SRC" \
    >>"$LOG" 2>&1 || fail_build "wheel build failed"
build_secs=$(( $(now) - t_build ))
built=("$WORK"/wheelhouse/horovod-*.whl)
[[ -f "${built[0]}" ]] || fail_build "pip reported success but produced no wheel"
[[ "$(basename "${built[0]}")" == "$WHEEL_NAME" ]] \
    || warn "wheel is named $(basename "${built[0]}"), expected $WHEEL_NAME"
log "built $(basename "${built[0]}") ($(du -h "${built[0]}" | cut -f1)) in ${build_secs}s"

# --------------------------------------------- 5. install, verify, publish
# Verify before publishing, so that only a wheel that passed the smoke test
# ever lands in the cache. On failure, uninstall it so that the fast path of
# the next run doesn't mistake it for a good install.
install_wheel "${built[0]}"
if ! reason="$(check_installed)"; then
    "${PIP[@]}" uninstall -q -y horovod || true
    die "freshly built horovod does not work: $reason"
fi
log "installed: $reason"
( verify_all ) || { "${PIP[@]}" uninstall -q -y horovod || true; die "verification of the fresh build failed; wheel not cached"; }

mkdir -p "$KEY_DIR"
# copy to a temp name in the same directory, then rename: readers see either
# no wheel or the complete one, never a partial file.
cp "${built[0]}" "$KEY_DIR/.$WHEEL_NAME.partial.$$"
mv -f "$KEY_DIR/.$WHEEL_NAME.partial.$$" "$CACHED_WHEEL"
{
    echo "horovod=$HOROVOD_VERSION sdist_sha256=$HOROVOD_SDIST_SHA256"
    echo "tensorflow=$TF_VERSION python=$PY_TAG platform=$PLAT"
    echo "built=$(date -Is) host=$(hostname) seconds=$build_secs"
    echo "patch: removed '$XLA_CMAKE_LINE' from horovod/tensorflow/CMakeLists.txt"
    echo "MAKEFLAGS=$MAKEFLAGS LDFLAGS=$build_ldflags"
    printf '%s\n' "$CONFIG"
    echo "log=$LOG"
} >"$KEY_DIR/BUILD_INFO.txt"
log "cached $CACHED_WHEEL"
log "done in $(( $(now) - t_start ))s"
