"""Probe throughput: how many step and layer events a second the in-process
probe absorbs, and from what event rate its cost passes 1% of a core, or 1%
of a step.

Three levels, in this process: the Recorder alone (probe/recorder.py: what
every hook ends in), the PyTorch hooks as the probe installs them (measured on
a model of ten tiny layers whose compute is next to nothing, interleaved with
no hooks and with torch.profiler, so that microseconds stand out of the
noise; then again with the caches swept between the step's phases, as a real
model leaves them), and the probe thread's answer to one poll (a snapshot of 513 layers,
encoded), and CUPTI activity records decoded and aggregated in bulk.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks import cupti_decode
from benchmarks.common import (
    Column,
    HostBusy,
    Option,
    Progress,
    Result,
    Table,
    TargetCheck,
    free_port,
    load_average,
    median_interval,
    positive_int,
    spread,
)
from benchmarks.probe_hooks import (
    HOOK_CONFIGS,
    SWEEP_BYTES,
    TINY_LAYERS,
    hook_costs,
    swept_split_costs,
)

NAME = "probe"
TITLE = "Probe throughput"
SUMMARY = ("step and layer events per second the probe absorbs (Recorder, PyTorch hooks), "
           "its cost per poll, and the event rate at which it passes 1% of a core or a step")
TARGETS = ("derived: the event rates at which the probe passes 1% of a core and 1% of a "
           "step; >= 10x cheaper than torch.profiler per step on the same layers")
STEP_TIMES = (0.001, 0.01, 0.1)  # seconds per step, for the "1% of a step" table
PROFILER_FACTOR = 10.0
SPLIT_STEP_SECONDS = 0.005  # the split's target: at most 0.5% of a step this long
SPLIT_SHARE = 0.005
MEASURES = ("dlprof_agent/probe", "benchmarks/probe_throughput.py", "benchmarks/probe_hooks.py",
            "benchmarks/cupti_decode.py")

OPTIONS = (
    Option("--calls", 200_000, 5_000, "Recorder calls per timing", positive_int, "N"),
    Option("--repeats", 7, 2, "timings per Recorder method (the median is kept)",
           positive_int, "N"),
    Option("--rounds", 30, 3, "interleaved rounds of the hook measurement", positive_int,
           "N"),
    Option("--round-steps", 200, 30, "steps per configuration per round", positive_int, "N"),
    Option("--polls", 200, 10, "snapshots timed for the per-poll cost", positive_int, "N"),
)


def _per_call(function: Callable[[], None], calls: int, repeats: int) -> float:
    """CPU seconds per call of ``function`` (a Python loop iteration included)."""
    timings = []
    for _ in range(repeats):
        started = time.thread_time()
        for _ in range(calls):
            function()
        timings.append((time.thread_time() - started) / calls)
    return statistics.median(timings)


def recorder_costs(calls: int, repeats: int) -> dict[str, float]:
    from dlprof_agent.probe.recorder import Recorder

    recorder = Recorder(warmup_steps=0)
    recorder.step_boundary("optimizer")
    names = [f"model.layer{i}" for i in range(64)]
    cycle = iter(range(1 << 62))

    def step() -> None:
        recorder.step_boundary("optimizer")

    def layer() -> None:
        recorder.add_layer_time(names[next(cycle) & 63], "forward", 1e-4)

    def nothing() -> None:
        pass

    return {"step_boundary": _per_call(step, calls, repeats),
            "add_layer_time": _per_call(layer, calls, repeats),
            "empty_call": _per_call(nothing, calls, repeats)}


def exchange_costs(calls: int, repeats: int) -> dict[str, float]:
    """CPU seconds a timed collective adds to the caller (probe/torch_exchange.py):
    ``torch.distributed.all_reduce`` of one number in a gloo group of one rank,
    through the probe's wrapper and straight, interleaved."""
    import torch
    import torch.distributed as dist

    from dlprof_agent.probe.recorder import Recorder
    from dlprof_agent.probe.torch_exchange import CollectiveTiming

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        tensor = torch.zeros(1)
        original = dist.all_reduce
        timing = CollectiveTiming(Recorder(warmup_steps=0))
        timing.install(torch)
        try:
            wrapped = dist.all_reduce
            straight, timed = [], []
            for _ in range(repeats):
                straight.append(_per_call(lambda: original(tensor), calls, 1))
                timed.append(_per_call(lambda: wrapped(tensor), calls, 1))
        finally:
            timing.remove()
    finally:
        dist.destroy_process_group()
    return {"collective_call": statistics.median(straight),
            "collective_timing": statistics.median(timed) - statistics.median(straight)}


