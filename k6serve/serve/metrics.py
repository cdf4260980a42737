"""Prometheus text exposition, written by hand (no client library): queue depth, jobs by status, step, stage and
end-to-end latency histograms, peak GPU memory, rejections.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

from k6serve.serve.jobs import JobStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

STEP_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
STAGE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# The stages of a completed job's `timings` that are seconds of its own (the others are counts, per-step statistics,
# or "total", which k6serve_inference_seconds has), in the order a request runs them. Generation: expand_prompt (with
# expand_prompts), encode, denoise, decode_audio, decode_video, mux; super-resolution: read, encode, upscale, dit,
# decode, blend, mux; "warmup" is a --warmup-mode request warm-up the job ran first (not in its inference time).
STAGES = ("warmup", "read", "expand_prompt", "encode", "upscale", "denoise", "dit", "decode_audio", "decode_video",
          "decode", "blend", "mux")


def stage_seconds(timings: dict[str, float]) -> dict[str, float]:
    """`STAGES` among a job's `timings`, in run order, to 0.1 ms: what the job stores, logs and observes."""
    return {stage: round(float(timings[stage]), 4) for stage in STAGES if timings.get(stage) is not None}


class Histogram:
    """One histogram, or with `label` one per value of that label (`observe(value, label_value)`), rendered in
    `label_values`' order and then the others' in the order first seen; a value never observed has no series."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...], *, label: str | None = None,
                 label_values: tuple[str, ...] = ()) -> None:
        self.name, self.help_text, self.buckets = name, help_text, tuple(sorted(buckets))
        self.label = label
        self._order: dict[str | None, int] = {value: index for index, value in enumerate(label_values)}
        # label value (None without a label) -> [bucket counts, sum, count]
        self._series: dict[str | None, list] = {} if label else {None: [[0] * len(self.buckets), 0.0, 0]}
        self._lock = threading.Lock()

    def observe(self, value: float, label_value: str | None = None) -> None:
        if (label_value is None) != (self.label is None):
            raise ValueError(f"{self.name}: a value of label {self.label!r} is needed" if self.label
                             else f"{self.name} has no label")
        with self._lock:
            series = self._series.setdefault(label_value, [[0] * len(self.buckets), 0.0, 0])
            index = bisect.bisect_left(self.buckets, value)
            if index < len(self.buckets):
                series[0][index] += 1
            series[1] += value
            series[2] += 1

    def render(self) -> list[str]:
        with self._lock:
            snapshot = [(key, list(counts), total, count) for key, (counts, total, count) in self._series.items()]
        snapshot.sort(key=lambda item: self._order.get(item[0], len(self._order)))  # stable: first seen after
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        for key, counts, total, count in snapshot:
            own = f'{self.label}="{key}"' if self.label else ""
            labels = f"{{{own}}}" if own else ""
            cumulative = 0
            for bound, bucket_count in zip(self.buckets, counts):
                cumulative += bucket_count
                lines.append(f'{self.name}_bucket{{{own + "," if own else ""}le="{bound:g}"}} {cumulative}')
            lines += [f'{self.name}_bucket{{{own + "," if own else ""}le="+Inf"}} {count}',
                      f"{self.name}_sum{labels} {total:.6f}", f"{self.name}_count{labels} {count}"]
        return lines


class ServerMetrics:
    """Process-wide counters; the job counts themselves are read from the store at scrape time."""

    def __init__(self) -> None:
        self.step_latency = Histogram("k6serve_step_latency_seconds",
                                      "Time per DiT call: a denoising step (two per tile for super-resolution); a "
                                      "job's first call, which follows its text encoding, is left out.", STEP_BUCKETS_S)
        self.job_latency = Histogram("k6serve_job_latency_seconds",
                                     "End-to-end time from job creation to completion.", JOB_BUCKETS_S)
        self.inference_latency = Histogram("k6serve_inference_seconds",
                                           "Engine time of completed jobs (start to MP4 written).", JOB_BUCKETS_S)
        self.stage_latency = Histogram(
            "k6serve_stage_seconds", "Seconds of each stage of completed jobs, by stage: generation's expand_prompt "
            "(jobs with expand_prompts), encode, denoise, decode_audio, decode_video, mux; super-resolution's read, "
            "encode, upscale, dit, decode, blend, mux; warmup, a --warmup-mode request warm-up a job ran first.",
            STAGE_BUCKETS_S, label="stage", label_values=STAGES)
        self._lock = threading.Lock()
        self._rejected: Counter[str] = Counter()
        self._finished: Counter[str] = Counter()
        self._webhooks: Counter[str] = Counter()
        self.peak_memory_mb = 0.0

    def stages(self, timings: dict[str, float]) -> None:
        """A completed job's stage seconds (`stage_seconds` of its timings) into k6serve_stage_seconds."""
        for stage, seconds in stage_seconds(timings).items():
            self.stage_latency.observe(seconds, stage)

    def webhook(self, outcome: str) -> None:
        """One webhook event delivered to one URL, or given up ("delivered" / "failed")."""
        with self._lock:
            self._webhooks[outcome] += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    def finished(self, status: JobStatus, peak_memory_mb: float | None = None) -> None:
        with self._lock:
            self._finished[status.value] += 1
            if peak_memory_mb is not None:
                self.peak_memory_mb = max(self.peak_memory_mb, peak_memory_mb)

    def render(self, *, queue_depth: int, jobs_by_status: dict[JobStatus, int], running: int,
               seconds_since_progress: float = 0.0, replicas: int = 1, dead_replicas: int = 0,
               webhook_pending: int = 0) -> str:
        with self._lock:
            rejected, finished, peak = dict(self._rejected), dict(self._finished), self.peak_memory_mb
            webhooks = dict(self._webhooks)
        lines = [
            "# HELP k6serve_queue_depth Jobs waiting for the engine.",
            "# TYPE k6serve_queue_depth gauge",
            f"k6serve_queue_depth {queue_depth}",
            "# HELP k6serve_running_jobs Jobs the engine is working on.",
            "# TYPE k6serve_running_jobs gauge",
            f"k6serve_running_jobs {running}",
            "# HELP k6serve_seconds_since_progress Seconds since the longest-silent running job last reported a "
            "step or decode chunk (its dispatch before the first; 0 when none runs). Far above the step latency: a "
            "hung worker. A cold request's first step includes its compile.",
            "# TYPE k6serve_seconds_since_progress gauge",
            f"k6serve_seconds_since_progress {seconds_since_progress:.3f}",
            "# HELP k6serve_replicas Worker replicas by state.",
            "# TYPE k6serve_replicas gauge",
            f'k6serve_replicas{{state="serving"}} {replicas - dead_replicas}',
            f'k6serve_replicas{{state="dead"}} {dead_replicas}',
            "# HELP k6serve_jobs Stored jobs by status.",
            "# TYPE k6serve_jobs gauge",
            *(f'k6serve_jobs{{status="{status.value}"}} {jobs_by_status.get(status, 0)}' for status in JobStatus),
            "# HELP k6serve_jobs_finished_total Jobs that reached a final status since the server started.",
            "# TYPE k6serve_jobs_finished_total counter",
            *(f'k6serve_jobs_finished_total{{status="{s.value}"}} {finished.get(s.value, 0)}'
              for s in JobStatus if s.is_terminal),
            "# HELP k6serve_requests_rejected_total Create requests refused, by reason.",
            "# TYPE k6serve_requests_rejected_total counter",
            *(f'k6serve_requests_rejected_total{{reason="{reason}"}} {count}'
              for reason, count in sorted(rejected.items())),
            "# HELP k6serve_webhook_deliveries_total Webhook events (--webhook-url) delivered to a URL, or given up "
            "(failed, as is one not kept in the job store whose retries a stop cut short); one a stop cut short and "
            "kept for the next start, one never tried before the server stopped, and a kept one dropped at start "
            "count in neither.",
            "# TYPE k6serve_webhook_deliveries_total counter",
            *(f'k6serve_webhook_deliveries_total{{outcome="{outcome}"}} {webhooks.get(outcome, 0)}'
              for outcome in ("delivered", "failed")),
            "# HELP k6serve_webhook_events_pending Webhook events scheduled or in an attempt for a URL, not yet "
            "delivered or given up (summed over the URLs): a receiver that is down shows as a count that grows, "
            "while its events are retried for up to 72 hours.",
            "# TYPE k6serve_webhook_events_pending gauge",
            f"k6serve_webhook_events_pending {webhook_pending}",
            "# HELP k6serve_peak_gpu_memory_mb Highest peak accelerator memory of any completed job since the server "
            "started (MiB; 0 before the first; CPU: the worker's peak RSS).",
            "# TYPE k6serve_peak_gpu_memory_mb gauge",
            f"k6serve_peak_gpu_memory_mb {peak:.1f}",
            *self.step_latency.render(),
            *self.job_latency.render(),
            *self.inference_latency.render(),
            *self.stage_latency.render(),
        ]
        return "\n".join(lines) + "\n"
