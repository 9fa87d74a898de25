"""The server's counters, rendered in the Prometheus text exposition format (``/metrics``).

Counters only grow; gauges are read from the scheduler when ``/metrics`` is scraped.
"""

from __future__ import annotations

import threading
from collections import Counter

OUTCOMES = ("completed", "invalid", "too_large", "unrouted", "rejected", "unavailable", "cancelled", "failed")
"""Request outcomes: answered, refused as malformed (400, 404 for another model, 422),
refused for a body over the size limit (413), sent to no endpoint (404 unknown route, 405
wrong method), refused because the server was full (429) or its worker has stopped (503),
abandoned by the client, or failed (500)."""


class ServerMetrics:
    """Thread-safe tallies of requests, tokens, forwards and running batches.

    :param max_batch_size: the scheduler's, to report batch occupancy as a share.
    """

    def __init__(self, max_batch_size: int) -> None:
        self.max_batch_size = max_batch_size
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter({outcome: 0 for outcome in OUTCOMES})
        self.cancelled_rows: Counter[str] = Counter({"queued": 0, "running": 0})
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.nfe = 0
        self.forwards = 0
        self.batches = 0
        self.batch_rows = 0
        self.joined_rows = 0
        self.last_step_rows = 0

    def count_request(self, outcome: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        with self._lock:
            self.requests[outcome] += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def count_cancelled(self, stage: str) -> None:
        with self._lock:
            self.cancelled_rows[stage] += 1

    def count_joined(self, rows: int, started: bool) -> None:
        """``rows`` joined a lane's running batch (``started``: the batch was empty)."""
        with self._lock:
            self.batches += started
            self.joined_rows += 0 if started else rows

    def count_step(self, rows: int) -> None:
        """A running batch of ``rows`` took one step (one forward, or a verification)."""
        with self._lock:
            self.forwards += 1
            self.last_step_rows = rows

    def count_finished(self, nfe: int) -> None:
        """A row finished after ``nfe`` forwards."""
        with self._lock:
            self.batch_rows += 1
            self.nfe += nfe

    def render(self, load: dict[str, int]) -> str:
        """The exposition text, with the scheduler's ``load`` (:meth:`Scheduler.load`)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: dict[str, float]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            for labels, value in samples.items():
                lines.append(f"{name}{labels} {value:g}")

        with self._lock:
            metric("dloom_requests_total", "counter", "HTTP requests by outcome.",
                   {f'{{outcome="{k}"}}': v for k, v in self.requests.items()})
            metric("dloom_cancelled_rows_total", "counter",
                   "Rows withdrawn unfinished (client gone, or its request failed), by where they were (queued: freed at once).",
                   {f'{{stage="{k}"}}': v for k, v in self.cancelled_rows.items()})
            metric("dloom_prompt_tokens_total", "counter", "Prompt tokens of completed requests.",
                   {"": self.prompt_tokens})
            metric("dloom_generated_tokens_total", "counter",
                   "Generated tokens returned by completed requests.", {"": self.completion_tokens})
            metric("dloom_nfe_total", "counter", "Row forwards (NFE summed over decoded rows).",
                   {"": self.nfe})
            metric("dloom_forwards_total", "counter", "Steps of running batches (one batched forward, or a verification, each).",
                   {"": self.forwards})
            metric("dloom_batches_total", "counter",
                   "Running batches started (a batch runs while it has rows; rows join and leave it).",
                   {"": self.batches})
            metric("dloom_batch_rows_total", "counter", "Rows decoded, over all batches.",
                   {"": self.batch_rows})
            metric("dloom_joined_rows_total", "counter",
                   "Rows that joined a batch already decoding other rows (continuous batching).",
                   {"": self.joined_rows})
            occupancy = self.last_step_rows / self.max_batch_size
        metric("dloom_queue_depth", "gauge", "Rows waiting for a batch (admitted or in line).", {"": load["waiting"]})
        metric("dloom_running_rows", "gauge", "Rows being decoded now.", {"": load["running"]})
        metric("dloom_admitted_tokens", "gauge",
               "Tokens of admitted rows (waiting or decoding), bounded by the budget.",
               {"": load["admitted_tokens"]})
        metric("dloom_line_tokens", "gauge",
               "Tokens of requests waiting in line for room, bounded by max_waiting_tokens.",
               {"": load["line_tokens"]})
        metric("dloom_batch_occupancy", "gauge",
               "Rows of the latest step's batch over max_batch_size.", {"": occupancy})
        return "\n".join(lines) + "\n"
