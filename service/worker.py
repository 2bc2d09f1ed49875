"""One engine thread behind a bounded queue, and the bridge between it and asyncio handlers.

    worker = EngineWorker(engine, queue_size=32, on_end=service.request_ended)
    worker.start()
    job = Job(prompt_ids, params, deadline=time.monotonic() + 300)
    worker.submit(job)                      # Rejected("queue_full") when 32 are already waiting
    chunk = await job.next_event(request)   # engine Chunks, in order; the last one carries the output
    worker.close(timeout=30)                # refuse new jobs, finish the queued ones, stop

The engine decodes one request at a time (its caches are per engine), so one thread owns it
and HTTP handlers never touch the models: they await the chunks this thread posts onto their
event loop. A job stops between decoding steps, never inside one, when its handler cancels it
(timeout, client gone, shutdown) or its deadline passes; closing the engine's stream then frees
the engine for the next job at once. A job whose deadline passed while it was queued is never
started.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.engine import Chunk, GenerationOutput, InputError

log = logging.getLogger(__name__)

_STOP = object()


class Rejected(Exception):
    """The job was not queued: `reason` is "queue_full" or "shutting_down"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Ended(Exception):
    """The job stopped before its output: `reason` is "timeout", "disconnect" or "shutdown"."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: dict[str, Any]  # keyword arguments of Engine.stream
    deadline: float  # time.monotonic() after which the job is stopped
    meta: dict[str, Any] = field(default_factory=dict)  # whatever on_end needs: request id, domain, ...
    arrived: float = field(default_factory=time.monotonic)
    cancel_reason: str | None = None
    finished: bool = False  # the final chunk was posted

    def __post_init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._next_poll = 0.0  # when next_event next asks whether the client is still there

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
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the loop is gone (server stopped); nobody is waiting
            pass

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
            try:
                item = self._events.get_nowait()
            except asyncio.QueueEmpty:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    self.cancel("timeout")
                    raise Ended("timeout") from None
                try:
                    item = await asyncio.wait_for(self._events.get(), timeout=min(poll_s, remaining))
                except asyncio.TimeoutError:
                    continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _should_stop(self) -> bool:
        if time.monotonic() > self.deadline:
            self.cancel("timeout")
        return self.cancelled


class EngineWorker:
    def __init__(
        self, engine, queue_size: int, on_end: Callable[[Job, GenerationOutput | None], None] | None = None
    ) -> None:
        """`on_end(job, output)` runs on this thread after each job: output None means it was cancelled."""
        self.engine = engine
        self.on_end = on_end
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closing = False
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closing:
            raise Rejected("shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise Rejected("queue_full") from None

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return int(self._running is not None)

    @property
    def closing(self) -> bool:
        return self._closing

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
        running = self._running
        if running is not None:
            running.cancel("shutdown")
        self._queue.put(_STOP)
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            self._running = job
            try:
                output = self._serve(job)
                if self.on_end is not None and (output is not None or job.cancelled):
                    self.on_end(job, output)
            except Exception:
                log.exception("engine worker: after-request hook failed")
            finally:
                self._running = None

    def _serve(self, job: Job) -> GenerationOutput | None:
        """Decode one job, posting each chunk; return its output, or None if it stopped early."""
        if job._should_stop():
            job.post(Ended(job.cancel_reason))
            return None
        try:
            with closing(self.engine.stream(job.prompt_ids, **job.params)) as stream:
                for chunk in stream:
                    if chunk.output is not None:
                        job.finished = True
                        job.post(chunk)
                        return chunk.output
                    job.post(chunk)
                    if job._should_stop():
                        job.post(Ended(job.cancel_reason))
                        return None
        except InputError as exc:
            job.post(exc)
        except Exception as exc:
            log.exception("engine worker: generation failed")
            job.post(exc)
        return None
