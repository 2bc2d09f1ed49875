"""Stream intake: correction records from the consumer group into the held-out set or the replay buffer,
each entry acknowledged only once what it contributed is safe.

    intake = StreamIntake(CorrectionStream(redis_url, consumer="trainer-1"), lineages,   # trainer/loop/domains.py
                          max_seq_len=1024, ack_at_once=False)
    intake.poll(block_ms=1000)        # -> how many records came
    ...write a checkpoint that holds intake.holdout and intake.encoded_buffer()...
    intake.ack(covered)               # the entries that checkpoint covers

`poll()` takes, in order: on its first call the consumer's own pending entries (XREADGROUP id 0:
what this consumer name read before a restart and never acknowledged), then entries another
consumer left idle for `reclaim_idle_ms` (XAUTOCLAIM), then new ones, waiting up to `block_ms`
only when nothing pending or reclaimable came first. Each record goes to its lineage's held-out set
(HoldoutSplit, about 1 in 10 by a hash of its request id) or, as a training example, to its replay
buffer, and counts as new for that lineage's next round (`Lineage.new_records`). Duplicates (same
request id) are dropped there and counted. A record the screen refuses (trainer/intake/screening.py:
another model's, an id past the vocabulary, ...) is acknowledged at once, counted in `rejected` by
reason and dropped; so is one met again in a checkpoint written before the screen existed.

Acknowledgement (at-least-once, DESIGN.md "Trainer killed mid-batch"):

- `ack_at_once=False` (a trainer with a checkpoint directory): an entry stays pending until the
  trainer has written a checkpoint that contains what it contributed, then acknowledges the ids
  `unacked` listed when that checkpoint began. A trainer killed at any point loses nothing: the
  entries come back, to the same consumer name at once (XREADGROUP 0) or to any other after
  `reclaim_idle_ms` (XAUTOCLAIM). Checkpoint well within `reclaim_idle_ms`, or a second trainer may
  claim entries this one holds unacknowledged.
- `ack_at_once=True`: entries are acknowledged as soon as they are routed. A crash then loses the
  in-memory buffer, so this is for tests and benchmarks, not for a long-lived trainer.

Tests: `.venv/bin/python -m pytest tests/trainer/test_online.py -q` (a real redis-server).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator
from typing import Protocol

import redis

from adaptive_spec.formats.record import CorrectionRecord
from trainer.intake.buffer import HoldoutSplit, ReplayBuffer
from trainer.intake.examples import examples_from_record
from trainer.intake.screening import RecordScreen
from trainer.intake.stream import CorrectionStream

log = logging.getLogger(__name__)

UNTAGGED = "untagged"  # the domain_mix key of records without a domain
COUNTERS = ("records_consumed", "tokens_consumed", "duplicates", "rejected")  # what a checkpoint keeps


class Split(Protocol):
    """One lineage's share of the records (trainer/loop/domains.py `Lineage`)."""

    holdout: HoldoutSplit
    buffer: ReplayBuffer
    new_records: int


class Lineages(Protocol):
    """Where a record goes (trainer/loop/domains.py `DomainLineages`): the general split, or its domain's."""

    general: Split
    lineages: dict[str, Split]  # the domains'

    def route(self, record: CorrectionRecord) -> Split | None: ...


