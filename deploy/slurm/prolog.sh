#!/usr/bin/env bash
# SLURM prolog: starts one dlprof-agent for this job on this node, and tells
# Prometheus where it is with a file_sd target file. epilog.sh stops it.
#
# slurmd runs this as root on every node of the job (with PrologFlags=Alloc, at
# allocation; otherwise at the job's first step on the node). It never fails
# the job: whatever goes wrong is logged and it exits 0.
#
# Settings, from the environment or from $DLPROF_SLURM_CONF (a shell file,
# default /etc/dlprof-agent/slurm.conf; epilog.sh reads the same one):
#   DLPROF_AGENT        the agent's executable (default: dlprof-agent on PATH)
#   DLPROF_AGENT_ARGS   extra options for `dlprof-agent daemon`, split at spaces
#   DLPROF_MATCH        --match regex for the job's processes (default python;
#                       empty: GPU processes and probes only)
#   DLPROF_PORT_BASE    first port of the agents' range (default 9950)
#   DLPROF_PORT_COUNT   size of that range (default 50): jobs sharing a node
#                       need one port each
#   DLPROF_LISTEN       address to serve on (default 0.0.0.0)
#   DLPROF_TARGET_HOST  this node's name as Prometheus reaches it (default
#                       hostname -f)
#   DLPROF_TARGETS_DIR  where file_sd target files go (default
#                       /etc/prometheus/targets); a shared file system
#                       lets one Prometheus find every node's jobs
#   DLPROF_STATE_DIR    pid and log files (default /run/dlprof-agent/slurm)
#   DLPROF_START_WAIT   seconds to wait for the agent to listen (default 3)

set -u
# Whatever happens below, the job goes ahead.
trap 'exit 0' EXIT

log() {
    printf 'dlprof-agent prolog: job %s: %s\n' "${SLURM_JOB_ID:-?}" "$*" >&2
    logger -t dlprof-agent-slurm -- "prolog: job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true
}

conf="${DLPROF_SLURM_CONF:-/etc/dlprof-agent/slurm.conf}"
if [ -r "$conf" ]; then
    # shellcheck source=/dev/null
    . "$conf" || log "could not read $conf; using defaults"
fi

job="${SLURM_JOB_ID:-}"
case "$job" in
    '' | *[!0-9]*) log "no numeric SLURM_JOB_ID; not starting an agent"; exit 0 ;;
esac

agent="${DLPROF_AGENT:-$(command -v dlprof-agent || true)}"
if [ -z "$agent" ] || [ ! -x "$agent" ]; then
    log "dlprof-agent is not installed (set DLPROF_AGENT); the job runs unmeasured"
    exit 0
fi

state_dir="${DLPROF_STATE_DIR:-/run/dlprof-agent/slurm}"
targets_dir="${DLPROF_TARGETS_DIR:-/etc/prometheus/targets}"
port_base="${DLPROF_PORT_BASE:-9950}"
port_count="${DLPROF_PORT_COUNT:-50}"
listen="${DLPROF_LISTEN:-0.0.0.0}"
match="${DLPROF_MATCH-python}"
start_wait="${DLPROF_START_WAIT:-3}"
host="${DLPROF_TARGET_HOST:-$(hostname -f 2>/dev/null || hostname 2>/dev/null || true)}"
node="${SLURMD_NODENAME:-$host}"
user="${SLURM_JOB_USER:-}"

if ! mkdir -p "$state_dir" "$targets_dir"; then
    log "cannot create $state_dir or $targets_dir; not starting an agent"
    exit 0
fi
pid_file="$state_dir/job-$job.pid"
port_file="$state_dir/job-$job.port"
log_file="$state_dir/job-$job.log"
target_file="$targets_dir/$node-job-$job.json"
# The target file's name, for the epilog: settings may have changed by then.
target_record="$state_dir/job-$job.target"

ours() {  # is pid $1 this job's agent (and not a recycled pid)?
    tr '\0' ' ' < "/proc/$1/cmdline" 2>/dev/null | grep -q -- "SLURM_JOB_ID=$job "
}

if [ -s "$pid_file" ] && ours "$(cat "$pid_file")"; then
    log "an agent for this job is already running (pid $(cat "$pid_file"))"
    exit 0
