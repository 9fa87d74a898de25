"""The request scheduler: a bounded queue, one lane per decoder settings, and one worker
that keeps a running batch per lane (continuous batching at block boundaries).

* **Admission and back-pressure.** A request's rows cost ``prompt tokens + gen_length``
  each; the scheduler admits rows while the tokens of all admitted rows (waiting or
  decoding) stay within ``max_tokens``. A request that does not fit now waits in the
  server-held *line* while the line's tokens stay within ``max_waiting_tokens``, and the
  line is admitted first come, first served: while anyone waits in it, a new request joins
  it rather than take room that frees up, so no request is overtaken (a large one is not
  starved by a flow of small ones). Beyond the line's budget a request is refused with
  :class:`QueueFullError` (HTTP 429), so memory and waiting time stay bounded whatever the
  load.
* **Lanes.** Rows whose settings build the same decoder (:class:`~dloom.serve.decoders.
  LaneKey`) wait in one lane; only rows of one lane can share a forward batch.
* **Continuous batching.** One worker thread owns the device. Each lane with rows has one
  running batch, a :class:`~dloom.decode.session.DecodeSession` (a decoder that does not
  step, an ``"ar-target"`` one, decodes its rows whole: :mod:`dloom.serve.batches`); the worker takes the lanes
  in turn, one step (one forward of the batch) at a time. Before each step the lane's
  waiting rows join its batch, oldest first, up to ``max_batch_size`` rows in it: a row
  joins between two forwards, at its own first block boundary, while the rows already there
  go on with their blocks. A row leaves the batch in the step it finishes (per-row block
  progression), and its answer is posted then; its place and its tokens are free for the
  next step.
* **Batch invariance.** Under greedy decoding a row's tokens do not depend on the other
  rows of its batch, nor on when it joined (the engine pads on the left, masks the padding,
  and starts a joining row with its own full forward), so every response equals decoding
  its prompt alone offline; ``tests/serve/test_serve.py`` checks it under load. A sampling row
  draws from its own random stream, keyed to the lane's seed and the row's index in its
  request (:attr:`Job.index`, passed as ``row_offset``), so a seeded request decodes exactly
  as ``generate`` of its own prompts with that seed, whatever shares its batch.
* **Cancellation.** A row cancelled while it waits leaves the queue and frees its tokens at
  once. A row cancelled while decoding is withdrawn from its batch before the batch's next
  forward, and frees its place and its tokens then.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dloom.decode.decoders import Decoder
from dloom.decode.session import BlockRecord, FinishedRows
from dloom.errors import ConfigurationError, QueueFullError, WorkerDeadError
from dloom.serve.batches import RunningBatch, open_batch
from dloom.serve.decoders import LaneKey, Resolved
from dloom.serve.metrics import ServerMetrics


@dataclass(frozen=True)
class BlockTokens:
    """Event: one more decoded block of a streamed row (``tokens``: its generated ids)."""

    tokens: list[int]


@dataclass(frozen=True)
class Finished:
    """Event: a row's final output and the figures of the running batch that decoded it.

    :ivar tokens: generated tokens up to and including the first EOS.
    :ivar nfe: forwards in which the row was decoding.
    :ivar batch_rows: the most rows the batch held while the row was in it.
    :ivar forwards: forwards of the batch while the row was in it.
    :ivar speculation: the batch's speculation figures so far (``None`` without speculation).
    :ivar logprobs: with a lane that records them, the generated positions' commit-time
        log-probabilities, their alternatives' ids and theirs (:mod:`dloom.decode.logprobs`).
    """

    tokens: list[int]
    nfe: int
    batch_rows: int
    forwards: int
    speculation: dict[str, Any] | None
    logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None


@dataclass(frozen=True)
class Failed:
    """Event: decoding the row's batch raised ``error`` (any exception, ``SystemExit`` and
    ``KeyboardInterrupt`` from a plugin's hook included)."""

    error: BaseException

    @property
    def message(self) -> str:
        """The failure in words: the error's message, with its type when the message alone
        would not say what happened (``SystemExit(3)``'s message is ``3``)."""
        if isinstance(self.error, Exception) and str(self.error):
            return str(self.error)
        return f"{type(self.error).__name__}: {self.error}" if str(self.error) else type(self.error).__name__


