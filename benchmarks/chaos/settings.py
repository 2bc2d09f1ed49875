"""What a bench-chaos run takes: the fault kinds and `ChaosSettings`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FAULTS = (
    "redis_kill",
    "redis_stop",
    "trainer_kill",
    "mlflow_down",
    "replica_restart",
    "bad_records",
    "forged_version",
    "rollback_race",
)


@dataclass(frozen=True)
class ChaosSettings:
    minutes: float = 20.0
    users: int = 4
    seed: int = 0
    fault_gap_s: tuple[float, float] = (20.0, 40.0)
    faults: tuple[str, ...] = FAULTS  # the kinds drawn from (a test forces one or two)
    settle_s: float = 60.0  # after the traffic: how long the trainer may take to read what is left
    target: str | None = None  # None: a tiny model built in code
    draft: str = "early-exit:1"
    max_tokens: int = 12
    workdir: Path | None = None
