"""The job dashboard: one data-parallel job across its nodes, picked by `job_id`:
throughput, each rank's own time, exchange wait and input per step, the stragglers
with their cause, exchange share and scaling efficiency.

Its queries read the job's recording rules and alerts of deploy/prometheus/rules.yml
(exporters/prometheus_rules.py, `dlprof-agent rules`), which aggregate the series
that carry `job_id` and `rank` (docs/fleet.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import table
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.models import dashboard as dashboard_models

from dlprof_agent.exporters.prometheus_rules import (
    JOB_EXCHANGE_SHARE,
    JOB_OWN_MEDIAN,
    JOB_RANKS_UP,
    JOB_SAMPLES_RATE,
    JOB_SCALING_EFFICIENCY,
    JOB_STEP_SKEW,
    JOB_WORLD_SIZE,
    MISSING_RANKS_ALERT,
    RANK_OWN_ABOVE_MEDIAN,
    RANK_OWN_MEAN,
    RANK_PHASE_MEAN,
    RANK_STEP_MEAN,
    RANK_STEPS_RATE,
    RANK_STRAGGLER_CAUSE,
    STRAGGLER_ALERT,
    STRAGGLER_FLOOR_SECONDS,
    STRAGGLER_STEP_SHARE,
)
from dlprof_agent.grafana.panels import (
    DATASOURCE,
    NEUTRAL,
    Panel,
    Query,
    Steps,
    dashboard,
    stat_panel,
    targets,
    thresholds,
    time_series,
)

# The metrics of the job's identity (docs/fleet-identity.md) that these queries read
# beside the rules: the variable's values come from the info metric.
IDENTITY_METRICS: dict[str, tuple[str, ...]] = {
    "dlprof_target_info": ("pid", "job_id", "rank", "local_rank", "node_rank", "world_size",
                           "restart_count", "node", "role", "pod_uid", "container_id", "pod",
                           "namespace"),
    "dlprof_target_world_size": ("pid", "job_id", "rank"),
}

JOB_ID = 'job_id="$job_id"'
RANK = "rank {{rank}}"
SKEW_AMBER = 1.2  # the slowest rank's own time a fifth above the median's
SKEW: Steps = ((None, "green"), (SKEW_AMBER, "orange"), (1.5, "red"))
EXCHANGE: Steps = ((None, "green"), (0.2, "orange"), (0.4, "red"))
EFFICIENCY: Steps = ((None, "red"), (0.5, "orange"), (0.8, "green"))
MISSING: Steps = ((None, "red"), (1.0, "green"))


def _phase(phase: str) -> str:
    return f'{RANK_PHASE_MEAN}{{{JOB_ID},phase="{phase}"}}'


def _table(title: str, description: str, unit: str, queries: Sequence[Query], *,
           names: dict[str, str], hidden: Sequence[str], height: int = 8) -> table.Panel:
    """One row per series of instant queries, merged on their labels; `names` renames
    the columns (a query's value is `Value #<refId>`, or `Value` alone)."""
    merge = dashboard_models.DataTransformerConfig(id_val="merge", options={})
    organize = dashboard_models.DataTransformerConfig(
        id_val="organize", options={"excludeByName": dict.fromkeys(hidden, True),
                                    "renameByName": names})
    return (table.Panel().title(title).description(description).unit(unit)
            .datasource(DATASOURCE).targets(targets(queries, instant=True))
            .span(24).height(height).thresholds(thresholds(NEUTRAL)).show_header(True)
            .with_transformation(merge).with_transformation(organize))


def _job() -> list[Panel]:
    return [
        stat_panel("Throughput", "Samples per second over all the job's ranks, in steady "
                   "state. Compare runs on more nodes: linear scaling multiplies it by the "
                   "ratio of ranks.", "short", f"sum({JOB_SAMPLES_RATE}{{{JOB_ID}}})",
                   legend="samples/s"),
        stat_panel("Ranks up", "Share of the world size whose process is up. Under 100% "
                   f"(red) a node, its agent or a rank is gone: {MISSING_RANKS_ALERT}.",
                   "percentunit",
                   f"{JOB_RANKS_UP}{{{JOB_ID}}} / {JOB_WORLD_SIZE}{{{JOB_ID}}}",
                   steps=MISSING, legend="ranks up"),
        stat_panel("World size", "Ranks the job was started with, as its ranks report it "
                   "(WORLD_SIZE, SLURM_NTASKS, TF_CONFIG).", "short",
                   f"{JOB_WORLD_SIZE}{{{JOB_ID}}}"),
        stat_panel("Step skew", "The slowest rank's own time per step over the median rank's; "
                   "1 is balanced. Amber from the straggler threshold: see the stragglers "
                   "below.", "short", f"{JOB_STEP_SKEW}{{{JOB_ID}}}", steps=SKEW),
        stat_panel("Exchange share", "Share of the ranks' step time spent waiting in "
                   "collectives: for the slowest rank, and for the exchange itself. High with "
                   "low skew: the collectives are slow.", "percentunit",
                   f"{JOB_EXCHANGE_SHARE}{{{JOB_ID}}}", steps=EXCHANGE),
        stat_panel("Scaling efficiency", "Share of each step the median rank spends on its own "
                   "work (an estimate: median own time over step time). Below 50% (red) "
                   "more ranks add little.", "percentunit",
                   f"{JOB_SCALING_EFFICIENCY}{{{JOB_ID}}}", steps=EFFICIENCY),
    ]


def _throughput() -> list[Panel]:
    return [
        time_series("Throughput", "Samples per second over all ranks. Drops line up with "
                    "stragglers, restarts (a rank missing) or a stall.", "short",
                    [(f"{JOB_SAMPLES_RATE}{{{JOB_ID}}}", "samples/s")], width=8),
        time_series("Steps per second by rank", "Steady steps each rank ends per second. In "
                    "a synchronous job every rank steps together; one apart is out of step or "
                    "restarting.", "short", [(f"{RANK_STEPS_RATE}{{{JOB_ID}}}", RANK)], width=8),
        time_series("Step time by rank", "Mean step time per rank. In a synchronous job every "
                    "rank takes as long as the slowest, so this does not find the slow rank: "
                    "its own time does.", "s", [(f"{RANK_STEP_MEAN}{{{JOB_ID}}}", RANK)],
                    width=8),
    ]


def _ranks() -> list[Panel]:
    names = {"rank": "rank", "Value #A": "own time", "Value #B": "above median",
             "Value #C": "exchange wait", "Value #D": "input", "Value #E": "step time"}
    return [
        _table("Ranks: own time, exchange wait and input per step",
               "Per rank, per step: own time (step time less the wait in collectives), how "
               "far it is above the job's median, the wait in collectives, the input "
               "(outside the model's steps) and the step time. The straggler has the largest "
               "own time and the smallest wait; its largest column above the median is why.",
               "s",
               # By rank alone: the merge joins rows on the labels the frames share.
               [(f"sum by (rank) ({expr})", "") for expr in (
                   f"{RANK_OWN_MEAN}{{{JOB_ID}}}", f"{RANK_OWN_ABOVE_MEDIAN}{{{JOB_ID}}}",
                   _phase("exchange"), _phase("other"), f"{RANK_STEP_MEAN}{{{JOB_ID}}}")],
               names=names, hidden=("Time",)),
        time_series("Own time per step by rank", "Step time less the wait in collectives, "
                    "per rank, with the job's median. A rank above the median by "
                    f"{STRAGGLER_STEP_SHARE:.0%} of the median step time (and "
                    f"{STRAGGLER_FLOOR_SECONDS * 1000:g} ms) is a straggler.", "s",
                    [(f"{RANK_OWN_MEAN}{{{JOB_ID}}}", RANK),
                     (f"{JOB_OWN_MEDIAN}{{{JOB_ID}}}", "median")]),
        time_series("Exchange wait per step by rank", "Time each rank waits in collectives "
                    "per step. The fast ranks wait for the slow one here: a rank that waits "
                    "is not a straggler.", "s", [(_phase("exchange"), RANK)]),
        time_series("Input per step by rank", "Time each rank spends outside the model's "
                    "forward, backward and optimizer per step: loading input, the loss, "
                    "Python. One rank above the rest is starved of data.", "s",
                    [(_phase("other"), RANK)]),
    ]


def _stragglers() -> list[Panel]:
    alerts = f'ALERTS{{alertname="{STRAGGLER_ALERT}",{JOB_ID}}}'
    return [
        _table("Stragglers and their cause",
               f"The {STRAGGLER_ALERT} alerts of this job: the rank, the cause its own signals "
               "name (input, cpu_starved, gpu_throttled, memory_pressure, compute, unknown) "
               "and whether it is pending or firing. docs/fleet.md says what to do for each.",
               "string", [(alerts, "")], names={"alertstate": "state"},
               hidden=("Time", "__name__", "alertname", "job_id", "severity", "Value"),
               height=6),
        time_series("Straggler excess by cause", "Seconds per step each straggler's own time "
                    "is above the job's median, labelled with its cause; before the alert's "
                    "`for` has passed too.", "s",
                    [(f"{RANK_STRAGGLER_CAUSE}{{{JOB_ID}}}", "rank {{rank}}: {{cause}}")],
                    width=12),
        time_series("Own time above the median by rank", "How far each rank's own time per "
                    "step is above the job's median; below zero for the faster half. The "
                    "line far above the others is the straggler.", "s",
                    [(f"{RANK_OWN_ABOVE_MEDIAN}{{{JOB_ID}}}", RANK)], width=12),
    ]


def _exchange() -> list[Panel]:
    return [
        time_series("Exchange share", "Share of the ranks' step time in collectives. Rising "
                    "with skew: a straggler. Rising alone: slower collectives (network, a "
                    "larger model, smaller batches per rank).", "percentunit",
                    [(f"{JOB_EXCHANGE_SHARE}{{{JOB_ID}}}", "exchange")], steps=EXCHANGE),
        time_series("Scaling efficiency", "Median own time over step time: the share of each "
                    "step doing the rank's own work. Compare runs on 1, 2, 4 nodes: where it "
                    "falls, more nodes pay less.", "percentunit",
                    [(f"{JOB_SCALING_EFFICIENCY}{{{JOB_ID}}}", "efficiency")],
                    steps=EFFICIENCY),
        time_series("Step skew", "The slowest rank's own time over the median's. Above "
                    f"{SKEW_AMBER:g} (amber) the slowest rank holds the job back.",
                    "short", [(f"{JOB_STEP_SKEW}{{{JOB_ID}}}", "skew")], steps=SKEW),
        _table("Alerts of this job", "Every dlprof alert carrying this job_id, pending or "
               "firing: stragglers, a slow exchange, a stall, missing ranks, a probe down. "
               "docs/fleet.md explains each.", "string",
               [(f'ALERTS{{{JOB_ID},alertname=~"Dlprof.*"}}', "")],
               names={"alertstate": "state"}, hidden=("Time", "__name__", "job_id", "Value"),
               height=6),
    ]


def _variables() -> list[Builder[dashboard_models.VariableModel]]:
    return [
        dashboard_builders.DatasourceVariable("datasource").id("datasource")
        .label("Data source").type("prometheus"),
        dashboard_builders.QueryVariable("job_id").id("job_id").label("Job")
        .query('label_values(dlprof_target_info{job_id!=""}, job_id)').datasource(DATASOURCE)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC),
    ]


def build_job() -> dict[str, Any]:
    """One job across its nodes, by job_id, as a JSON model."""
    return dashboard(
        "dlprof-job", "dlprof-agent: job",
        "One data-parallel job across its nodes: throughput, each rank's own time, "
        "exchange wait and input per step, the stragglers with their cause, exchange share "
        "and scaling efficiency. Needs the rules of deploy/prometheus/rules.yml.",
        [("Job", _job()), ("Throughput", _throughput()), ("Ranks", _ranks()),
         ("Stragglers", _stragglers()), ("Exchange and scaling", _exchange())],
        gpu=False, variables=_variables())