Event = BlockTokens | Finished | Failed


@dataclass(eq=False)
class Job:
    """One row to decode: a prompt of a request.

    :ivar prompt: the prompt's token ids.
    :ivar stream: whether the request wants each block as it lands.
    :ivar post: delivers an event to the request (called from the worker thread).
    :ivar index: the prompt's index in its request (``0 .. n-1``): its random stream.
    :ivar state: ``waiting`` (in the line, not admitted yet), ``queued``, ``running``,
        ``done`` or ``cancelled``.
    :ivar row: its id in its lane's running batch, once it has joined.
    """

    prompt: list[int]
    stream: bool
    post: Callable[[Event], None]
    index: int = 0
    cost: int = 0
    state: str = "queued"
    lane: LaneKey | None = None
    submitted: float = field(default_factory=time.perf_counter)
    row: int | None = None
    joined_at: int = 0  # the batch's forwards when the row joined
    batch_rows: int = 0  # the most rows the batch held while the row was in it


@dataclass(eq=False)
class Lane:
    """The rows of one decoder setting: waiting, and in its running batch.

    :ivar running: the rows in the batch by their ids (the worker's alone to change).
    :ivar withdrawn: ids of rows cancelled while decoding, to leave before the next step.
    """

    key: LaneKey
    decoder: Decoder
    waiting: deque[Job] = field(default_factory=deque)
    session: RunningBatch | None = None
    running: dict[int, Job] = field(default_factory=dict)
    withdrawn: list[int] = field(default_factory=list)
    joining: int = 0  # rows taken from the queue that the worker is admitting now

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.joining


def finished_logprobs(done: FinishedRows, count: int) -> list[Any]:
    """Each finished row's generated-region log-probabilities as host lists (one copy for
    all ``count`` rows), or ``None`` per row when the batch records none."""
    if done.logprobs is None:
        return [None] * count
    width = done.prompt_width
    values = done.logprobs
    return list(zip(
        values.token[:, width:].tolist(), values.top_ids[:, width:].tolist(), values.top_values[:, width:].tolist()
    ))


