#!/bin/sh
# SLURM TaskProlog: every task of every step starts with DLPROF_PROBE=1, so its
# Python processes start the in-process probe asleep at launch and the node's
# agent reads them without injecting (dlprof-agent daemon --no-inject). What a
# TaskProlog prints as "export NAME=VALUE" joins the task's environment.
# A job that sets DLPROF_PROBE itself (0 turns it off) keeps its own value.
# DLPROF_PROBE_PATH, if set here or in the job, is a folder made by
# `dlprof-agent probe-copy` that goes on PYTHONPATH, for environments without
# the package. It never fails a task.

if [ -z "${DLPROF_PROBE+set}" ]; then
    echo "export DLPROF_PROBE=1"
fi
if [ -n "${DLPROF_PROBE_PATH:-}" ] && [ -d "${DLPROF_PROBE_PATH}" ]; then
    echo "export PYTHONPATH=${DLPROF_PROBE_PATH}${PYTHONPATH:+:${PYTHONPATH}}"
fi
exit 0
