#!/usr/bin/env bash
# local_slurm.sh - a one-node Slurm on this machine, to run launch/slurm/tfdist.sbatch
# for real (the tests do; `make slurm` installs and starts it).
#
# Usage: launch/slurm/local_slurm.sh install|start|stop|status|env [DIR]
#
#   install  Debian's slurm-wlm and munge, if missing (needs root and the network;
#            22.05.8 on Debian 12). Exit 2 with one line if they cannot be had.
#   start    write DIR/slurm.conf (this node's real short hostname, CPU count and
#            memory), start munged, slurmctld and slurmd with everything (key,
#            socket, state, spool, logs, pid files) inside DIR, and wait (polling)
#            until `sinfo` shows the node idle. Prints the SLURM_CONF line to export.
#   stop     cancel the jobs of this Slurm, then end the daemons that `start`
#            started (by their pid files in DIR only), SIGKILL after 10 s.
#   status   exit 0 if this Slurm's node answers, else 1.
#   env      print `export SLURM_CONF=DIR/slurm.conf`.
#
# DIR defaults to $TFDIST_SLURM_DIR, else /tmp/tfdist-slurm. A system Slurm or
# munge, if any, is left alone: this one has its own munge socket
# (AuthInfo=socket=...) and its own ports (TFDIST_SLURMCTLD_PORT, default 6817,
# and the next one for slurmd).
#
# Why these settings: the node may be a container or VM without systemd or a
# writable cgroup hierarchy, so processes are tracked by parent pid
# (proctrack/linuxproc) and tasks are not confined (task/none). CPUs are the
# consumable resource (select/cons_tres, CR_CPU; memory is not), and
# OverSubscribe=FORCE lets two test jobs share the node's CPUs at once.
set -euo pipefail

ACTION=${1:-}
DIR=${2:-${TFDIST_SLURM_DIR:-/tmp/tfdist-slurm}}
CTLD_PORT=${TFDIST_SLURMCTLD_PORT:-6817}
SLURMD_PORT=$((CTLD_PORT + 1))
START_TIMEOUT_S=${TFDIST_SLURM_START_TIMEOUT_S:-60}
DAEMONS=(slurmd slurmctld munged)   # stopped in this order

log() { printf 'local_slurm: %s\n' "$*" >&2; }
die() { log "$1"; exit "${2:-1}"; }

have_slurm() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null
}

install() {
    if have_slurm; then
        log "installed: $(slurmctld -V)"; return 0
    fi
    [ "$(id -u)" = 0 ] || die "installing slurm-wlm and munge needs root (apt-get)" 2
    command -v apt-get >/dev/null || die "no apt-get here: install slurm-wlm and munge yourself" 2
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            slurm-wlm munge; } >"${TMPDIR:-/tmp}/local_slurm-apt.log" 2>&1; then
        die "apt-get install slurm-wlm munge failed (offline?): $(tail -1 \
"${TMPDIR:-/tmp}/local_slurm-apt.log")" 2
    fi
    have_slurm || die "slurm-wlm installed but slurmctld/slurmd/sbatch/munged not found" 2
    log "installed: $(slurmctld -V)"
}

real_memory_mb() {   # what slurmd will find, less 5% so a small difference never drains the node
    awk '/^MemTotal:/ { printf "%d\n", $2 / 1024 * 0.95 }' /proc/meminfo
}

write_config() {
    local host cpus
    host=$(hostname -s)
    cpus=$(nproc)
    cat >"$DIR/slurm.conf" <<EOF
# Written by launch/slurm/local_slurm.sh: a one-node Slurm for tfdist's tests.
ClusterName=tfdist
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=$host CPUs=$cpus RealMemory=$(real_memory_mb) State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
}

start_munge() {
    mkdir -p "$DIR/munge"
    chmod 0700 "$DIR/munge"
    [ -f "$DIR/munge/munge.key" ] ||
        { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none &&
          chmod 0400 "$DIR/munge/munge.key"; }
    # --force: munged refuses some set-ups (e.g. running as root) without it.
    munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
        --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
}

running() {   # running PID: not gone, and not a zombie waiting for init to reap it
    kill -0 "$1" 2>/dev/null && [ "$(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

alive() {   # alive NAME: the daemon of that pid file runs
    local pid
    pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
    [ -n "$pid" ] && running "$pid"
}

node_state() {
    SLURM_CONF=$DIR/slurm.conf sinfo -h -N -o '%t' 2>/dev/null | head -1
}

start() {
    have_slurm || die "Slurm is not installed: run \`$0 install\` (or \`make slurm\`)" 2
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    write_config
    alive munged || start_munge
    alive slurmctld || slurmctld -f "$DIR/slurm.conf"
    alive slurmd || slurmd -f "$DIR/slurm.conf"
    local deadline=$((SECONDS + START_TIMEOUT_S)) state=""
    while [ $SECONDS -lt $deadline ]; do
        state=$(node_state)
        case "$state" in idle|mix|alloc) echo "export SLURM_CONF=$DIR/slurm.conf"; return 0;; esac
        sleep 0.2
    done
    log "the node did not become idle within ${START_TIMEOUT_S}s (state: ${state:-none});" \
        "see $DIR/log/"
    tail -n 5 "$DIR"/log/*.log >&2 || true
    exit 1
}

stop() {
    if alive slurmctld; then   # jobs first: their steps' slurmstepd outlive slurmd
        SLURM_CONF=$DIR/slurm.conf scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        local deadline=$((SECONDS + 15))
        while [ $SECONDS -lt $deadline ] &&
              [ -n "$(SLURM_CONF=$DIR/slurm.conf squeue -h -o %i 2>/dev/null)" ]; do
            sleep 0.2
        done
    fi
    local name pid
    for name in "${DAEMONS[@]}"; do
        alive "$name" || continue
        pid=$(cat "$DIR/$name.pid")
        kill -TERM "$pid" 2>/dev/null || true
        local deadline=$((SECONDS + 10))
        while running "$pid" && [ $SECONDS -lt $deadline ]; do sleep 0.1; done
        running "$pid" && kill -KILL "$pid" 2>/dev/null || true
        rm -f "$DIR/$name.pid"
    done
}

case "$ACTION" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) [ "$(node_state)" != "" ] && [ "$(node_state)" != "down" ] ;;
    env) echo "export SLURM_CONF=$DIR/slurm.conf" ;;
    *) die "usage: $0 install|start|stop|status|env [DIR]" 64 ;;
esac
