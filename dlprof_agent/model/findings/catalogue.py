"""The findings' catalogue and records: what each finding means and advises, and
one rule's state for one target at one pass. The rules that judge them are this
package's ``window``, ``rules`` and ``tracker``; exporters and dashboards read only this."""

from __future__ import annotations

from dataclasses import dataclass

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True, slots=True)
class Kind:
    """What a finding is: its stable id, severity, meaning and what to try."""

    id: str
    severity: str
    summary: str
    advice: str


KINDS: tuple[Kind, ...] = (
    Kind("memory_near_limit", "critical",
         "resident memory is near the job's memory limit: the OOM killer is next",
         "lower the batch size or loader workers, or raise the cgroup/host memory limit"),
    Kind("memory_stalls", "warning",
         "the job waits on memory: swapping, reclaim stalls or iowait near its limit",
         "free memory (smaller batch, fewer workers, smaller shuffle buffer) before tuning "
         "anything else"),
    Kind("gpu_memory_near_total", "warning",
         "GPU memory is nearly full",
         "lower the batch size or use activation checkpointing; under TensorFlow, "
         "memory growth (allow_growth) shows what the job really needs"),
    Kind("thread_oversubscription", "warning",
         "more runnable threads than the CPUs the job may use: threads queue and preempt "
         "each other",
         "lower the thread counts (torch.set_num_threads, OMP_NUM_THREADS, intra-op threads, "
         "loader workers) to the allowed CPUs"),
    Kind("cpu_contention", "warning",
         "the job's runnable threads get less than half the CPU they could use: other "
         "processes keep the host's CPUs busy",
         "give the job CPUs of its own (a cpuset, taskset, a dedicated node) or move its "
         "neighbours; until then its step time measures them too"),
    Kind("input_bound", "warning",
         "the step waits for input: most of it is outside forward, backward and optimizer",
         "load data in parallel (DataLoader num_workers, tf.data prefetch), cache or "
         "pre-decode the data set"),
    Kind("launch_bound", "warning",
         "the GPU idles while the launching process keeps a core busy",
         "larger batches, fewer and larger kernels (torch.compile, CUDA graphs, fused "
         "optimizers)"),
    Kind("layout_transposes", "warning",
         "layout conversions (NCHW<->NHWC transposes) take a share of GPU time",
         "train channels-last: model.to(memory_format=torch.channels_last) and the same for "
         "inputs; data_format='channels_last' in TensorFlow"),
    Kind("autotune_off", "warning",
         "convolutions take much of the GPU time and cuDNN autotuning is off",
         "torch.backends.cudnn.benchmark = True for fixed input shapes "
         "(TF_CUDNN_USE_AUTOTUNE=1 in TensorFlow)"),
    Kind("fp32_on_tensor_cores", "warning",
         "full precision on a GPU with tensor cores, where GEMMs and convolutions are much "
         "of the GPU time",
         "mixed precision: torch.autocast with bfloat16 or float16 (and a GradScaler for "
         "float16); the mixed_float16 policy in Keras"),
    Kind("gradient_exchange", "warning",
         "gradient exchange (NCCL all-reduce) takes a large share of GPU time",
         "overlap it with backward (DDP bucket_cap_mb, gradient_as_bucket_view), larger "
         "batches per GPU, or gradient compression"),
    Kind("measurement_costly", "warning",
         "the agent or its CUPTI tracing costs the job noticeable time",
         "raise --interval, leave out --layers, or --no-kernels"),
    Kind("measurement_partial", "info",
         "some measurements are partial: probe hook errors, CUPTI dropped records, or "
         "another profiler holds CUPTI",
         "read the step and kernel figures as lower bounds until this clears; the agent's "
         "log says why"),
    Kind("series_capped", "info",
         "the job reports more layers or kernels than the agent's series budget: those past "
         "the top ones by time are folded into 'other'",
         "raise --max-series-per-target (and the daemon's --max-series), or give the layers "
         "of interest shorter, fewer names"),
)
KINDS_BY_ID = {kind.id: kind for kind in KINDS}


@dataclass(frozen=True, slots=True)
class Finding:
    """One rule's state for one target at one pass."""

    kind: Kind
    active: bool  # raised: the cause has held long enough and not cleared since
    evidence: tuple[tuple[str, float], ...]
    since_seconds: float | None = None  # monotonic time it was raised, while active

    @property
    def id(self) -> str:
        return self.kind.id

    @property
    def severity(self) -> str:
        return self.kind.severity


def active(findings: tuple[Finding, ...]) -> list[Finding]:
    """The raised ones, most severe first."""
    return sorted((f for f in findings if f.active),
                  key=lambda f: (-SEVERITIES.index(f.severity), f.id))