class StreamIntake:
    """What the trainer has taken from the stream: the held-out set, the replay buffer, the counters."""

    def __init__(
        self,
        stream: CorrectionStream,
        lineages: Lineages,
        max_seq_len: int,
        *,
        screen: RecordScreen,
        ack_at_once: bool,
        read_count: int = 64,
        reclaim_idle_ms: int = 60_000,
    ) -> None:
        self.stream = stream
        self.lineages = lineages
        self.holdout, self.buffer = lineages.general.holdout, lineages.general.buffer  # hold every record
        self.max_seq_len = max_seq_len
        self.screen = screen
        self.ack_at_once = ack_at_once
        self.read_count = read_count  # entries per XREADGROUP / XAUTOCLAIM
        self.reclaim_idle_ms = reclaim_idle_ms
        self.records_consumed = 0  # distinct records taken from the stream (held out or for training)
        self.tokens_consumed = 0  # their output tokens
        self.duplicates = 0  # records dropped because their request id was already kept
        self.rejected: dict[str, int] = {}  # records the screen refused, by reason (trainer/intake/screening.py)
        self._unacked: dict[str, None] = {}  # stream entry ids routed but not yet acknowledged, in order
        self._buffered: OrderedDict[str, tuple[str | None, bytes]] = OrderedDict()  # the buffer's records
        self._reread_own_pending = True

    @property
    def unacked(self) -> list[str]:
        return list(self._unacked)

    def poll(self, block_ms: int | None = 1000) -> int:
        """Take what the stream has for this consumer, route it, and return how many records came."""
        received = 0
        if self._reread_own_pending:
            received += self._route(self._own_pending())
            self._reread_own_pending = False
        claimed = self.stream.reclaim(self.reclaim_idle_ms, count=self.read_count)
        received += self._route(claimed)
        waited = None if received or claimed else (block_ms or None)
        received += self._route(self.stream.read(count=self.read_count, block_ms=waited))
        if received:
            log.debug("polled %d records: %d buffered, %d held out", received, len(self.buffer), len(self.holdout))
        return received

    def keep(self, record: CorrectionRecord) -> bool:
        """Held out, or into the replay buffer as a training example; duplicates are dropped. False when
        the screen refuses it (counted in `rejected`): nothing of it is kept.

        A record whose domain has a lineage (trainer/loop/domains.py) is held out or not by its domain's
        split, and a held-out one is held out of the general set too; one for training goes into both
        buffers and counts as new for its domain's rounds only."""
        refused = self.screen.check(record)
        if refused is not None:
            self._reject(record, *refused)
            return False
        lineage = self.lineages.route(record)  # None: the general adapter's alone
        parts = [self.holdout, self.buffer] + ([lineage.holdout, lineage.buffer] if lineage is not None else [])
        duplicates = sum(part.duplicates for part in parts)
        if lineage is not None and lineage.holdout.add(record):
            self.holdout.hold(record)
        elif lineage is not None or not self.holdout.add(record):
            example = examples_from_record(record, self.max_seq_len)
            evicted = self.buffer.evicted
            if self.buffer.add(example):
                self._buffered[record.request_id] = (record.domain, record.encode())
                for _ in range(self.buffer.evicted - evicted):  # the buffer evicts oldest first, as this mirror
                    self._buffered.popitem(last=False)
                self.lineages.general.new_records += lineage is None
            if lineage is not None and lineage.buffer.add(example):
                lineage.new_records += 1
        if sum(part.duplicates for part in parts) > duplicates:
            self.duplicates += 1
            return True
        self.records_consumed += 1
        self.tokens_consumed += len(record.output_ids)
        return True

    def _reject(self, record: CorrectionRecord, reason: str, detail: str) -> None:
        count = self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... of each reason: a flood logs a few lines
            log.warning(
                "rejected correction record %s (%s: %s); acknowledged and dropped, %d rejected for %s so far",
                record.request_id,
                reason,
                detail,
                count,
                reason,
            )

    def set_aside(self, request_ids: set[str]) -> int:
        """Take these records out of every held-out set and buffer (a round raised while it read them,
        trainer/loop/online.py): the next checkpoint holds none of them and acknowledges their entries.
        They stay remembered, so a copy that comes again is dropped as a duplicate. Returns how many went."""
        for lineage in self.lineages.lineages.values():
            lineage.holdout.drop(request_ids)
            lineage.buffer.drop(request_ids)
        for request_id in request_ids:
            self._buffered.pop(request_id, None)  # the mirror of the general buffer loses the same ones
        return self.holdout.drop(request_ids) + self.buffer.drop(request_ids)  # these two hold every record

    def ack(self, ids: Iterable[str] | None = None) -> None:
        """Acknowledge `ids` (all routed ids if None); on a Redis error they stay listed for the next try."""
        ids = list(self._unacked) if ids is None else list(ids)
        if not ids:
            return
        try:
            self.stream.ack(ids)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            log.warning("could not acknowledge %d entries (%s); they stay pending until the next try", len(ids), error)
            return
        for entry_id in ids:
            self._unacked.pop(entry_id, None)

    def counters(self) -> dict:
        return {name: getattr(self, name) for name in COUNTERS}

    def load_counters(self, counters: dict) -> None:
        """A checkpoint's counters (one it lacks stays as it is), once its records are kept again: the
        screen may have refused some of them (kept before it existed), counted on top."""
        refused, self.rejected = self.rejected, {}
        for name in COUNTERS:
            if name in counters:
                setattr(self, name, counters[name])
        for reason, count in refused.items():
            self.rejected[reason] = self.rejected.get(reason, 0) + count

    def encoded_buffer(self) -> Iterator[bytes]:
        """The replay buffer's records as they came (CorrectionRecord.encode()), oldest first."""
        return (encoded for _, encoded in self._buffered.values())

    def domain_mix(self, request_ids: set[str]) -> dict[str, int]:
        """How many of these buffered records came from each domain, e.g. {"json": 30, "untagged": 2}."""
        domains = Counter(self._buffered[rid][0] or UNTAGGED for rid in request_ids if rid in self._buffered)
        return dict(sorted(domains.items()))

    def target_tokens(self) -> list[int]:
        """The tokens the target chose (its top-1) in the buffered and held-out traffic, sorted.

        A domain's traffic uses a small part of the vocabulary: 64-token answers to a few hundred
        prompts of one kind touch about a thousand of the default model's 49152 tokens. A promoted
        draft is restricted to them (`DraftVocab.restrict`, drafters/vocab.py), which makes its step much cheaper.
        """
        return target_tokens(self.buffer, self.holdout)

    def _own_pending(self) -> list[tuple[str, CorrectionRecord]]:
        """Entries this consumer name read before (e.g. before a crash) and never acknowledged."""
        entries = self.stream.read_own_pending(self.read_count)
        if entries:
            log.info(
                "re-reading %d entries that consumer %s read before and never acknowledged",
                len(entries),
                self.stream.consumer,
            )
        return entries

    def _route(self, entries: list[tuple[str, CorrectionRecord]]) -> int:
        """Keep each entry's record and list its id; acknowledge at once when `ack_at_once`, and those the
        screen refused always (they hold nothing a checkpoint must keep). Returns how many came."""
        routed, refused = 0, []
        for entry_id, record in entries:
            if entry_id in self._unacked:  # ours already; XAUTOCLAIM handed it back after it idled
                continue
            routed += 1
            if not self.keep(record):
                refused.append(entry_id)
                continue
            self._unacked[entry_id] = None
        self.ack(refused)
        if self.ack_at_once:
            self.ack()
        return routed


def target_tokens(buffer: ReplayBuffer, holdout: HoldoutSplit) -> list[int]:
    """The target's top-1 tokens in a buffer's examples and a held-out set's outputs, sorted."""
    chosen = {int(t) for example in buffer for t in example.target_topk_ids[:, 0].tolist()}
    chosen |= {int(t) for record in holdout.records for t in record.output_ids}
    return sorted(chosen)
