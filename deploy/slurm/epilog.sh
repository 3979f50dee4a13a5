#!/usr/bin/env bash
# SLURM epilog: stops the dlprof-agent that prolog.sh started for this job on
# this node, and removes its Prometheus target file. Runs as root on every node
# of the job after it ends, and never fails: it logs and exits 0.
#
# Reads the same settings as prolog.sh (DLPROF_SLURM_CONF, DLPROF_STATE_DIR,
# DLPROF_TARGETS_DIR, DLPROF_TARGET_HOST), plus:
#   DLPROF_STOP_WAIT    seconds between SIGTERM and SIGKILL (default 10)

set -u
# Whatever happens below, the node is not drained for it.
trap 'exit 0' EXIT

log() {
    printf 'dlprof-agent epilog: job %s: %s\n' "${SLURM_JOB_ID:-?}" "$*" >&2
    logger -t dlprof-agent-slurm -- "epilog: job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true
}

conf="${DLPROF_SLURM_CONF:-/etc/dlprof-agent/slurm.conf}"
if [ -r "$conf" ]; then
    # shellcheck source=/dev/null
    . "$conf" || log "could not read $conf; using defaults"
fi

job="${SLURM_JOB_ID:-}"
case "$job" in
    '' | *[!0-9]*) log "no numeric SLURM_JOB_ID; nothing to stop"; exit 0 ;;
esac

state_dir="${DLPROF_STATE_DIR:-/run/dlprof-agent/slurm}"
targets_dir="${DLPROF_TARGETS_DIR:-/etc/prometheus/targets}"
stop_wait="${DLPROF_STOP_WAIT:-10}"
host="${DLPROF_TARGET_HOST:-$(hostname -f 2>/dev/null || hostname 2>/dev/null || true)}"
node="${SLURMD_NODENAME:-$host}"
pid_file="$state_dir/job-$job.pid"
port_file="$state_dir/job-$job.port"
log_file="$state_dir/job-$job.log"
target_record="$state_dir/job-$job.target"

# First, so that Prometheus stops scraping before the agent goes away. The
# prolog recorded the name it used; the default name is the fallback.
recorded="$(cat "$target_record" 2>/dev/null || true)"
rm -f "$targets_dir/$node-job-$job.json" ${recorded:+"$recorded"}

ours() {  # is pid $1 this job's agent (and not a recycled pid)?
    tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null | grep -q -- "SLURM_JOB_ID=$job "
}

running() {  # alive and not a zombie waiting for its parent
    local state
    state="$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null)"
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

pid="$(cat "$pid_file" 2>/dev/null || true)"
case "$pid" in
    '' | *[!0-9]*) ;;  # no agent was started for this job here
    *)
        if running "$pid" && ours "$pid"; then
            kill -TERM "$pid" 2>/dev/null
            # The agent detaches from the job's probes on SIGTERM; give it time.
            deadline=$((SECONDS + ${stop_wait%.*}))
            while running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
                sleep 0.1
            done
            if running "$pid"; then
                log "agent pid $pid did not stop in ${stop_wait}s; killing it"
                kill -KILL "$pid" 2>/dev/null
                # SIGKILL is delivered asynchronously: see it gone before going on.
                for _ in 1 2 3 4 5 6 7 8 9 10; do
                    running "$pid" || break
                    sleep 0.1
                done
            fi
        fi
        ;;
esac

# What the agent said (with --quiet, only warnings) goes to syslog with the job.
if [ -s "$log_file" ]; then
    while IFS= read -r line; do
        log "agent: $line"
    done < <(tail -n 5 "$log_file")
fi
rm -f "$pid_file" "$port_file" "$log_file" "$target_record"
exit 0
