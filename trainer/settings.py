"""The trainer process's one settings type: every knob of `adaptive-spec train` with its default, written
once, here; the loop's `OnlineSettings`, the gate's `Thresholds` and the command line's flags take
theirs from it. Read from the environment (STYLE.md §9, §20). It imports only the core's options, so
building the command line's parser loads no trainer code.

    settings = TrainerSettings.from_env()                           # ADAPTIVE_SPEC_*, REDIS_URL, MLFLOW_TRACKING_URI
    settings = TrainerSettings.from_env(min_new_records=8)          # flags that were given win
    settings.argv()                                                 # the flags of a child `adaptive-spec train`

| field | environment | default |
|---|---|---|
| target, draft, dtype, device | ADAPTIVE_SPEC_TARGET, _DRAFT, _DTYPE, _DEVICE | the built-in model, the head draft, auto |
| draft_vocab_size | ADAPTIVE_SPEC_DRAFT_VOCAB_SIZE | 4096: the tokens an `eagle3` head drafts over, the same for every version of a deployment (capped at the target's vocabulary: all of it, no d2t), chosen by the traffic (trainer/learning/eagle3_vocab.py) |
| autocast | ADAPTIVE_SPEC_AUTOCAST | auto: a training step's forwards under bf16 autocast where the weights are fp32, the model is at least 256 wide and the device computes bf16 natively (trainer/learning/distill.py `training_autocast`); bf16; off |
| data_dir | ADAPTIVE_SPEC_DATA_DIR | ./.adaptive-spec: adapters, checkpoints, the default MLflow store |
| redis_url | REDIS_URL | none: the trainer refuses to start |
| tracking_uri | MLFLOW_TRACKING_URI | none: `<data_dir>/mlflow.db` |
| consumer | ADAPTIVE_SPEC_CONSUMER | trainer-<hostname>, stable across restarts |
| threads | ADAPTIVE_SPEC_THREADS | torch's own |
| min_new_records, round_steps, max_round_steps | ADAPTIVE_SPEC_MIN_NEW_RECORDS, ... | 16 new records before a round, 20 steps, up to 100 while the next round would wait |
| gate_min_positions, gate_confidence | ADAPTIVE_SPEC_GATE_MIN_POSITIONS, ... | 128 held-out positions before the first decision, 0.99 (trainer/evaluation/decision.py) |
| max_domains | ADAPTIVE_SPEC_MAX_DOMAINS | 8 domains with an adapter of their own; 0: one general adapter |
| checkpoint_every_s, budget_s | ADAPTIVE_SPEC_CHECKPOINT_EVERY_S, _BUDGET_S | 30 s; none: until a signal |
| keep_versions | ADAPTIVE_SPEC_KEEP_VERSIONS | 20 version directories kept, besides every one an alias names |
| signing_key | ADAPTIVE_SPEC_SIGNING_KEY | none: versions are registered unsigned (a warning at start) |
| retry_s, lease_ttl_s, lease_stall_s | ADAPTIVE_SPEC_RETRY_S, _LEASE_TTL_S, _LEASE_STALL_S | 10 s between registrations while MLflow is down; 10 s lease, let go after 300 s without progress |

`k` (of the model options) is not the trainer's: it trains the draft, whatever k serves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from adaptive_spec.contracts import DEFAULT_DATA_DIR, MLFLOW_TRACKING_URI_ENV, REDIS_URL_ENV
from adaptive_spec.options import EnvSettings, ModelOptions, check_secret

AUTOCAST = ("auto", "bf16", "off")  # a training step's bf16 autocast (trainer/learning/distill.py)
AUTOCAST_MIN_HIDDEN = 256  # "auto" leaves narrower models in fp32: their casts cost more than bf16 saves


@dataclass(frozen=True)
class TrainerSettings(ModelOptions, EnvSettings):
    ENV_NAMES: ClassVar[dict[str, str]] = {"redis_url": REDIS_URL_ENV, "tracking_uri": MLFLOW_TRACKING_URI_ENV}

    data_dir: Path = Path(DEFAULT_DATA_DIR)
    redis_url: str | None = None
    tracking_uri: str | None = None  # None: <data_dir>/mlflow.db
    consumer: str | None = None  # stable across restarts: None = "trainer-<hostname>"
    threads: int | None = None  # torch threads; None keeps torch's default
    autocast: str = "auto"  # bf16 autocast of training forwards: auto, bf16 or off (LoraSettings.autocast)
    draft_vocab_size: int = 4096  # an eagle3 head's draft vocabulary, one size for every version (eagle3_vocab.py)
    budget_s: float | None = None  # stop after this much wall time; None = until a signal
    checkpoint_every_s: float = 30.0
    min_new_records: int = 16  # new training records before a round
    round_steps: int = 20  # optimiser steps per round
    max_round_steps: int = 100  # on slow traffic a round keeps training up to this many steps
    idle_after_s: float = 30.0  # with no record for this long, a promoted lineage trains on its buffer; 0: never
    gate_min_positions: int = 128  # held-out positions before the first decision
    gate_confidence: float = 0.99  # that a candidate gains more than the margin, to promote it
    max_domains: int = 8  # domains with an adapter of their own; 0: one general adapter
    retry_s: float = 10.0  # between registration attempts while MLflow is down
    lease_ttl_s: float = 10.0  # a standby takes over this long after the leader stops renewing
    lease_stall_s: float = 300.0  # ... which it does once the main loop made no progress for this long
    keep_versions: int = 20  # version directories kept besides every aliased one (the rest are deleted)
    signing_key: str | None = field(
        default=None, repr=False
    )  # sign every registered version with it (servers refuse unsigned ones)

    def __post_init__(self) -> None:
        if self.autocast not in AUTOCAST:
            raise ValueError(f"{self.env_name('autocast')} must be one of {', '.join(AUTOCAST)}, got {self.autocast!r}")
        if self.draft_vocab_size < 1:
            raise ValueError(f"{self.env_name('draft_vocab_size')} must be >= 1 token, got {self.draft_vocab_size}")
        if not self.idle_after_s >= 0:  # NaN too
            raise ValueError(
                f"{self.env_name('idle_after_s')} must be >= 0 seconds (0: no idle rounds), got {self.idle_after_s}"
            )
        if self.signing_key is not None:
            object.__setattr__(self, "signing_key", self.signing_key.strip())
            check_secret(self.env_name("signing_key"), self.signing_key)

    def argv(self, *, k: bool = False) -> list[str]:
        """The flags of a child `adaptive-spec train` with these settings: the model options, the data
        directory, and each knob that is not its default (the child's environment decides those, and
        gives it Redis and MLflow)."""
        flags = [*super().argv(k=k), "--data-dir", str(self.data_dir)]
        for name, flag in _FLAGS.items():
            value = getattr(self, name)
            if value is not None and value != getattr(TrainerSettings, name):
                flags += [flag, str(value)]
        return flags


_FLAGS = {  # field -> its `adaptive-spec train` flag (cli/training.py)
    "consumer": "--consumer",
    "threads": "--threads",
    "autocast": "--autocast",
    "min_new_records": "--min-new-records",
    "round_steps": "--round-steps",
    "max_round_steps": "--max-round-steps",
    "idle_after_s": "--idle-after-s",
    "gate_min_positions": "--gate-min-positions",
    "gate_confidence": "--gate-confidence",
    "max_domains": "--max-domains",
    "checkpoint_every_s": "--checkpoint-every-s",
}
