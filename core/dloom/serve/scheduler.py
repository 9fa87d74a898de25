"""The request scheduler: a bounded queue, one lane per decoder settings, and one worker
that decodes a lane's waiting rows as one batch.

* **Admission and back-pressure.** A request's rows cost ``prompt tokens + gen_length``
  each; the scheduler admits rows while the tokens of all admitted rows (waiting or
  decoding) stay within ``max_tokens`` and refuses the rest with :class:`QueueFullError`
  (HTTP 429), so memory and waiting time stay bounded whatever the load.
* **Lanes.** Rows whose settings build the same decoder (:class:`~dloom.serve.decoders.
  LaneKey`) wait in one lane; only rows of one lane can share a forward batch.
* **Request-level dynamic batching.** One worker thread owns the device. Each time it is
  free it takes the lane whose oldest row has waited longest and decodes up to
  ``max_batch_size`` of that lane's waiting rows in one
  :meth:`~dloom.DiffusionDecoder.generate` call. Rows arriving meanwhile wait for the next
  call.
* **Batch invariance.** Under greedy decoding a row's tokens do not depend on the other
  rows of its batch (the engine pads on the left and masks the padding), so every response
  equals decoding its prompt alone offline; ``tests/test_serve.py`` checks it under load.
  A sampling row draws from its own random stream, keyed to the lane's seed and the row's
  index in its request (:attr:`Job.index`, passed as ``row_offset``), so a seeded request
  decodes exactly as ``generate`` of its own prompts with that seed, whatever shares its
  batch.
* **Cancellation.** A row cancelled before its batch starts leaves the queue and frees its
  tokens at once. A row cancelled while decoding keeps its place until the batch ends
  (a batch is one ``generate`` call); its output is discarded.

Block-boundary joins (continuous batching) replace one method, :meth:`Scheduler._decode`:
the engine already retires a finished row at once (per-row block progression); a
block-boundary version would also admit the lane's waiting rows at every block boundary and
retire cancelled rows there, posting the same events.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from dloom.engine import BlockRecord, DiffusionDecoder
from dloom.errors import ConfigurationError, DloomError
from dloom.serve.decoders import LaneKey, Resolved
from dloom.serve.metrics import ServerMetrics


class QueueFullError(DloomError):
    """The server's token budget is taken by admitted rows; retry later (HTTP 429)."""


@dataclass(frozen=True)
class BlockTokens:
    """Event: one more decoded block of a streamed row (``tokens``: its generated ids)."""

    tokens: list[int]


@dataclass(frozen=True)
class Finished:
    """Event: a row's final output and the figures of the batch that decoded it.

    :ivar tokens: generated tokens up to and including the first EOS.
    :ivar nfe: forwards in which the row was decoding.
    :ivar batch_rows: rows of the batch that decoded it.
    :ivar forwards: forward calls of that batch.
    :ivar speculation: the batch's speculation figures (``None`` without speculation).
    """

    tokens: list[int]
    nfe: int
    batch_rows: int
    forwards: int
    speculation: dict[str, Any] | None


@dataclass(frozen=True)
class Failed:
    """Event: decoding the row's batch raised ``error``."""

    error: BaseException


Event = BlockTokens | Finished | Failed


@dataclass(eq=False)
class Job:
    """One row to decode: a prompt of a request.

    :ivar prompt: the prompt's token ids.
    :ivar stream: whether the request wants each block as it lands.
    :ivar post: delivers an event to the request (called from the worker thread).
    :ivar index: the prompt's index in its request (``0 .. n-1``): its random stream.
    :ivar state: ``queued``, ``running``, ``done`` or ``cancelled``.
    """

    prompt: list[int]
    stream: bool
    post: Callable[[Event], None]
    index: int = 0
    cost: int = 0
    state: str = "queued"
    lane: LaneKey | None = None
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class Lane:
    """The waiting rows of one decoder setting."""

    key: LaneKey
    decoder: DiffusionDecoder
    waiting: deque[Job] = field(default_factory=deque)


