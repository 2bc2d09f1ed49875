"""The trainer's status for operators, as it crosses from the trainer to the dashboard: one schema, one
writer (trainer/loop/status.py) and one reader (service/stats_queries.py), through the Redis key
`adaptive_spec:trainer_status` (contracts.TRAINER_STATUS_KEY).

    record = TrainerStatusRecord("waiting", "12 new training records, need 16", consumer="trainer-1", at=time.time())
    raw = record.to_json()                      # what the trainer sets
    TrainerStatusRecord.from_json(raw).as_dict()   # what GET /api/stats/summary shows as "trainer"

`candidate` and `champion_figures` are the gate's figures of the last round (`expected_acceptance`,
`greedy_match`, `positions`); NaN where no position was scored (the API turns it into null).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

STATES = ("waiting", "promoted", "not promoted")


@dataclass(frozen=True)
class TrainerStatusRecord:
    state: str  # one of STATES
    message: str  # the gate's reason, or what the trainer waits for
    consumer: str  # the trainer's consumer name
    at: float  # unix seconds when it was written
    round: int = 0  # rounds trained so far (0: none yet)
    domain: str | None = None  # the lineage the word is about; None: the general adapter
    champion: str | None = None  # that lineage's champion, e.g. "v0004 (registry version 4)"
    candidate: dict | None = None  # the last round's candidate figures
    champion_figures: dict | None = None  # the champion's figures on the same held-out records
    rejected_records: int = 0  # records the trainer's screen refused so far (trainer/intake/screening.py)
    rejected_by_reason: dict = field(default_factory=dict)  # those, by reason
    last_failure: dict | None = None  # the last round that raised: message, at, rounds_failed

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

    @classmethod
    def from_json(cls, raw: str | bytes) -> TrainerStatusRecord:
        """The record a trainer wrote; keys this build does not know are left out."""
        data = json.loads(raw)
        known = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})
