"""One engine thread that decodes a continuous batch, behind a bounded queue, and the bridge
between it and asyncio handlers.

    worker = EngineWorker(engine, queue_size=32, max_batch=8, on_end=service.request_ended)
    worker.start()
    job = Job(engine.requests(prompt_ids, n=2), deadline=time.monotonic() + 300)
    place = worker.reserve()                # Rejected("queue_full") when 32 are already waiting or admitted
    worker.submit(job, place)               # ... taken before the request is tokenised
    chunk = await job.next_event(request)   # engine Chunks, in order; the last one carries the output
    worker.close(timeout=30)                # refuse new jobs, finish the queued ones, stop

One thread owns the engine's batch (`Engine.new_batch`) and HTTP handlers never touch the
models: they await the chunks this thread posts onto their event loop. Between two decoding
steps the thread admits waiting jobs while the batch has room (each one's prefill runs, then it
decodes with the others from the next step), and takes out the jobs that finished, were
cancelled by their handler (timeout, client gone, shutdown) or passed their deadline. A job
stops between steps, never inside one, and its row leaves without disturbing the others. A job
whose deadline passed while it was queued is never started. With `max_batch=1` it decodes one
request at a time.

A failed step or prefill fails its own rows and the loop goes on. Anything else that escapes the
loop ends the thread: it is logged with its traceback and kept in `died`, every job running or
queued gets `Ended("engine_dead")` (a 503 at once, not a 504 when its deadline passes), new jobs are
refused, and `alive` turns False, so `GET /health` answers 503 and an orchestrator restarts the process.

The thread that decodes should be the one that loaded the models (`engine_thread()`; Service.start
does so). torch's CPU kernels run on OpenMP, and libgomp gives every thread that has run a parallel
region its own team of workers, kept while that thread lives. Once the process has more such
workers than CPUs, libgomp stops spinning between regions and parks its workers, and each of the
hundreds of small regions in a decoding step then waits for a wake-up: measured on 2 cores, 72 ms
per token when a model loaded on another live thread (uvicorn's thread pool) decodes on this one,
36 ms when one thread does both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.decoding.request import Request
from adaptive_spec.decoding.row import Row
from adaptive_spec.engine import Chunk, GenerationOutput, InputError

log = logging.getLogger(__name__)

_STOP = object()


class Rejected(Exception):
    """The job was not queued: `reason` is "queue_full", "shutting_down" or "engine_dead"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Reservation:
    """A place in the engine's queue (`EngineWorker.reserve`); released once, by `submit` or by its holder."""

    def __init__(self, worker: EngineWorker) -> None:
        self._worker: EngineWorker | None = worker

    def release(self) -> None:
        if self._worker is not None:
            self._worker._give_back()
            self._worker = None


class Ended(Exception):
    """The job stopped before its output: `reason` is "timeout", "disconnect", "shutdown" or "engine_dead"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Job:
    requests: list[Request]  # one per choice (Engine.requests): rows that share the prompt's prefill
    deadline: float  # time.monotonic() after which the job is stopped
    meta: dict[str, Any] = field(default_factory=dict)  # whatever on_end needs: the request id, ...
    arrived: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None
    finished: bool = False  # the final chunk of every choice was posted
    choices_done: int = 0

    def __post_init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._events: deque[Chunk | BaseException] = deque()  # posted, not yet read (touched on the loop only)
        self._waiter: asyncio.Future | None = None  # next_event waits on it while _events is empty
        self._cancelled = threading.Event()
        self._next_poll = 0.0  # when next_event next asks whether the client is still there

    @property
    def n(self) -> int:
        """Choices; each chunk says its own (Chunk.index)."""
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        return len(self.requests[0].prompt_ids)

    def cancel(self, reason: str) -> None:
        """Ask the worker to stop this job after the current step. The first reason given sticks."""
        if not self._cancelled.is_set() and not self.finished:
            self.cancel_reason = reason
            self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def post(self, item: Chunk | BaseException) -> None:
        """From the worker thread: hand a chunk or an error to the handler's event loop."""
        post_all([(self, item)])

    def _put(self, item: Chunk | BaseException) -> None:
        """On the loop: keep the item and wake next_event if it waits."""
        self._events.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake(waiter)

    async def next_event(self, request=None, poll_s: float = 0.25) -> Chunk:
        """The next chunk. Raises `Ended` on timeout or, when `request` is given, once the client has
        disconnected (checked every `poll_s`, also while chunks keep coming), and re-raises an
        error the engine hit."""
        while True:
            if request is not None and time.monotonic() >= self._next_poll:
                self._next_poll = time.monotonic() + poll_s
                if await request.is_disconnected():
                    self.cancel("disconnect")
                    raise Ended("disconnect")
            if not self._events:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    self.cancel("timeout")
                    raise Ended("timeout")
                # a bare future and a timer, not asyncio.wait_for on a queue: that made a task per chunk
                waiter = self._waiter = self._loop.create_future()
                timer = self._loop.call_later(min(poll_s, remaining), _wake, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
                continue
            item = self._events.popleft()
            if isinstance(item, BaseException):
                raise item
            return item

    def _should_stop(self) -> bool:
        if time.monotonic() > self.deadline:
            self.cancel("timeout")
        return self.cancelled


def post_all(items: list[tuple[Job, Chunk | BaseException]]) -> None:
    """From the worker thread: hand each job its item, with one wake-up per event loop (not one per job).

    A step of 8 rows posts 8 chunks; one call_soon_threadsafe each woke the server's loop 8 times a
    step, and the loop shares the 2 cores with the decoding step it waits on."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Chunk | BaseException]]] = {}
    for job, item in items:
        by_loop.setdefault(job._loop, []).append((job, item))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is gone (server stopped); nobody is waiting
            loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[Job, Chunk | BaseException]]) -> None:
    for job, item in batch:
        job._put(item)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def engine_thread() -> ThreadPoolExecutor:
    """One thread for all of the engine's torch work: build the engine with `.submit(...).result()`,
    then hand it to `EngineWorker(..., thread=...)` to decode on the same thread."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-worker")