def poll_costs(polls: int) -> dict[str, float]:
    """The probe thread's work for one agent poll with 513 layer names, and the
    agent's work to decode it."""
    import json

    from dlprof_agent.probe.protocol import HEADER, encode
    from dlprof_agent.probe.recorder import DEFAULT_MAX_LAYERS, Recorder
    from dlprof_agent.probe_link.samples import ProbeSample

    recorder = Recorder(warmup_steps=0)
    for step in range(20):
        recorder.step_boundary("optimizer", now=step * 0.01)
    for index in range(DEFAULT_MAX_LAYERS + 10):  # past the cap: "other" appears
        recorder.add_layer_time(f"model.blocks.{index}.conv", "forward", 1e-4)
        recorder.add_layer_time(f"model.blocks.{index}.conv", "backward", 2e-4)
    settings = {"torch": {"framework": "pytorch", "framework_version": "2.13.0"}}

    def answer() -> bytes:
        return encode({"ok": True, "probe": recorder.snapshot(), "settings": settings,
                       "dropped": {}})

    frame = answer()

    def decode() -> Any:
        return ProbeSample.from_reply(1, json.loads(frame[HEADER.size:]))

    answer_times, decode_times = [], []
    for _ in range(polls):
        started = time.thread_time()
        answer()
        answer_times.append(time.thread_time() - started)
        started = time.thread_time()
        decode()
        decode_times.append(time.thread_time() - started)
    return {"probe_answer": statistics.median(answer_times),
            "agent_decode": statistics.median(decode_times), "frame_bytes": float(len(frame)),
            "layers": float(len(recorder.layers))}


