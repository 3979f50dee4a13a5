"""A stand-in for ``probe.cupti_binding.CuptiBinding``: the seam where tests hand
the kernel tracer synthetic activity buffers, laid out as CUPTI lays them out
(``tests.cupti_records``), instead of a GPU's."""

from __future__ import annotations

import threading
import time

import numpy as np

from dlprof_agent.probe.cupti_binding import ActivityBuffer, CuptiBusy, CuptiUnavailable
from tests.cupti_records import LAYOUTS, BufferBuilder

CUPTI_MINUS_PERF_NS = 10**12  # the fake CUPTI clock runs this far ahead of perf_counter


class RecordingCorrelator:
    """Remembers every push and pop, per thread, as CUPTI's stacks would."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.failures = 0
        self.calls: list[tuple[str, int]] = []
        self.stacks: dict[int, list[int]] = {}

    def push(self, external_id: int) -> None:
        self.calls.append(("push", external_id))
        self.stacks.setdefault(threading.get_ident(), []).append(external_id)

    def pop(self) -> None:
        self.calls.append(("pop", 0))
        stack = self.stacks.get(threading.get_ident())
        if stack:
            stack.pop()
        else:
            self.failures += 1  # CUPTI would answer CUPTI_ERROR_QUEUE_EMPTY


class FakeBinding:
    """What the tracer asks of CUPTI, answered from queued buffers."""

    def __init__(self, *, version: str = "13.4", refuse: Exception | None = None) -> None:
        self.version = version
        self.refuse = refuse
        self.opened = False
        self.closed = False
        self.abandoned = False
        self._enabled: list[int] = []
        self.queue: list[bytes] = []
        self.dropped = 0
        self.flushes = 0
        self.released = 0
        self.size_questions = 0
        self.correlators: list[RecordingCorrelator] = []
        self.fail_on_take: Exception | None = None
        self._builders: list[BufferBuilder] = []  # their name strings must stay alive

    # The tracer's side.

    def open(self, framework: str = "", framework_cuda: str | None = None) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.opened = True

    @property
    def enabled(self) -> tuple[int, ...]:
        return tuple(self._enabled)

    def enable(self, kinds: list[int]) -> None:
        self._enabled += [kind for kind in kinds if kind not in self._enabled]

    def disable(self, kinds: list[int]) -> None:
        self._enabled = [kind for kind in self._enabled if kind not in kinds]

    def flush(self) -> None:
        self.flushes += 1

    def take_buffers(self) -> list[ActivityBuffer]:
        if self.fail_on_take is not None:
            raise self.fail_on_take
        taken, self.queue = self.queue, []
        # CUPTI's buffers are 8-aligned memory of their own: copy into such.
        return [ActivityBuffer(np.frombuffer(data, dtype=np.uint8).copy(), len(data))
                for data in taken]

    def release(self, buffer: ActivityBuffer) -> None:
        self.released += 1

    def record_size(self, buffer: ActivityBuffer, offset: int) -> int | None:
        """As cuptiActivityGetNextRecord tells it: from the record's kind."""
        self.size_questions += 1
        kind = int(np.frombuffer(buffer.data, dtype=np.int32, count=1,
                                 offset=offset)[0])
        layout = LAYOUTS[self.version].get(kind)
        return None if layout is None else layout.itemsize

    def counters(self) -> dict[str, int]:
        return {"dropped_records": self.dropped}

    def timestamp_ns(self) -> int:
        return time.perf_counter_ns() + CUPTI_MINUS_PERF_NS

    def correlator(self, base: int) -> RecordingCorrelator:
        correlator = RecordingCorrelator(base)
        self.correlators.append(correlator)
        return correlator

    def close(self) -> None:
        self.closed = True

    def abandon(self) -> None:
        self.abandoned = True

    @staticmethod
    def trim() -> None:
        pass

    # The test's side.

    def deliver(self, builder: BufferBuilder) -> None:
        self._builders.append(builder)
        self.queue.append(builder.bytes())


def busy(reason: str = "CUPTI is held by nsys") -> FakeBinding:
    return FakeBinding(refuse=CuptiBusy(reason))


def unavailable(reason: str = "cupti-python not installed in the job's environment"
                ) -> FakeBinding:
    return FakeBinding(refuse=CuptiUnavailable(reason))


def now_on_cupti_clock(perf_seconds: float | None = None) -> int:
    seconds = time.perf_counter() if perf_seconds is None else perf_seconds
    return round(seconds * 1e9) + CUPTI_MINUS_PERF_NS


class SimulatedGpu(FakeBinding):
    """A GPU that runs one kernel for every launch a layer makes, as CUPTI would
    report it: an external correlation record with the layer's id, the launch's
    API record, then the kernel; and copies the batch to the device before the
    first layer's forward. For a real probe in a test job
    (``tests/jobs/torch_cnn.py --fake-cupti``): it needs the layer hooks."""

    KERNEL = "void simulated::layer_kernel<float>(float*, int)"
    COPY_BYTES = 1 << 16

    def __init__(self) -> None:
        super().__init__()
        self._launches: list[tuple[int, int]] = []  # (external id, CUPTI time)
        self._correlation = 0
        self._strings: dict[str, object] = {}

    def correlator(self, base: int) -> RecordingCorrelator:
        gpu = self

        class Launching(RecordingCorrelator):
            def push(self, external_id: int) -> None:
                super().push(external_id)
                gpu._launches.append((external_id, now_on_cupti_clock()))

        correlator = Launching(base)
        self.correlators.append(correlator)
        return correlator

    def take_buffers(self) -> list[ActivityBuffer]:
        launches, self._launches = self._launches, []
        builder = BufferBuilder(strings=self._strings)
        for external_id, at in launches:
            if external_id & ((1 << 24) - 1) == 0:  # the first layer's forward: the batch
                self._correlation += 1
                builder.api(self._correlation, at - 2_000, at - 1_900)
                builder.memcpy(1, self.COPY_BYTES, at - 1_500, at - 500,
                               correlation=self._correlation)
            self._correlation += 1
            builder.external(self._correlation, external_id).api(self._correlation, at, at + 500)
            builder.kernel(self.KERNEL, at + 1_000, at + 21_000, correlation=self._correlation)
        self.queue.append(builder.bytes())
        return super().take_buffers()


def install_simulated_gpu() -> None:
    """Make this process's probe trace a simulated GPU (call before enabling it)."""
    from dlprof_agent.probe import kernel_tracer

    kernel_tracer.BINDING_FACTORY = SimulatedGpu
    kernel_tracer.CUDA_CHECK = lambda: True
