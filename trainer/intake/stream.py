"""Reads correction records from the Redis stream through a consumer group (at-least-once).

    stream = CorrectionStream(settings.redis_url, consumer="trainer-1")
    stream.ensure_group()
    while True:
        batch = stream.reclaim(min_idle_ms=60_000) or stream.read(count=64, block_ms=1000)
        train_on([record for _, record in batch])
        stream.ack([entry_id for entry_id, _ in batch])   # only after the batch is used

An entry stays in the group's pending list until it is acknowledged. If the trainer dies
mid-batch, the next trainer (any consumer name) takes the entries over with `reclaim()`
(XAUTOCLAIM) once they have been idle for `min_idle_ms`, so no record is lost. Records can
therefore arrive twice, and the writer may also append a record twice (see
service/correction_log.py); train on duplicates or dedupe by `record.request_id`.

A URL gets a client with socket timeouts (`stream_client`): a Redis that stops answering (SIGSTOP, a
dead peer without a reset) raises TimeoutError, which the trainer's loop retries, instead of holding a
read forever. redis-py's own default for `from_url` has been none or 5 s depending on its version.

Entries that do not decode (foreign writers, a format version this build does not read) are
acknowledged, counted in `corrupt` and logged, so they never wedge the group. Entries that
`MAXLEN ~` trimmed away while pending are dropped from the pending list by XAUTOCLAIM itself;
they are counted in `trimmed`.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Iterable
from typing import Any

import redis

from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD, TRAINER_GROUP
from adaptive_spec.formats.record import CorrectionRecord

log = logging.getLogger(__name__)

_PAYLOAD = PAYLOAD_FIELD.encode()  # replies carry bytes keys: records are binary, so no decode_responses
SOCKET_TIMEOUT_S = 10.0  # above any XREADGROUP BLOCK the trainer asks for (1 s): a silent Redis raises, not hangs


def stream_client(redis_url: str) -> redis.Redis:
    """The trainer's Redis client: binary replies, and socket timeouts whatever redis-py's defaults are."""
    return redis.Redis.from_url(redis_url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5.0)


class CorrectionStream:
    def __init__(
        self,
        redis_client_or_url: redis.Redis | str,
        stream: str = CORRECTION_STREAM,
        group: str = TRAINER_GROUP,
        consumer: str | None = None,
    ) -> None:
        if isinstance(redis_client_or_url, str):
            self.redis = stream_client(redis_client_or_url)
        else:
            self.redis = redis_client_or_url
        if self.redis.get_connection_kwargs().get("decode_responses"):
            raise ValueError("CorrectionStream needs a Redis client with decode_responses=False: records are binary")
        self.stream = stream
        self.group = group
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.corrupt = 0  # entries acknowledged without being returned because they did not decode
        self.trimmed = 0  # pending entries that MAXLEN trimmed before anyone acknowledged them
        self._claim_cursor = "0-0"  # XAUTOCLAIM scans the pending list across calls

    def ensure_group(self) -> bool:
        """Create the group (and the stream) if missing, reading from the stream's start. True if created."""
        try:
            self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
            return False
        return True

    def read(self, count: int = 64, block_ms: int | None = 1000) -> list[tuple[str, CorrectionRecord]]:
        """New entries for this consumer (XREADGROUP ">"); waits up to block_ms for the first one."""
        response = self._with_group(
            lambda: self.redis.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        )
        return self._decode(_stream_entries(response))

    def read_own_pending(self, count: int = 64) -> list[tuple[str, CorrectionRecord]]:
        """Every entry delivered to this consumer name and never acknowledged (XREADGROUP from id 0).

        A trainer restarted under its old consumer name gets back what it had read before dying.
        """
        entries, after = [], "0"
        while True:
            page = _stream_entries(
                self._with_group(
                    functools.partial(
                        self.redis.xreadgroup, self.group, self.consumer, {self.stream: after}, count=count
                    )
                )
            )
            ids = [entry_id for entry_id, _ in page if entry_id is not None]
            if not ids:
                return entries
            entries += self._decode(page)
            after = ids[-1]

    def reclaim(self, min_idle_ms: int = 60_000, count: int = 64) -> list[tuple[str, CorrectionRecord]]:
        """Take over entries another consumer read but never acknowledged for min_idle_ms (XAUTOCLAIM).

        Each call continues the scan of the pending list where the last one stopped and wraps
        around at its end, so calling it once per batch eventually visits every pending entry.
        """
        next_cursor, entries, *rest = self._with_group(
            lambda: self.redis.xautoclaim(
                self.stream, self.group, self.consumer, min_idle_ms, start_id=self._claim_cursor, count=count
            )
        )
        self._claim_cursor = _text(next_cursor)
        deleted = rest[0] if rest else []  # Redis >= 7: ids trimmed away, now removed from the pending list
        if deleted:
            self.trimmed += len(deleted)
            log.warning("%d pending correction records were trimmed by MAXLEN before being acknowledged", len(deleted))
        return self._decode(entries)

    def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge entries once they are used; returns how many were pending."""
        ids = list(ids)
        if not ids:
            return 0
        return int(self.redis.xack(self.stream, self.group, *ids))

    def pending_count(self) -> int:
        """Entries delivered to some consumer of the group and not yet acknowledged (0 if no group)."""
        try:
            return int(self.redis.xpending(self.stream, self.group)["pending"])
        except redis.ResponseError as error:
            if "NOGROUP" in str(error):
                return 0
            raise

    def _with_group(self, command: Any) -> Any:
        """Run a group command, recreating the group once if it vanished (e.g. a Redis restart without persistence)."""
        try:
            return command()
        except redis.ResponseError as error:
            if "NOGROUP" not in str(error):
                raise
            log.warning("consumer group %s on %s was missing; recreating it", self.group, self.stream)
            self.ensure_group()
            return command()

    def _decode(self, entries: list[Any]) -> list[tuple[str, CorrectionRecord]]:
        records, corrupt_ids = [], []
        for entry_id, fields in entries:
            if entry_id is None:  # an entry deleted after delivery; nothing to decode
                continue
            entry_id = _text(entry_id)
            try:
                records.append((entry_id, CorrectionRecord.decode((fields or {})[_PAYLOAD])))
            except (KeyError, ValueError) as error:
                log.warning(
                    "correction stream entry %s does not decode (%s); acknowledging and skipping it", entry_id, error
                )
                corrupt_ids.append(entry_id)
        if corrupt_ids:
            self.ack(corrupt_ids)
            self.corrupt += len(corrupt_ids)
        return records


def _stream_entries(response: Any) -> list[Any]:
    """The entry list from an XREADGROUP reply on a single stream, RESP2 or RESP3 shaped."""
    if not response:
        return []
    if isinstance(response, dict):  # RESP3: {stream: [entries]}
        (entries,) = response.values()
        return entries[0] if entries and isinstance(entries[0], list) else entries
    ((_, entries),) = response  # RESP2: [[stream, entries]]
    return entries


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
