"""A small CNN trained on synthetic data, timing its own steps, for the probe's
tests: each step's end time is appended to --log, so a test can compare what
the probe reports with what the job itself measured."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from dlprof_agent.workloads.torch_models import small_cnn


def hooks_left(model: nn.Module) -> int:
    """Hooks anyone installed on the model, on all modules, or on all optimizers,
    and torch.distributed functions replaced (they are distributed_c10d's)."""
    import torch.distributed as dist
    from torch.nn.modules import module
    from torch.optim import optimizer

    on_model = sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                   + len(m._backward_hooks) for m in model.modules())
    c10d = dist.distributed_c10d if dist.is_available() else None
    replaced = 0 if c10d is None else sum(
        getattr(dist, name, None) is not getattr(c10d, name) for name in c10d.__all__)
    return (on_model + len(module._global_forward_pre_hooks)
            + len(module._global_forward_hooks) + len(optimizer._global_optimizer_pre_hooks)
            + len(optimizer._global_optimizer_post_hooks) + replaced)


class ProbeCallCounter:
    """Counts calls into the probe's code made on this thread (sys.setprofile):
    what a detached probe must no longer add to a step."""

    def __init__(self) -> None:
        import dlprof_agent.probe

        self.calls = 0
        self._probe_folder = os.path.dirname(dlprof_agent.probe.__file__) + os.sep

    def __call__(self, frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(self._probe_folder):
            self.calls += 1


def tracer_state() -> str:
    """The probe's kernel tracer state, read in the job (a test's view from inside)."""
    from dlprof_agent.probe import runtime

    probe = runtime.current()
    session = getattr(probe, "session", None)
    return str(session.tracer.state) if session is not None else "no session"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--loop", choices=("optimizer", "manual-sgd"), default="optimizer")
    parser.add_argument("--enable-probe", action="store_true")
    parser.add_argument("--fake-cupti", action="store_true",
                        help="the probe traces a simulated GPU (tests.fake_cupti)")
    parser.add_argument("--log", required=True)
    parser.add_argument("--until", metavar="FILE",
                        help="stop after the step during which FILE appears")
    parser.add_argument("--linger", type=float, default=0.0,
                        help="seconds to stay alive after the last step")
    parser.add_argument("--count-probe-calls", type=int, default=0, metavar="STEPS",
                        help="after --until appears, run STEPS more steps counting calls "
                             "into the probe's code on the job's thread, and log the count")
    parser.add_argument("--profile-when", metavar="FILE",
                        help="once FILE appears, run torch.profiler over the next steps")
    parser.add_argument("--profile-seconds", type=float, default=2.0,
                        help="how long that torch.profiler session lasts")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if args.fake_cupti:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))
        from tests.fake_cupti import install_simulated_gpu

        install_simulated_gpu()
    if args.enable_probe:
        import dlprof_agent.probe

        dlprof_agent.probe.enable()
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(args.batch, 3, 32, 32)
    labels = torch.randint(0, 10, (args.batch,))
    profiler: Any = None
    profiled_until = 0.0
    with open(args.log, "w") as log:
        log.write(json.dumps({"pid": os.getpid()}) + "\n")
        for step in range(args.steps):
            if profiler is None and args.profile_when and os.path.exists(args.profile_when) \
                    and not profiled_until:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU])
                profiler.__enter__()
                profiled_until = time.perf_counter() + args.profile_seconds
                log.write(json.dumps({"tracer_when_profiling": tracer_state()}) + "\n")
            elif profiler is not None and time.perf_counter() > profiled_until:
                profiler.__exit__(None, None, None)
                log.write(json.dumps({"profiled": len(profiler.events())}) + "\n")
                profiler = None
            output = model(images)
            loss = loss_fn(output, labels)
            if args.loop == "optimizer":
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            else:
                model.zero_grad()
                loss.backward()
                with torch.no_grad():
                    for parameter in model.parameters():
                        if parameter.grad is not None:
                            parameter.sub_(0.01 * parameter.grad)
            log.write(json.dumps({"step": step, "end": time.perf_counter()}) + "\n")
            log.flush()
            if args.until and os.path.exists(args.until):
                break
        if args.count_probe_calls:
            counter = ProbeCallCounter()
            sys.setprofile(counter)
            for _ in range(args.count_probe_calls):
                optimizer.zero_grad()
                loss_fn(model(images), labels).backward()
                optimizer.step()
            sys.setprofile(None)
            log.write(json.dumps({"probe_calls": counter.calls}) + "\n")
        log.write(json.dumps({"done": True, "hooks": hooks_left(model)}) + "\n")
    time.sleep(args.linger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
