#!/usr/bin/env bash
# run_suite.sh VENV - what `make test` runs once the venv is installed:
# every test but those marked slow (`make slow` runs those).
#
# One pytest run over every test, two xdist workers (--dist loadfile: a file's
# tests share one process, so module-scoped clusters are shared), while the
# Horovod build (seconds once its wheel is cached, 2-4 minutes on a fresh
# machine) runs beside it. The Horovod tests wait for the build
# (tests/conftest.py), and a failed build fails them. Two workers on 2 cores
# measured 1.9x the serial suite: most tests wait on child processes.
# Prints the slowest tests and the time of each phase.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
BIN=$VENV/bin
STATUS=$VENV/horovod-build.status
LOG=$VENV/horovod-build.log
rm -f "$STATUS"
start=$(date +%s)
# A cached wheel is installed without horovodrun's smoke test
# (TFDIST_HOROVOD_VERIFY=0): tests/integration/test_horovod.py runs horovodrun end to end.
( TFDIST_HOROVOD_VERIFY=0 make --no-print-directory horovod > "$LOG" 2>&1; code=$?
  echo "$code $(( $(date +%s) - start ))" > "$STATUS.tmp" && mv "$STATUS.tmp" "$STATUS" ) &
build=$!
TFDIST_REQUIRE_HOROVOD=1 TFDIST_HOROVOD_BUILD_STATUS=$STATUS TFDIST_HOROVOD_BUILD_LOG=$LOG \
  "$BIN/python" -m pytest -q -n 2 --dist loadfile --durations=15 -p no:cacheprovider -m "not slow" \
  --ignore=tests/docs tests
status=$?
wait "$build"
suite=$(( $(date +%s) - start ))
read -r build_code build_s < "$STATUS" || { build_code=1; build_s="?"; }
if [ "$build_code" != 0 ]; then
  echo "make horovod failed (exit $build_code); the end of $LOG:"; tail -40 "$LOG"; status=1
fi
install_s=$(cat "$VENV/.install-seconds" 2>/dev/null || echo 0); rm -f "$VENV/.install-seconds"
cpu=$("$BIN/python" -c "from tfdist.observe import hardware; print(hardware.describe())" 2>/dev/null)
echo "make test phases: install ${install_s}s (0: already installed), suite ${suite}s" \
     "(Horovod build ${build_s}s beside it); $cpu"
exit $status
