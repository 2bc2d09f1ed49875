"""How the trainer tells operators what it does or waits for.

    status = TrainerStatus(redis_client, consumer="trainer-1")
    status.report(result, champion="v0004")   # "waiting", "promoted" or "not promoted", with the gate's reason

The status goes to the Redis key `adaptive_spec:trainer_status` as a `TrainerStatusRecord`
(adaptive_spec/formats/status.py: the one schema, which the dashboard reads back), expiring after a day so a
stopped trainer's last word does not stay forever, and to the trainer's log when it changes.
Writing it never raises: a status is worth less than a round.
"""

from __future__ import annotations

import logging
import math
import time

import redis

from adaptive_spec.contracts import TRAINER_STATUS_KEY
from adaptive_spec.formats.status import TrainerStatusRecord
from trainer.loop.rounds import RoundResult

log = logging.getLogger("trainer.loop.online")

STATUS_TTL_S = 86400
REWRITE_S = 30.0  # an unchanged status is written again after this long, so its age stays true


class TrainerStatus:
    """The trainer's last word for operators: logged when it changes, kept in Redis for the dashboard."""

    def __init__(self, client: redis.Redis | None, consumer: str) -> None:
        self.client, self.consumer = client, consumer
        self.last: str | None = None
        self.rejected: dict[str, int] = {}  # the rejected records last reported, by reason
        self.failure: dict | None = None  # the last round that raised, in every status written after it
        self._written: tuple | None = None  # what the last write to Redis said
        self._written_at = -math.inf  # monotonic time of the last write to Redis

    def round_failed(self, message: str, rounds_failed: int) -> None:
        """A round raised (trainer/loop/rounds.py `Rounds.failed`): every status from now on says so, whatever
        its message, and the next report is written at once."""
        self.failure = {"message": message, "at": time.time(), "rounds_failed": rounds_failed}
        self._written = None

    def report(self, result: RoundResult, champion: str | None = None, rejected: dict[str, int] | None = None) -> dict:
        """Record what `result` says, and the records the screen rejected so far by reason
        (trainer/intake/screening.py); returns the status written."""
        self.rejected = dict(rejected or {})
        state = "promoted" if result.promoted else "not promoted" if result.trained else "waiting"
        record = TrainerStatusRecord(
            state,
            result.reason,
            self.consumer,
            time.time(),
            round=result.round,
            domain=result.domain,
            champion=champion,
            candidate=result.candidate.as_dict() if result.candidate else None,
            champion_figures=result.champion.as_dict() if result.champion else None,
            rejected_records=sum(self.rejected.values()),
            rejected_by_reason=self.rejected,
            last_failure=self.failure,
        )
        status = record.as_dict()
        changed = result.reason != self.last
        if state == "waiting" and changed:  # a trained round logs itself (online.py)
            log.info("waiting: %s", result.reason)
        self.last = result.reason
        said = (result.reason, record.rejected_records)
        if said == self._written and time.monotonic() - self._written_at < REWRITE_S:
            return status  # the same word again: the dashboard's copy is fresh enough
        self._written, self._written_at = said, time.monotonic()
        if self.client is not None:
            try:
                self.client.set(TRAINER_STATUS_KEY, record.to_json(), ex=STATUS_TTL_S)  # the API nulls NaN
            except redis.RedisError as exc:
                log.debug("trainer status not written: %s", exc)
        return status
