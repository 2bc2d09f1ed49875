"""What one round of the online trainer did, how a checkpoint keeps it, and how the trainer tells
operators what it does or waits for.

    status = TrainerStatus(redis_client, consumer="trainer-1")
    status.report(result, "v0003", {"vocab": 2})   # "waiting", "promoted" or "not promoted", with the gate's
                                                   # reason, the champion and the records rejected by reason

The status goes to the Redis key `adaptive_spec:trainer_status` (JSON, expires after a day so a
stopped trainer's last word does not stay forever) and to the trainer's log when it changes; the
dashboard's summary shows it (service/routers/dashboard.py). Writing it never raises: a status is
worth less than a round.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass

import redis

from adaptive_spec.contracts import TRAINER_STATUS_KEY
from trainer.gate import GateFigures

log = logging.getLogger("trainer.online")

STATUS_TTL_S = 86400
REWRITE_S = 30.0  # an unchanged status is written again after this long, so its age stays true


@dataclass(frozen=True)
class RoundResult:
    """What one call of train_round() did. `trained` is False when it was not time for a round."""

    trained: bool
    promoted: bool
    reason: str  # the gate's reason, or why no round ran
    round: int = 0  # rounds trained so far, this one included (0 when it did not train)
    steps: int = 0
    loss: float = math.nan  # mean of the round's step losses
    first_loss: float = math.nan
    last_loss: float = math.nan
    new_records: int = 0  # training records that arrived since the previous round
    train_s: float = 0.0  # wall time of the train steps
    candidate: GateFigures | None = None
    champion: GateFigures | None = None
    version: int | None = None  # the new champion's version when promoted
    domain: str | None = None  # whose lineage (trainer/domains.py); None: the general adapter


def versus(candidate: GateFigures, champion: GateFigures) -> str:
    return (
        f"greedy match {candidate.greedy_match:.4f} vs champion {champion.greedy_match:.4f}, "
        f"expected acceptance {candidate.expected_acceptance:.4f} vs {champion.expected_acceptance:.4f}"
    )


def result_state(result: RoundResult) -> dict:
    """A round's result as state.json keeps it: the gate's figures without their per-record scores."""
    state = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    for side in ("candidate", "champion"):
        state[side] = state[side].as_dict() if state[side] is not None else None
    return state


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
        """A round raised (trainer/online.py `_round_failed`): every status from now on says so, whatever its
        message, and the next report is written at once."""
        self.failure = {"message": message, "at": time.time(), "rounds_failed": rounds_failed}
        self._written = None

    def report(self, result: RoundResult, champion: str | None = None, rejected: dict[str, int] | None = None) -> dict:
        """Record what `result` says, and the records the screen rejected so far by reason (trainer/screening.py);
        returns the status written."""
        self.rejected = dict(rejected or {})
        state = "promoted" if result.promoted else "not promoted" if result.trained else "waiting"
        status = {
            "state": state,
            "message": result.reason,
            "consumer": self.consumer,
            "at": time.time(),
            "round": result.round,
            "domain": result.domain,
            "champion": champion,
            "candidate": result.candidate.as_dict() if result.candidate else None,
            "champion_figures": result.champion.as_dict() if result.champion else None,
            "rejected_records": sum(self.rejected.values()),
            "rejected_by_reason": self.rejected,
            "last_failure": self.failure,
        }
        changed = result.reason != self.last
        if state == "waiting" and changed:  # a trained round logs itself (online.py)
            log.info("waiting: %s", result.reason)
        self.last = result.reason
        said = (result.reason, status["rejected_records"])
        if said == self._written and time.monotonic() - self._written_at < REWRITE_S:
            return status  # the same word again: the dashboard's copy is fresh enough
        self._written, self._written_at = said, time.monotonic()
        if self.client is not None:
            try:
                self.client.set(TRAINER_STATUS_KEY, json.dumps(status), ex=STATUS_TTL_S)  # the API nulls NaN
            except redis.RedisError as exc:
                log.debug("trainer status not written: %s", exc)
        return status