fi

listening() {  # is something accepting connections on port $1?
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

taken_by_a_job() {  # another job's agent has port $1, even if not listening yet
    local file
    for file in "$state_dir"/job-*.port; do
        if [ "$file" != "$port_file" ] && [ "$(cat "$file" 2>/dev/null)" = "$1" ]; then
            return 0
        fi
    done
    return 1
}

# shellcheck disable=SC2206 # extra options are words, as on a command line
extra=(${DLPROF_AGENT_ARGS:-})
if [ -n "$match" ]; then
    extra=(--match "$match" ${extra[@]+"${extra[@]}"})
fi

start() {  # start the agent on port $1; its pid in $pid
    # --node-name: the series' node (dlprof_target_info) is the target file's
    # slurm_node, and their job_id is SLURM_JOB_ID, the target's slurm_job_id.
    local command=("$agent" daemon --listen "$listen" --port "$1" --quiet
                   --env "SLURM_JOB_ID=$job" --node-name "$node" ${extra[@]+"${extra[@]}"})
    # setsid: a session of its own, so that slurmd's cleanup of the prolog's
    # process group leaves it running. Its output goes to a file, never to the
    # prolog's, which slurmd may be reading.
    if command -v setsid >/dev/null; then
        setsid "${command[@]}" < /dev/null >> "$log_file" 2>&1 &
    else
        "${command[@]}" < /dev/null >> "$log_file" 2>&1 &
    fi
    pid=$!
}

started() {  # wait until pid $1 listens on port $2; false if it exits first
    local deadline=$((SECONDS + ${start_wait%.*}))
    until listening "$2"; do
        kill -0 "$1" 2>/dev/null || return 1
        [ "$SECONDS" -ge "$deadline" ] && return 0  # slow, but alive
        sleep 0.1
    done
}

# The port follows from the job id, so it is the same on every node of the job;
# when another job has it, the next free one in the range. A port some other
# program holds on another address shows only when the agent fails on it:
# three tries.
port=""
pid=""
tries=0
for ((i = 0; i < port_count && tries < 3; i++)); do
    candidate=$((port_base + (job + i) % port_count))
    if taken_by_a_job "$candidate" || listening "$candidate"; then
        continue
    fi
    printf '%s\n' "$candidate" > "$port_file"
    start "$candidate"
    printf '%s\n' "$pid" > "$pid_file"
    if started "$pid" "$candidate"; then
        port="$candidate"
        break
    fi
    tries=$((tries + 1))
    log "the agent exited at start on port $candidate: $(tail -n 1 "$log_file" 2>/dev/null)"
done
if [ -z "$port" ]; then
    rm -f "$pid_file" "$port_file"
    log "no agent started (ports $port_base-$((port_base + port_count - 1))); see $log_file"
    exit 0
fi

json_string() {  # $1 as a JSON string
    local s="${1//\\/\\\\}"
    s="${s//\"/\\\"}"
    printf '"%s"' "$s"
}

# Written beside the final name and renamed: Prometheus never reads half a file.
# The labels are slurm_*: a target label named job_id or node would clash with
# the series' own (Prometheus renames those exported_*), and these agree with
# them: slurm_job_id is the job_id of the job's ranks (unless DLPROF_JOB_ID names
# the job otherwise), slurm_node the node of dlprof_target_info.
tmp="$targets_dir/.$node-job-$job.json.tmp"
if {
    printf '[{"targets": [%s], "labels": {' "$(json_string "$host:$port")"
    printf '"slurm_job_id": %s, ' "$(json_string "$job")"
    printf '"slurm_job_user": %s, ' "$(json_string "$user")"
    printf '"slurm_partition": %s, ' "$(json_string "${SLURM_JOB_PARTITION:-}")"
    printf '"slurm_node": %s}}]\n' "$(json_string "$node")"
} > "$tmp" && chmod 0644 "$tmp" && mv -f "$tmp" "$target_file"; then
    printf '%s\n' "$target_file" > "$target_record"
    log "agent pid $pid serving $host:$port; target file $target_file"
else
    rm -f "$tmp"
    log "agent pid $pid serving $host:$port, but $target_file could not be written"
fi
exit 0
