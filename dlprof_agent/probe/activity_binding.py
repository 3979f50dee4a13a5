"""What the kernel tracer asks of a CUPTI binding: ``cupti_binding.CuptiBinding``,
or a test's fake (the seam is ``kernel_tracer.BINDING_FACTORY``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from dlprof_agent.probe.cupti_binding import ActivityBuffer


class LayerCorrelator(Protocol):
    """What the layer hooks push and pop around a layer (``Correlator``)."""

    base: int  # the tracer's run and the timed step's weight, in every id's high bits

    def push(self, external_id: int) -> None: ...

    def pop(self) -> None: ...


class ActivityBinding(Protocol):
    """CUPTI's Activity API as the kernel tracer uses it."""

    @property
    def enabled(self) -> tuple[int, ...]: ...

    def open(self, framework: str = "", framework_cuda: str | None = None) -> None: ...

    def enable(self, kinds: list[int]) -> None: ...

    def disable(self, kinds: list[int]) -> None: ...

    def flush(self, *, forced: bool = False) -> None: ...

    def take_buffers(self) -> list[ActivityBuffer]: ...

    def release(self, buffer: ActivityBuffer) -> None: ...

    def record_size(self, buffer: ActivityBuffer, offset: int) -> int | None: ...

    def counters(self) -> dict[str, int]: ...

    def timestamp_ns(self) -> int: ...

    def correlator(self, base: int) -> LayerCorrelator: ...

    def close(self, *, forced: bool = False) -> None: ...

    def abandon(self) -> None: ...

    def trim(self) -> None: ...


class LayerIdSource(Protocol):
    """What the layer hooks read of the kernel tracer: the correlator to push
    their ids with, or None while kernel time is not being put on layers."""

    correlator: LayerCorrelator | None