class EngineWorker:
    def __init__(
        self,
        engine,
        queue_size: int,
        max_batch: int = 8,
        on_end: Callable[[Job, GenerationOutput | None, int], None] | None = None,
        on_step: Callable[[int, int], None] | None = None,
        thread: Executor | None = None,
    ) -> None:
        """`on_end(job, output, index)` runs on this thread after each choice of a job (output None,
        index 0: the job was cancelled).
        `on_step(rows, k)` runs after each decoding step with the batch size and the k drafted.
        `thread`: the single-thread executor that built the engine (`engine_thread()`), to decode
        on; without one the worker starts a thread of its own."""
        self.engine = engine
        self.max_batch = max_batch
        self.on_end = on_end
        self.on_step = on_step
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._places = threading.Lock()  # the queue's places taken by requests still being checked
        self._reserved = 0
        self._closing = False
        self._active: dict[Row, tuple[Job, int]] = {}  # the jobs decoding now and the choice, by row
        self._waiting: Job | None = None  # taken from the queue, waiting for room for its n rows
        self._executor = thread
        self._done = threading.Event()  # set when the decoding loop has returned
        self.died: BaseException | None = None  # what ended the decoding loop, if anything did but close()

    def start(self) -> None:
        if self._executor is not None:
            self._executor.submit(self._run)
        else:
            threading.Thread(target=self._run, name="engine-worker", daemon=True).start()

    def reserve(self) -> Reservation:
        """A place in the queue, taken before the request is tokenised and its grammar compiled: with the
        queue full (queued jobs plus places already taken), Rejected("queue_full") costs nothing more. Hand
        it to `submit`, or `release` it when the request turns out bad."""
        if self.died is not None:
            raise Rejected("engine_dead")
        if self._closing:
            raise Rejected("shutting_down")
        with self._places:
            if self._queue.qsize() + self._reserved >= self._queue.maxsize:
                raise Rejected("queue_full")
            self._reserved += 1
        return Reservation(self)

    def _give_back(self) -> None:
        with self._places:
            self._reserved -= 1

    def submit(self, job: Job, reservation: Reservation | None = None) -> None:
        if reservation is not None:
            reservation.release()  # its place is this job's now
        if self.died is not None:
            raise Rejected("engine_dead")
        if self._closing:
            raise Rejected("shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Rejected("queue_full") from None
        if self.died is not None:  # it died while this job went in: nobody else will end it
            self._fail_everything()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        """Requests decoding now (a request with n choices counts once)."""
        return len({id(job) for job, _ in self._active.values()})

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        """The decoding loop runs (or is draining after close()); False once something killed it."""
        return self.died is None

    def close(self, timeout: float) -> None:
        """Refuse new jobs, let queued and running ones finish for up to `timeout` s, cancel the rest."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while (self.waiting or self.running) and time.monotonic() < deadline:
            time.sleep(0.02)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.cancel("shutdown")
            job.post(Ended("shutdown"))
        for job, _ in list(self._active.values()):
            job.cancel("shutdown")
        self._queue.put(_STOP)
        self._done.wait(timeout=10.0)
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        try:
            batch = self.engine.new_batch(self.max_batch)
            while True:
                if not self._admit(batch):
                    break
                if len(batch):
                    self._step(batch)
                self._drop_stopped(batch)
            for job in self._jobs():  # stopping: whatever still runs was cancelled
                job.cancel(job.cancel_reason or "shutdown")
                self._leave(batch, job, Ended(job.cancel_reason))
        except BaseException as exc:  # the thread's end: nobody reads its Future, so say it here
            self.died = exc
            log.critical("engine worker died: no request can be served until this process restarts", exc_info=True)
            self._fail_everything()
        finally:
            self._done.set()

    def _fail_everything(self) -> None:
        """After the loop died: every job it held or that waits in the queue ends now, as a 503."""
        jobs = [job for job, _ in self._active.values()] + ([self._waiting] if self._waiting else [])
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self._active.clear()
        for job in {id(job): job for job in jobs if isinstance(job, Job)}.values():
            job.cancel("engine_dead")
            job.post(Ended("engine_dead"))
            self._end(job, None)

    def _admit(self, batch) -> bool:
        """Move queued jobs into the batch while it has room; wait for one when nothing runs.
        Returns False once the worker is told to stop. Jobs of one choice that are admitted together
        join in one call, so that their prompts are prefilled together (Batch.add_many)."""
        arriving: list[Job] = []
        try:
            while True:
                job = self._waiting
                self._waiting = None
                if job is None:
                    try:
                        job = self._queue.get() if not len(batch) and not arriving else self._queue.get_nowait()
                    except queue.Empty:
                        return True
                if job is _STOP:
                    return False
                if job._should_stop():
                    job.post(Ended(job.cancel_reason))
                    self._end(job, None)
                    continue
                if job.n > batch.max_rows:
                    job.post(
                        InputError(f"n={job.n} choices need {job.n} rows; this server decodes {batch.max_rows} at once")
                    )
                    continue
                if len(batch) + len(arriving) + job.n > batch.max_rows:
                    self._waiting = job  # first in line once rows free up
                    return True
                if job.n == 1:
                    arriving.append(job)
                    continue
                self._add([job], batch.add_group, job.requests)
        finally:
            if arriving:
                self._add(arriving, batch.add_many, [job.requests[0] for job in arriving])

    def _add(self, jobs: list[Job], add: Callable[[list], list], requests: list) -> None:
        """Rows for the jobs' requests (`add`: Batch.add_group or add_many, rows in the requests' order); a
        failure fails those jobs, not the worker."""
        try:
            rows = add(requests)
        except Exception as exc:
            if len(jobs) > 1:  # requests prefilled together, one of which may be at fault: each alone now
                log.warning("engine worker: a prefill of %d requests together failed (%s); each alone", len(jobs), exc)
                for job, request in zip(jobs, requests, strict=True):
                    self._add([job], add, [request])
                return
            if not isinstance(exc, InputError):
                log.exception("engine worker: prefill failed")
            for job in jobs:
                job.post(exc)
            return
        choices = [(job, index) for job in jobs for index in range(job.n)]  # the rows' order
        for row, choice in zip(rows, choices, strict=True):
            self._active[row] = choice

    def _step(self, batch) -> None:
        try:
            results = batch.step()
        except Exception as exc:  # a failed step fails every row in it; the worker goes on
            log.exception("engine worker: decoding step failed")
            for job in self._jobs():
                self._leave(batch, job, exc, cancelled=False)
            return
        if self.on_step is not None:
            try:
                self.on_step(*batch.last_step)
            except Exception:  # a metrics hook must not stop the engine
                log.exception("engine worker: after-step hook failed")
        posts, ended = [], []
        for row, chunk in results:
            if row not in self._active:  # a row no job owns would end the thread here: it leaves, loudly
                log.error("engine worker: a row of the batch belongs to no job; it leaves the batch")
                batch.remove(row)
                continue
            job, chunk.index = self._active[row]
            posts.append((job, chunk))
            if chunk.output is None:
                continue
            del self._active[row]  # the batch took the finished row out itself
            job.choices_done += 1
            job.finished = job.choices_done == job.n
            ended.append((job, chunk))
        post_all(posts)  # the step's chunks in one hand-off, before the finished requests' hooks
        for job, chunk in ended:
            self._end(job, chunk.output, chunk.index)

    def _drop_stopped(self, batch) -> None:
        """The rows of a job that was cancelled or passed its deadline leave before the next step."""
        for job in self._jobs():
            if job._should_stop():
                self._leave(batch, job, Ended(job.cancel_reason))

    def _jobs(self) -> list[Job]:
        return list({id(job): job for job, _ in self._active.values()}.values())

    def _leave(self, batch, job: Job, error: BaseException, cancelled: bool = True) -> None:
        """Take every row of `job` out of the batch and tell its handler why."""
        for row in [row for row, (owner, _) in self._active.items() if owner is job]:
            batch.remove(row)
            del self._active[row]
        job.post(error)
        if cancelled:
            self._end(job, None)

    def _end(self, job: Job, output: GenerationOutput | None, index: int = 0) -> None:
        if self.on_end is None or (output is None and not job.cancelled):
            return
        try:
            self.on_end(job, output, index)
        except Exception:
            log.exception("engine worker: after-request hook failed")