def run(settings: dict[str, Any]) -> Result:
    result = Result(NAME, TITLE, __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
                    settings["smoke"], settings)
    rounds = int(settings["rounds"])
    progress = Progress(NAME, 2 + 2 * min(rounds, 6))
    busy = HostBusy()
    load_start = load_average()
    busy.start()
    recorder = recorder_costs(int(settings["calls"]), int(settings["repeats"]))
    progress.advance(f"Recorder: step_boundary {recorder['step_boundary'] * 1e9:.0f} ns, "
                     f"add_layer_time {recorder['add_layer_time'] * 1e9:.0f} ns")
    hooks = hook_costs(rounds, int(settings["round_steps"]), progress)
    swept = swept_split_costs(rounds, int(settings["round_steps"]), progress)
    exchange = exchange_costs(max(20, int(settings["calls"]) // 100), int(settings["repeats"]))
    polls = poll_costs(int(settings["polls"]))
    busy.stop()
    progress.advance(f"poll: answer {polls['probe_answer'] * 1e3:.2f} ms")
    load_end = load_average()

    # Hook costs are differences of wall times: on a noisy machine one can come out
    # at or below zero, which means "below the noise", not free.
    step_cost = statistics.median(hooks["steps"])
    layers_cost = statistics.median(hooks["layers"])
    layer_cost = (layers_cost - max(step_cost, 0.0)) / TINY_LAYERS  # forward + backward
    event_cost = layer_cost / 2  # a layer call is two events: its forward and its backward
    # A record is decoded once and aggregated once: its cost is the two together.
    decode_rate, aggregate_rate = cupti_decode.measure(
        "continuous", 50_000 if settings["smoke"] else 1_000_000)
    cupti_cost = 1 / decode_rate + 1 / aggregate_rate
    profiler_cost = statistics.median(hooks["torch.profiler"])

    events = Table("events", "Events absorbed: cost per event and the rates at which the "
                   "probe passes 1% of a core", [
                       Column("event", "event"), Column("level", "measured at"),
                       Column("cost", "CPU per event", "ns"),
                       Column("per_core", "events/s one core absorbs", "rate"),
                       Column("one_percent", "rate at 1% of a core", "rate")])
    rows: list[tuple[str, str, float | None]] = [
        ("step boundary", "Recorder.step_boundary (CPU time)", recorder["step_boundary"]),
        ("layer time", "Recorder.add_layer_time (CPU time)", recorder["add_layer_time"]),
        ("(an empty Python call)", "the loop's own cost, included above",
         recorder["empty_call"]),
        ("training step", "PyTorch hooks, step timing (wall, over no hooks)", step_cost),
        ("layer event (forward or backward)", "PyTorch hooks, --layers (wall, over step "
         "timing)", event_cost),
        ("collective call timed as exchange", "the torch.distributed wrapper, over "
         f"all_reduce's own {exchange['collective_call'] * 1e6:.0f} µs (CPU time, gloo, "
         "one rank)", exchange["collective_timing"]),
        ("CUPTI record (decode + aggregate)", "synthetic activity buffers in CUPTI's "
         "record layouts (benchmarks.cupti_decode), wall", cupti_cost),
    ]
    for event, level, cost in rows:
        if cost is not None and cost <= 0:
            events.rows.append({"event": event, "level": level, "cost": "below the noise"})
            continue
        events.rows.append({"event": event, "level": level, "cost": cost,
                            "per_core": 1 / cost if cost else None,
                            "one_percent": 0.01 / cost if cost else None})
    result.tables.append(events)

    share = Table("step_share", "Layers per step at which the probe (step timing + "
                  "--layers) costs 1% or 3% of a step", [
                      Column("step", "step time", "ms"),
                      Column("step_only", "step timing alone", "pct"),
                      Column("layers_1", "layer calls per step at 1%", "int"),
                      Column("layers_3", "at 3%", "int")])
    for seconds in STEP_TIMES:
        step_part = max(step_cost, 0.0)
        share.rows.append({
            "step": seconds, "step_only": step_part / seconds,
            "layers_1": max(0.0, (0.01 * seconds - step_part) / layer_cost)
            if layer_cost > 0 else "no limit seen",
            "layers_3": max(0.0, (0.03 * seconds - step_part) / layer_cost)
            if layer_cost > 0 else "no limit seen"})
    share.notes.append(f"A layer call costs {layer_cost * 1e6:.2f} µs (forward and backward "
                       f"hooks) and a step {step_cost * 1e6:.2f} µs, measured on "
                       f"{TINY_LAYERS} linear layers of 4 units.")
    result.tables.append(share)

    hook_table = Table("hooks", f"PyTorch, {TINY_LAYERS} tiny layers: extra time per "
                       f"step, median of {rounds} interleaved round(s)", [
                           Column("config", "configuration"),
                           Column("per_step", "per step", "us"),
                           Column("min", "min", "us"), Column("max", "max", "us"),
                           Column("per_layer", "per layer call", "us")])
    for config in (*HOOK_CONFIGS, "torch.profiler"):
        cost = statistics.median(hooks[config])
        hook_table.rows.append({
            "config": config, "per_step": cost, "min": min(hooks[config]),
            "max": max(hooks[config]),
            "per_layer": (cost - step_cost) / TINY_LAYERS
            if config in ("layers", "torch.profiler") else None})
    # The split's own cost: step timing with it less without, paired within each round.
    split_cost, split_low, split_high = median_interval(
        [with_split - without for with_split, without in zip(hooks["steps"], hooks["no split"],
                                                             strict=True)])
    hook_table.rows.append({"config": "the split alone (steps less no split, paired)",
                            "per_step": split_cost, "min": split_low, "max": split_high})
    for config in ("no split", "steps"):
        hook_table.rows.append({"config": f"{config}, caches swept between phases",
                                "per_step": statistics.median(swept[config]),
                                "min": min(swept[config]), "max": max(swept[config])})
    cold, cold_low, cold_high = median_interval(
        [with_split - without for with_split, without in zip(swept["steps"], swept["no split"],
                                                             strict=True)])
    hook_table.rows.append({"config": "the split alone, caches swept (paired)",
                            "per_step": cold, "min": cold_low, "max": cold_high})
    hook_table.notes.append(
        f"Caches swept: the same hooks on the same layers, with {SWEEP_BYTES >> 20} MiB read "
        "before the model's forward, after it, in backward and before the optimizer, so "
        "that each hook meets caches a real step's compute has emptied. The hooks' Python "
        "code then runs several times slower than warm, and that is what a training job "
        "pays; the overhead benchmark's figures agree with these rows, not the warm ones.")
    hook_table.notes.append(f"No-hooks step: median {statistics.median(hooks['off']) * 1e6:.1f}"
                            " µs. \"steps\" is what the probe does by default: step timing "
                            "and the step split (forward, backward, optimizer, exchange); "
                            "the split's row gives the 95% bootstrap interval of its "
                            "per-round differences as min and max.")
    result.tables.append(hook_table)

    poll_table = Table("poll", "One agent poll (513 layer names)", [
        Column("side", "side"), Column("cost", "CPU per poll", "ms"),
        Column("at_1s", "share of a core at 1 s", "pct"),
        Column("at_01s", "at 0.1 s", "pct")])
    for side, key in (("probe: snapshot and encode (in the job)", "probe_answer"),
                      ("agent: decode into a ProbeSample", "agent_decode")):
        poll_table.rows.append({"side": side, "cost": polls[key], "at_1s": polls[key],
                                "at_01s": polls[key] / 0.1})
    poll_table.notes.append(f"The answer is {polls['frame_bytes'] / 1024:.0f} KiB.")
    result.tables.append(poll_table)

    ceiling = SPLIT_SHARE * SPLIT_STEP_SECONDS
    result.targets.append(TargetCheck(
        f"the step split, per step, against a {SPLIT_STEP_SECONDS * 1e3:g} ms step, "
        "caches swept as a real step leaves them",
        f"≤ {SPLIT_SHARE:.1%} ({ceiling * 1e6:.0f} µs), the interval's upper end",
        f"{cold * 1e6:.1f} µs (95% interval {cold_low * 1e6:.1f} to "
        f"{cold_high * 1e6:.1f} µs, {cold_high / SPLIT_STEP_SECONDS:.2%} of the step); "
        f"warm: {split_cost * 1e6:.1f} µs [{split_low * 1e6:.1f}, {split_high * 1e6:.1f}]",
        cold_high <= ceiling))
    factor = profiler_cost / layers_cost if layers_cost > 0 else float("inf")
    result.targets.append(TargetCheck(
        "--layers vs torch.profiler, per step on the same layers",
        f"≥ {PROFILER_FACTOR:.0f}x cheaper",
        f"{factor:.1f}x (profiler {profiler_cost * 1e6:.1f} µs, --layers "
        f"{layers_cost * 1e6:.1f} µs per step)" if layers_cost > 0 else
        f"--layers within noise, profiler {profiler_cost * 1e6:.1f} µs per step",
        factor >= PROFILER_FACTOR))
    result.figures.update({
        "recorder.step_boundary_seconds": recorder["step_boundary"],
        "recorder.add_layer_time_seconds": recorder["add_layer_time"],
        "recorder.step_events_per_second_at_1pct": 0.01 / recorder["step_boundary"],
        "recorder.layer_events_per_second_at_1pct": 0.01 / recorder["add_layer_time"],
        "hooks.step_seconds": step_cost, "hooks.layer_call_seconds": layer_cost,
        "hooks.profiler_step_seconds": profiler_cost,
        "hooks.split_seconds": split_cost, "hooks.split_seconds_low": split_low,
        "hooks.split_seconds_high": split_high,
        "hooks.swept_step_seconds": statistics.median(swept["steps"]),
        "hooks.swept_split_seconds": cold, "hooks.swept_split_seconds_low": cold_low,
        "hooks.swept_split_seconds_high": cold_high,
        "exchange.collective_timing_seconds": exchange["collective_timing"],
        "poll.probe_answer_seconds": polls["probe_answer"],
        "poll.agent_decode_seconds": polls["agent_decode"]})
    result.figures.update({"cupti.decode_records_per_second": decode_rate,
                           "cupti.aggregate_records_per_second": aggregate_rate})
    result.notes.append(
        f"CUPTI records: decoded at {decode_rate / 1e6:.1f} M/s and aggregated at "
        f"{aggregate_rate / 1e6:.1f} M/s on one core (target: 2 M/s), on synthetic buffers; "
        "records from a real GPU are still owed (no GPU here).")
    result.notes.append("TensorFlow's hooks are not timed here; the overhead benchmark "
                        "measures them end to end.")
    result.noise = {"no_hooks_step_spread": spread(hooks["off"]),
                    "host_busy_share": busy.shares[0], "load_average_start": load_start[0],
                    "load_average_end": load_end[0]}
    result.noise_summary = (
        f"the no-hooks step of the tiny model spread by {spread(hooks['off']):.1%} across "
        f"rounds (max-min over median); the machine's cores were {busy.shares[0]:.0%} busy "
        f"(this benchmark keeps one busy); load average {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end. Recorder costs are CPU time, which noise inflates "
        "less than wall time.")
    return result
