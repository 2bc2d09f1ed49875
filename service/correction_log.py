"""Appends correction records to the Redis stream without ever making a request wait.

    writer = CorrectionLogWriter(settings.redis_url)
    writer.submit(record)      # from the serving loop: encodes, enqueues, returns at once
    writer.log(output, request_id=..., domain="sql", target_id=..., draft_id=..., temperature=0.0)  # the same, built
                               # from an Engine output: the service and bench-drift log through it
    writer.counters()          # {"submitted": .., "written": .., "dropped": .., "queue_depth": .., ...}
    writer.close(timeout=5.0)  # at shutdown: flush what Redis accepts in time, then stop

submit() encodes the record and appends the bytes to a bounded in-memory queue. One daemon
thread drains the queue in batches, each batch one pipeline of
`XADD adaptive_spec:corrections MAXLEN ~ <cap> * r <bytes>`.

The stream is bounded twice: by a count (`maxlen`, ADAPTIVE_SPEC_STREAM_MAXLEN, 100,000) and by bytes
(`max_bytes`, ADAPTIVE_SPEC_STREAM_MAX_BYTES, 1 GiB). Redis trims only by count, so `cap` turns the
budget into a count from the mean size of the records this writer writes. The arithmetic: a record
holds, per output token, its id, the proposal, the acceptance bit and the target's top-m ids and fp16
log-probabilities (m = 16: 16 x 4 + 16 x 2 = 96 bytes), so 64 tokens make about 4.7 kB and 2,048
tokens about 156 kB. At 4.7 kB, 100,000 records are 480 MB, under the budget; at 156 kB the count
would allow 15.6 GB, and the budget keeps 6,880 records, 1 GiB. `MAXLEN ~` trims whole listpack nodes
(100 entries), so the stream may exceed either cap by up to one node (15.6 MB at the largest
records). Replicas share the stream and each applies its own cap at every write: with similar
traffic they agree; the smallest wins while its writes come in. The shipped Redis keeps at most 2 GB
and never evicts (ops/compose.yaml, ops/k8s): the budget leaves room for the dashboard and the
consumer group.

Faults (DESIGN.md "Behaviour under faults"):

- Redis down or slow: a failed batch stays at the head of the queue and is retried with
  exponential backoff (0.05 s doubling to `max_backoff_s`). Socket timeouts are short
  (0.5 s) and redis-py's own retries are off, so the thread notices quickly and `close()`
  is never stuck for long. New records queue behind the head until the queue holds
  `queue_size` records; after that submit() drops the new record, counts it and returns
  False. Writing resumes by itself when Redis answers again.
- Why drop the newest, not the oldest: producers only ever touch the tail and the writer
  thread only the head, so a batch being retried can never be dropped from under it.
  Both choices lose the same number of records during an outage.
- Delivery is at-least-once. A batch that timed out may have been applied by Redis before
  the reply was lost; the retry then appends it again. A duplicate is one more training
  example with the same `request_id`, which is far cheaper than losing records on every
  timeout. The alternative, client-chosen stream ids, would break as soon as two servers
  with skewed clocks share the stream. Consumers that care can dedupe by `request_id`.
- Invalid records (encode() raises) are dropped and counted in `dropped` and in `invalid`.

Invariant, under the lock at every instant: submitted == written + dropped + queue_depth.
A record counts as written only after Redis acknowledged its XADD. close() counts whatever
it could not flush in time as dropped, so after close() queue_depth is 0.
Memory is bounded by queue_size encoded records (about 4.7 kB each for 64 output tokens at m=16).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from itertools import islice

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD
from adaptive_spec.formats.record import CorrectionRecord, record_from_output

log = logging.getLogger(__name__)

ENTRY_OVERHEAD = 64  # bytes a stream entry costs Redis besides its payload: its id, the field name, listpack headers


class CorrectionLogWriter:
    def __init__(
        self,
        redis_url: str,
        stream: str = CORRECTION_STREAM,
        maxlen: int = 100_000,
        queue_size: int = 1024,
        *,
        max_bytes: int = 1 << 30,
        batch_size: int = 64,
        socket_timeout: float = 0.5,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.stream = stream
        self.maxlen = maxlen
        self.max_bytes = max_bytes
        self._mean_bytes: float | None = None  # an exponential mean of the records' sizes, with the entry overhead
        self.queue_size = queue_size
        self.batch_size = batch_size
        self.max_backoff_s = max_backoff_s
        self._socket_timeout = socket_timeout
        self._redis = redis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),  # this class retries, with its own backoff
        )
        self._queue: deque[bytes] = deque()  # encoded records; producers append, the writer pops
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._wake = threading.Event()  # cuts a backoff sleep short on close()
        self._closing = False
        self._close_deadline = 0.0
        self._submitted = self._written = self._dropped = self._invalid = self._errors = 0
        self._failing = False  # for logging an outage once, not per retry
        self._thread = threading.Thread(target=self._run, name="correction-log-writer", daemon=True)
        self._thread.start()

    def submit(self, record: CorrectionRecord) -> bool:
        """Queue one record. Never blocks on Redis and never raises; False means it was dropped."""
        try:
            payload = record.encode()
        except Exception:
            log.exception("correction record %r is invalid; dropped", getattr(record, "request_id", None))
            with self._lock:
                self._submitted += 1
                self._dropped += 1
                self._invalid += 1
            return False
        with self._lock:
            self._submitted += 1
            if self._closing or len(self._queue) >= self.queue_size:
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 1000 == 0:
                    log.warning("correction log queue full or closed: %d records dropped so far", self._dropped)
                return False
            self._queue.append(payload)
            self._has_work.notify()
            return True

    def log(
        self, output, *, request_id: str, domain: str | None, target_id: str, draft_id: str, temperature: float
    ) -> bool:
        """Queue the correction record of one finished generation (an Engine GenerationOutput); as submit()."""
        record = record_from_output(
            output,
            request_id=request_id,
            created_at=time.time(),
            domain=domain,
            target_id=target_id,
            draft_id=draft_id,
            temperature=temperature,
        )
        return self.submit(record)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the queue is empty (True) or the timeout passes (False). For tests and shutdown."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.queue_depth == 0:
                return True
            time.sleep(0.01)
        return self.queue_depth == 0

    def close(self, timeout: float = 5.0) -> None:
        """Write what Redis accepts within `timeout`, count the rest as dropped, stop the thread."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._close_deadline = time.monotonic() + timeout
            self._has_work.notify()
        self._wake.set()
        # The thread checks the deadline between batches; one batch can take a socket timeout more.
        self._thread.join(timeout + 2 * self._socket_timeout + 1.0)
        self._redis.close()

    @property
    def submitted(self) -> int:
        with self._lock:
            return self._submitted

    @property
    def written(self) -> int:
        with self._lock:
            return self._written

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def errors(self) -> int:
        """Failed XADD batches (each retried), not records."""
        with self._lock:
            return self._errors

    @property
    def alive(self) -> bool:
        """The writing thread runs (or flushes after close()). Dead, records queue up and are then dropped
        and counted, as while Redis is away; serving goes on (`GET /health` reports it, service/routers/ops.py)."""
        return self._thread.is_alive() or self._closing

    def counters(self) -> dict[str, int]:
        """A consistent snapshot: submitted == written + dropped + queue_depth."""
        with self._lock:
            return {
                "submitted": self._submitted,
                "written": self._written,
                "dropped": self._dropped,
                "queue_depth": len(self._queue),
                "errors": self._errors,
                "invalid": self._invalid,
            }

    def _run(self) -> None:
        try:
            self._write_until_closed()
        except BaseException:  # what a write cannot catch ends the thread: say so, /health reports it
            log.critical("the correction-log writer died: records are queued, then dropped", exc_info=True)

    def _write_until_closed(self) -> None:
        backoff = 0.0
        while True:
            with self._has_work:
                while not self._queue and not self._closing:
                    self._has_work.wait()
                if not self._queue or (self._closing and time.monotonic() >= self._close_deadline):
                    self._dropped += len(self._queue)  # close() gave up on these
                    self._queue.clear()
                    return
                batch = list(islice(self._queue, self.batch_size))  # peek: they stay queued until written
            try:
                failed = self._write(batch)
            except Exception as error:
                self._on_error(error, len(batch))
                backoff = min(self.max_backoff_s, max(0.05, backoff * 2))
                self._sleep(backoff)
                continue
            with self._lock:
                for _ in batch:
                    self._queue.popleft()
                self._queue.extendleft(reversed(failed))  # keep them at the head, in order
                self._written += len(batch) - len(failed)
                if failed:
                    self._errors += 1
            if failed:
                backoff = min(self.max_backoff_s, max(0.05, backoff * 2))
                self._sleep(backoff)
            else:
                backoff = 0.0
                if self._failing:
                    self._failing = False
                    log.info("correction log writing resumed (%s)", self.counters())

    def _write(self, batch: list[bytes]) -> list[bytes]:
        """XADD every payload in one round trip; return those Redis refused (e.g. OOM)."""
        pipe = self._redis.pipeline(transaction=False)
        for payload in batch:
            pipe.xadd(self.stream, {PAYLOAD_FIELD: payload}, maxlen=self.cap(len(payload)), approximate=True)
        results = pipe.execute(raise_on_error=False)  # connection errors still raise
        failed = [payload for payload, result in zip(batch, results, strict=True) if isinstance(result, Exception)]
        if failed:
            first = next(result for result in results if isinstance(result, Exception))
            self._log_failure(first, len(failed))
        return failed

    def cap(self, size: int) -> int:
        """The MAXLEN for the next entry: `maxlen`, or fewer when the byte budget binds. Redis trims by count,
        so the budget becomes a count through the mean entry size: max_bytes / (mean record + ENTRY_OVERHEAD).
        Example: records of 4.7 kB (64 tokens, m = 16) under 1 GiB give 225,000, so the count cap of 100,000
        binds (about 480 MB); records of 156 kB (2,048 tokens) give 6,880 (1 GiB)."""
        sample = size + ENTRY_OVERHEAD
        self._mean_bytes = sample if self._mean_bytes is None else 0.95 * self._mean_bytes + 0.05 * sample
        return max(1, min(self.maxlen, int(self.max_bytes / self._mean_bytes)))

    def _on_error(self, error: Exception, batch_len: int) -> None:
        with self._lock:
            self._errors += 1
        self._log_failure(error, batch_len)

    def _log_failure(self, error: Exception, count: int) -> None:
        if not self._failing:
            self._failing = True
            log.warning(
                "correction log: XADD of %d records to %s failed (%s: %s); retrying with backoff",
                count,
                self.stream,
                type(error).__name__,
                error,
            )

    def _sleep(self, seconds: float) -> None:
        if self._closing:  # _wake is already set; sleep for real, but not past the deadline
            time.sleep(min(seconds, max(0.0, self._close_deadline - time.monotonic())))
        else:
            self._wake.wait(seconds)
