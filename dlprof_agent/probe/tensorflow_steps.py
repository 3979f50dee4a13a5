"""Keras's and tf.function's hot path: the step boundary that ``model.fit``'s train
function, or a custom loop's step function, stamps, and how the stamps become steps.

A step costs the job one stamp (``torch_steps.StepEvents``'s ring: an event,
the time, the step's samples); the recorder replays it with the PyTorch stamps'
machinery, on the probe's thread when the agent asks for a snapshot, or on the job's
thread before anything that adds to the recorder directly (an eager phase, a layer's
time). The step's bookkeeping (closing the step, its histogram, its split) is then
off the job's path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlprof_agent.probe.recorder import COMPILED_GRAPH
from dlprof_agent.probe.torch_steps import StepEvents

if TYPE_CHECKING:
    from dlprof_agent.probe.recorder import Recorder
    from dlprof_agent.probe.tensorflow_samples import KerasSamples

# Events: a Keras train function's call began. Value: the fit's epoch iterator's
# count of steps handed out (> 0), whose samples the replay works out from the fit's
# shape, or the step's samples themselves, negated (<= 0; 0: unknown).
KERAS_STEP_GRAPH = 11.0  # a compiled fit: the step is one graph, not split
KERAS_STEP_EAGER = 12.0  # fit(run_eagerly=True): the eager phases split it
# A custom loop's tf.function step function was called; value: its samples, negated.
TF_FUNCTION_STEP = 13.0


class KerasStepEvents(StepEvents):
    """The ring of Keras and tf.function step boundaries. The hook drains it before a fit's first
    step changes ``samples.shape``, so each count is read with its own fit's."""

    def __init__(self, samples: KerasSamples) -> None:
        super().__init__()
        self.samples = samples

    def _replay_one(self, recorder: Recorder, kind: float, now: float, value: float) -> None:
        if kind == TF_FUNCTION_STEP:
            recorder.step_boundary_unchecked("tf_function", now)
            if recorder.step_source == "tf_function":
                recorder.unsplit_reason = COMPILED_GRAPH
                if value < 0:
                    recorder.add_samples_unchecked(int(-value))
            return
        recorder.step_boundary_unchecked("keras", now)
        if recorder.step_source != "keras":
            return  # a stronger source marks the steps (an explicit probe.step())
        recorder.unsplit_reason = COMPILED_GRAPH if kind == KERAS_STEP_GRAPH else ""
        samples = self.samples.of_count(int(value)) if value > 0 else int(-value)
        if samples:
            recorder.add_samples_unchecked(samples)