class Scheduler:
    """Queue, lanes and the worker thread (see the module docstring).

    :param gen_length: generated positions per row (the cost of a row beyond its prompt).
    :param max_batch_size: rows per ``generate`` call, at most.
    :param max_tokens: token budget of all admitted rows (waiting or decoding).
    :param metrics: where batch figures are counted.
    """

    def __init__(
        self, gen_length: int, max_batch_size: int, max_tokens: int, metrics: ServerMetrics
    ) -> None:
        if max_batch_size < 1:
            raise ConfigurationError(f"max_batch_size is {max_batch_size}; allowed: >= 1")
        if max_tokens < 1:
            raise ConfigurationError(f"max_queued_tokens is {max_tokens}; allowed: >= 1")
        self.gen_length = gen_length
        self.max_batch_size = max_batch_size
        self.max_tokens = max_tokens
        self.metrics = metrics
        self._lanes: OrderedDict[LaneKey, Lane] = OrderedDict()
        self._admitted_tokens = 0
        self._running = 0
        self._stopping = False
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None

    # --- admission ---------------------------------------------------------------------

    def submit(self, resolved: Resolved, jobs: list[Job]) -> None:
        """Admit all of a request's rows into their lane, or none of them.

        :raises ConfigurationError: when the rows could never fit the budget.
        :raises QueueFullError: when they do not fit now.
        """
        for job in jobs:
            job.cost = len(job.prompt) + self.gen_length
            job.lane = resolved.key
        cost = sum(job.cost for job in jobs)
        if cost > self.max_tokens:
            raise ConfigurationError(
                f"the request needs {cost} tokens (prompt + gen_length per prompt), more than "
                f"the server's whole budget of {self.max_tokens} (--max-queued-tokens)"
            )
        with self._ready:
            if self._admitted_tokens + cost > self.max_tokens:
                raise QueueFullError(
                    f"the server is full: {self._admitted_tokens} of {self.max_tokens} tokens "
                    f"are admitted and the request needs {cost}; retry later"
                )
            lane = self._lanes.get(resolved.key)
            if lane is None:
                lane = self._lanes[resolved.key] = Lane(resolved.key, resolved.decoder)
            lane.waiting.extend(jobs)
            self._admitted_tokens += cost
            self._ready.notify()

    def cancel(self, job: Job) -> None:
        """Withdraw a row: a waiting one leaves the queue now, a decoding one is discarded
        when its batch ends; a finished one is left as it is."""
        with self._ready:
            if job.state == "queued" and job.lane is not None:  # a queued job has its lane
                lane = self._lanes[job.lane]
                lane.waiting.remove(job)
                if not lane.waiting:
                    del self._lanes[job.lane]
                self._admitted_tokens -= job.cost
                self.metrics.count_cancelled("queued")
            elif job.state == "running":
                self.metrics.count_cancelled("running")
            else:
                return
            job.state = "cancelled"

    def load(self) -> dict[str, int]:
        """``waiting`` rows, ``running`` rows and ``admitted_tokens`` right now."""
        with self._ready:
            waiting = sum(len(lane.waiting) for lane in self._lanes.values())
            return {"waiting": waiting, "running": self._running, "admitted_tokens": self._admitted_tokens}

    # --- the worker --------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread."""
        self._stopping = False
        self._worker = threading.Thread(target=self._work, name="dloom-serve-worker", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        """Let the running batch finish, then stop the worker (waiting rows stay queued)."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._stopping and not self._lanes:
                    self._ready.wait()
                if self._stopping:
                    return
                lane, jobs = self._take()
            self._decode(lane, jobs)

    def _take(self) -> tuple[Lane, list[Job]]:
        """The next batch (lock held): the lane whose oldest row has waited longest, up to
        ``max_batch_size`` of its rows."""
        lane = min(self._lanes.values(), key=lambda lane: lane.waiting[0].submitted)
        jobs = [lane.waiting.popleft() for _ in range(min(self.max_batch_size, len(lane.waiting)))]
        if not lane.waiting:
            del self._lanes[lane.key]
        for job in jobs:
            job.state = "running"
        self._running += len(jobs)
        return lane, jobs

    def _decode(self, lane: Lane, jobs: list[Job]) -> None:
        """Decode ``jobs`` as one batch and post every row's events (the one place that
        decides how rows share the device; see the module docstring)."""
        on_block = self._streamer(jobs) if any(job.stream for job in jobs) else None
        try:
            result = lane.decoder.generate(
                [job.prompt for job in jobs], on_block=on_block, row_offset=[job.index for job in jobs]
            )
        except Exception as error:  # noqa: BLE001 - every waiting client must hear of it
            events: list[Event] = [Failed(error)] * len(jobs)
        else:
            nfe = result.nfe.tolist()
            speculation = result.speculation
            events = [
                Finished(result.token_lists[i], nfe[i], len(jobs), result.forwards, speculation)
                for i in range(len(jobs))
            ]
            self.metrics.count_batch(len(jobs), result.forwards, sum(nfe))
        with self._ready:
            self._running -= len(jobs)
            self._admitted_tokens -= sum(job.cost for job in jobs)
            delivered = [job for job in jobs if job.state == "running"]
            for job in delivered:
                job.state = "done"
        for job, event in zip(jobs, events):
            if job in delivered:
                job.post(event)

    @staticmethod
    def _streamer(jobs: list[Job]) -> Callable[[BlockRecord], None]:
        """The engine's ``on_block`` callback: each streamed row's block tokens, posted as
        they land (one host copy per block, not per row)."""

        def on_block(record: BlockRecord) -> None:
            rows, tokens, generated = record.rows.tolist(), record.tokens.tolist(), record.generated.tolist()
            for row, block, keep in zip(rows, tokens, generated):
                job = jobs[row]
                if job.stream and job.state == "running":
                    job.post(BlockTokens([token for token, new in zip(block, keep) if new]))

        return on_block