class Scheduler:
    """Queue, lanes and the worker thread (see the module docstring).

    :param gen_length: generated positions per row (the cost of a row beyond its prompt).
    :param max_batch_size: rows in a lane's running batch, at most.
    :param max_tokens: token budget of all admitted rows (waiting or decoding).
    :param metrics: where batch figures are counted.
    :param max_waiting_tokens: token budget of the requests waiting in line for room (0: a
        request that does not fit now is refused at once).
    """

    def __init__(
        self, gen_length: int, max_batch_size: int, max_tokens: int, metrics: ServerMetrics,
        max_waiting_tokens: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ConfigurationError(f"max_batch_size is {max_batch_size}; allowed: >= 1")
        if max_tokens < 1:
            raise ConfigurationError(f"max_queued_tokens is {max_tokens}; allowed: >= 1")
        self.gen_length = gen_length
        self.max_batch_size = max_batch_size
        if max_waiting_tokens < 0:
            raise ConfigurationError(f"max_waiting_tokens is {max_waiting_tokens}; allowed: >= 0")
        self.max_tokens = max_tokens
        self.max_waiting_tokens = max_waiting_tokens
        self.metrics = metrics
        self._line: deque[tuple[Resolved, list[Job]]] = deque()  # requests waiting for room, oldest first
        self._line_tokens = 0
        self._lanes: OrderedDict[LaneKey, Lane] = OrderedDict()
        self._admitted_tokens = 0
        self._running = 0
        self._stopping = False
        self._ready = threading.Condition()
        self._worker: threading.Thread | None = None
        self._row_seconds: float | None = None  # recent rows' time from submission to answer
        self.failure: str | None = None
        """Why the worker thread stopped, when it stopped on an error (else ``None``)."""

    # --- admission ---------------------------------------------------------------------

    def check_cost(self, cost: int, at_least: bool = False) -> None:
        """Refuse a request of ``cost`` tokens (``prompt + gen_length`` per row; with
        ``at_least``, a lower bound of them) that could never fit the budget.

        :raises ConfigurationError: when ``cost`` passes the whole budget (HTTP 400).
        """
        if cost > self.max_tokens:
            raise ConfigurationError(
                f"the request needs {'at least ' if at_least else ''}{cost} tokens (prompt + gen_length "
                f"per prompt and choice), more than the server's whole budget of {self.max_tokens} "
                "(--max-queued-tokens)"
            )

    def check_room(self, cost: int) -> None:
        """Refuse a request of ``cost`` tokens that neither fits the budget now nor the line
        (a check before any of its rows is built; :meth:`submit` checks again as it takes
        them).

        :raises QueueFullError: when neither has room (HTTP 429).
        :raises WorkerDeadError: once the worker has stopped on an error (HTTP 503).
        """
        with self._ready:
            self._check_room(cost)

    def _check_room(self, cost: int) -> bool:
        """:meth:`check_room` with the lock held: whether the request is admitted now
        (``False``: it waits in line)."""
        if self.failure is not None:
            raise WorkerDeadError(f"the server's decoding worker has stopped: {self.failure}")
        if not self._line and self._admitted_tokens + cost <= self.max_tokens:
            return True
        if self._line_tokens + cost <= self.max_waiting_tokens:
            return False
        retry = self.retry_after()
        line = f", {self._line_tokens} of {self.max_waiting_tokens} wait in line," if self.max_waiting_tokens else ""
        raise QueueFullError(
            f"the server is full: {self._admitted_tokens} of {self.max_tokens} tokens are admitted{line} "
            f"and the request needs {cost}; retry after {retry} s", retry,
        )

    def submit(self, resolved: Resolved, jobs: list[Job]) -> None:
        """Admit all of a request's rows into their lane, or put them all in line, or
        neither.

        :raises ConfigurationError: when the rows could never fit the budget.
        :raises QueueFullError: when they fit neither the budget nor the line now.
        """
        for job in jobs:
            job.cost = len(job.prompt) + self.gen_length
            job.lane = resolved.key
        cost = sum(job.cost for job in jobs)
        self.check_cost(cost)
        with self._ready:
            if self._check_room(cost):
                self._enqueue(resolved, jobs)
            else:
                for job in jobs:
                    job.state = "waiting"
                self._line.append((resolved, jobs))
                self._line_tokens += cost

    def _enqueue(self, resolved: Resolved, jobs: list[Job]) -> None:
        """Admit a request's rows into their lane (lock held)."""
        lane = self._lanes.get(resolved.key)
        if lane is None:
            lane = self._lanes[resolved.key] = Lane(resolved.key, resolved.decoder)
        for job in jobs:
            job.state = "queued"
        lane.waiting.extend(jobs)
        self._admitted_tokens += sum(job.cost for job in jobs)
        self._ready.notify()

    def _admit_line(self) -> None:
        """Admit the requests at the head of the line while the budget has room for them
        (lock held; first come, first served: the head waits for room, no one overtakes it)."""
        while self._line:
            resolved, jobs = self._line[0]
            cost = sum(job.cost for job in jobs)
            if self._admitted_tokens + cost > self.max_tokens:
                return
            self._line.popleft()
            self._line_tokens -= cost
            self._enqueue(resolved, jobs)

    def cancel(self, job: Job) -> None:
        """Withdraw a row: a waiting one leaves the queue now, a decoding one leaves its batch
        before the batch's next forward; a finished one is left as it is."""
        with self._ready:
            if job.state == "waiting":
                entry = next(entry for entry in self._line if job in entry[1])
                entry[1].remove(job)
                if not entry[1]:
                    self._line.remove(entry)
                self._line_tokens -= job.cost
                self._admit_line()  # a new head may fit
                self.metrics.count_cancelled("queued")
            elif job.state == "queued" and job.lane is not None:  # a queued job has its lane
                lane = self._lanes[job.lane]
                lane.waiting.remove(job)
                if lane.idle:
                    del self._lanes[job.lane]
                self._admitted_tokens -= job.cost
                self._admit_line()
                self.metrics.count_cancelled("queued")
            elif job.state == "running":
                if job.row is not None and job.lane is not None:  # else it is joining now: the worker withdraws it
                    self._lanes[job.lane].withdrawn.append(job.row)
                self.metrics.count_cancelled("running")
            else:
                return
            job.state = "cancelled"

    def retry_after(self) -> int:
        """Seconds a refused client should wait (lock held): the rows waiting now (admitted
        or in line), taken ``max_batch_size`` at a time, plus the batch decoding now, each
        batch taking the mean time recent rows took from submission to answer; 1 before
        any row finished, 60 at most."""
        if self._row_seconds is None:
            return 1
        waiting = self._waiting_rows()
        batches = 1 + waiting / self.max_batch_size
        return max(1, min(60, math.ceil(batches * self._row_seconds)))

    def _waiting_rows(self) -> int:
        """Rows not decoding yet: admitted and waiting in their lanes, or in line (lock held)."""
        return sum(len(lane.waiting) for lane in self._lanes.values()) + sum(len(jobs) for _, jobs in self._line)

    def load(self) -> dict[str, int]:
        """``waiting`` rows (admitted or in line), ``running`` rows, ``admitted_tokens`` and
        ``line_tokens`` (of the requests in line) right now."""
        with self._ready:
            return {
                "waiting": self._waiting_rows(), "running": self._running,
                "admitted_tokens": self._admitted_tokens, "line_tokens": self._line_tokens,
            }

    # --- the worker --------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread."""
        self._stopping = False
        self.failure = None
        self._worker = threading.Thread(target=self._run, name="dloom-serve-worker", daemon=True)
        self._worker.start()

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (``False`` before :meth:`start`, after :meth:`stop`
        and once it stopped on an error: :attr:`failure` says which)."""
        return self._worker is not None and self._worker.is_alive()

    def stop(self) -> None:
        """Let the running batches finish (no row joins them), then stop the worker (waiting
        rows stay queued)."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def _run(self) -> None:
        """The worker thread. A batch whose step raises fails alone (:meth:`_step`); should
        the worker itself raise, whatever the error, it records :attr:`failure`, and every
        admitted row hears of it rather than waiting for ever."""
        try:
            self._work()
        except BaseException as error:  # noqa: BLE001 - a dead worker must not leave clients waiting
            with self._ready:
                self.failure = Failed(error).message
                jobs = [job for lane in self._lanes.values() for job in (*lane.waiting, *lane.running.values())]
                jobs += [job for _, waiting in self._line for job in waiting]
                for job in jobs:
                    job.state = "running" if job.state in ("queued", "waiting") else job.state  # all are answered now
                self._lanes.clear()
                self._line.clear()
                self._running, self._admitted_tokens, self._line_tokens = 0, 0, 0
                events = self._deliver(jobs, [Failed(error)] * len(jobs))
            for job, event in events:
                job.post(event)

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._stopping and not self._lanes:
                    self._ready.wait()
                if self._stopping and not self._running:
                    return
                lane = self._next_lane()
                self._withdraw(lane)
                joining = [] if self._stopping else self._take(lane)
            self._step(lane, joining)

    def _next_lane(self) -> Lane:
        """The lane whose turn it is (lock held): lanes take one step each in turn (while
        stopping, only lanes with a running batch)."""
        lane = next(lane for lane in self._lanes.values() if lane.running or not self._stopping)
        self._lanes.move_to_end(lane.key)
        return lane

    def _withdraw(self, lane: Lane) -> None:
        """Take the rows cancelled while decoding out of ``lane``'s batch (lock held)."""
        if not lane.withdrawn:
            return
        withdrawn, lane.withdrawn = lane.withdrawn, []
        rows = [row for row in withdrawn if row in lane.running]
        self._release([lane.running.pop(row) for row in rows])
        if lane.session is not None:
            lane.session.cancel(rows)

    def _take(self, lane: Lane) -> list[Job]:
        """The lane's waiting rows that join its batch now, oldest first (lock held)."""
        free = self.max_batch_size - len(lane.running)
        jobs = [lane.waiting.popleft() for _ in range(min(free, len(lane.waiting)))]
        for job in jobs:
            job.state = "running"
        self._running += len(jobs)
        lane.joining = len(jobs)
        return jobs

    def _release(self, jobs: list[Job]) -> None:
        """Free the places and tokens of rows that left their batch (lock held)."""
        self._running -= len(jobs)
        self._admitted_tokens -= sum(job.cost for job in jobs)
        self._admit_line()

    def _step(self, lane: Lane, joining: list[Job]) -> None:
        """Admit ``joining`` into ``lane``'s running batch, take one step, post the events of
        the rows that finished (the one place that decides how rows share the device)."""
        if lane.session is None:
            lane.session = open_batch(lane.decoder, lane.key.logprobs, lane.key.ignore_eos)
        session = lane.session
        failed: list[tuple[Job, Event]] = []
        if joining:
            failed = self._admit(lane, joining)
        session.on_block = self._streamer(lane) if any(job.stream for job in lane.running.values()) else None
        events: list[tuple[Job, Event]] = []
        size = session.size
        try:
            done = session.step() if size else None
        except BaseException as error:  # noqa: BLE001 - every client of the batch must hear of it, even of a hook's SystemExit
            with self._ready:
                jobs = list(lane.running.values())
                lane.running.clear()
                lane.withdrawn.clear()
                lane.session = None
                self._release(jobs)
                events = self._deliver(jobs, [Failed(error)] * len(jobs))
        else:
            if size:
                self.metrics.count_step(size)
            if done is not None:
                rows, tokens, nfe = done.rows.tolist(), done.token_lists(), done.nfe.tolist()
                logprobs = finished_logprobs(done, len(rows))
                with self._ready:
                    jobs = [lane.running.pop(row) for row in rows]
                    self._release(jobs)
                    finished = [
                        Finished(t, n, job.batch_rows, session.forwards - job.joined_at, session.speculation, lp)
                        for job, t, n, lp in zip(jobs, tokens, nfe, logprobs)
                    ]
                    for n in nfe:
                        self.metrics.count_finished(n)
                    now = time.perf_counter()
                    for job in jobs:
                        seconds = now - job.submitted
                        self._row_seconds = seconds if self._row_seconds is None else 0.8 * self._row_seconds + 0.2 * seconds
                    events = self._deliver(jobs, finished)
        with self._ready:
            if lane.idle and self._lanes.get(lane.key) is lane:
                del self._lanes[lane.key]
        for job, event in failed + events:
            job.post(event)

    def _admit(self, lane: Lane, joining: list[Job]) -> list[tuple[Job, Event]]:
        """Rows join the lane's batch; the events of rows that could not (their prompt was
        refused: the batch goes on without them)."""
        session = lane.session
        assert session is not None, "the lane's batch is made before rows join it"
        started = session.size == 0
        try:
            ids = session.admit([job.prompt for job in joining], row_offset=[job.index for job in joining])
        except BaseException as error:  # noqa: BLE001 - the rows' clients must hear of it, even of a hook's SystemExit
            with self._ready:
                lane.joining = 0
                self._release(joining)
                return self._deliver(joining, [Failed(error)] * len(joining))
        self.metrics.count_joined(len(joining), started)
        with self._ready:
            lane.joining = 0
            for job, row in zip(joining, ids):
                job.row, job.joined_at = row, session.forwards
                lane.running[row] = job
                if job.state == "cancelled":  # its client left while it was joining
                    lane.withdrawn.append(row)
            for job in lane.running.values():
                job.batch_rows = max(job.batch_rows, session.size)
        return []

    @staticmethod
    def _deliver(jobs: list[Job], events: Sequence[Event]) -> list[tuple[Job, Event]]:
        """The events of the rows still wanted (lock held); they are done now."""
        delivered = []
        for job, event in zip(jobs, events):
            if job.state == "running":
                job.state = "done"
                delivered.append((job, event))
        return delivered

    @staticmethod
    def _streamer(lane: Lane) -> Callable[[BlockRecord], None]:
        """The engine's ``on_block`` callback: each streamed row's block tokens, posted as
        they land (one host copy per block, not per row)."""

        def on_block(record: BlockRecord) -> None:
            rows, tokens, generated = record.rows.tolist(), record.tokens.tolist(), record.generated.tolist()
            for row, block, keep in zip(rows, tokens, generated):
                job = lane.running[row]
                if job.stream and job.state == "running":
                    job.post(BlockTokens([token for token, new in zip(block, keep) if new]))

        return on_block
