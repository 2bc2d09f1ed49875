"""The online trainer: read correction records, distil them into the draft's LoRA adapter, and
promote a new adapter version only when it beats the one served on held-out recent traffic.

    settings = OnlineSettings(data_dir / "adapters", checkpoint_dir=data_dir / "trainer",
                              target_id="smollm2-135m-instruct", draft_id="head")
    trainer = OnlineTrainer(TrainableHead(target), CorrectionStream(redis_url, consumer="trainer-1"),
                            settings, on_promote=pending.submit,                    # trainer/promotion/pending.py
                            champion_source=RegistryChampion(registry, pending))    # trainer/promotion/champion.py
    trainer.run(stop_event, budget_s=600)          # poll -> train_round -> checkpoint + ack, until stopped

trainer/process/build.py assembles one from the process's settings. Small CPU check (tiny random
models, a real redis-server): `.venv/bin/python -m pytest tests/trainer/test_online.py -q`.

`OnlineTrainer` is the loop, one verb each, over parts that own their state:

- `poll()`: the intake (trainer/intake/intake.py) takes records from the stream into each lineage's
  held-out set and replay buffer (trainer/loop/domains.py: the general adapter's, and one per tagged
  domain, up to `max_domains`), and says when entries are acknowledged;
- `train_round(lineage)`: the rounds (trainer/loop/rounds.py) train the lineage `next_lineage()` names
  once `min_new_records` new records of its own are in, gate the candidate, and promote it
  (trainer/promotion/versions.py) or roll it back;
- `checkpoint()`: every part's state and the records go into one checkpoint (trainer/loop/checkpoint.py),
  then the entries it covers are acknowledged.

Not thread-safe: one thread drives poll, train_round and checkpoint (run() does). The trainer owns
`draft_model`: PEFT injects the LoRA layers into it in place. The draft is an early-exit draft
(trainer/learning/distill.py), a head (`TrainableHead(target)`, trainer/learning/head_distill.py,
`lora` then a `HeadSettings`) or an EAGLE-3 head trained whole (`TrainableEagle3Head(target)`,
trainer/learning/eagle3_distill.py, an `Eagle3Settings`); the gate, versions, checkpoints and registry are the same.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from trainer.evaluation.decision import StatisticalGate
from trainer.evaluation.gate import Gate
from trainer.intake.intake import StreamIntake
from trainer.intake.screening import RecordScreen, vocab_size
from trainer.intake.stream import CorrectionStream
from trainer.learning.distill import LoraSettings
from trainer.learning.drafts import trainer_for
from trainer.loop.checkpoint import latest_checkpoint, parts_changed, restore_parts, write_parts
from trainer.loop.domains import DomainLineages, Lineage
from trainer.loop.rounds import RoundResult, Rounds, versus
from trainer.loop.status import TrainerStatus
from trainer.promotion.champion import RegistryChampion
from trainer.promotion.versions import AdapterVersion, VersionDirs
from trainer.settings import TrainerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnlineSettings:
    """What an online trainer is told, flat (STYLE.md §9); the LoRA recipe and the gate keep their own."""

    adapters_dir: Path  # where promoted and adopted versions go (vNNNN)
    checkpoint_dir: Path | None = None  # None: acknowledge at once and never resume (tests, benchmarks)
    target_id: str = "target"
    draft_id: str = "draft"
    base_version: str | int | None = None  # an opaque label of what the lineage starts from
    lora: LoraSettings = field(default_factory=LoraSettings)  # a head takes HeadSettings (head_distill.py)
    gate: StatisticalGate | Gate = field(
        default_factory=StatisticalGate
    )  # or the fixed rule of trainer/evaluation/gate.py
    holdout_fraction: float = 0.1  # of records, by a hash of their request id
    holdout_records: int = 256  # the most recent held-out records the gate scores
    holdout_warmup: int = 8  # until this many are held out, 1 record in 3 is (trainer/intake/buffer.py HoldoutSplit)
    buffer_tokens: int = 200_000  # replay buffer size, in input tokens
    min_new_records: int = TrainerSettings.min_new_records  # new training records before a round
    round_steps: int = TrainerSettings.round_steps  # optimiser steps per round
    # While traffic is slow, a round run() drives keeps training until min_new_records new records are in,
    # up to this many steps: time the trainer would otherwise spend waiting (round_steps: never longer).
    max_round_steps: int = TrainerSettings.max_round_steps
    batch_tokens: int | None = None  # input tokens sampled per step; lora.batch_tokens if None
    read_count: int = 64  # entries per XREADGROUP / XAUTOCLAIM
    drain_s: float = 5.0  # between rounds, keep reading a backlog (full reads) for up to this long
    reclaim_idle_ms: int = 60_000  # another consumer's pending entries are taken over after this long
    registry_retry_s: float = 30.0  # while the registry is unreachable, ask it again after this long
    max_domains: int = (
        TrainerSettings.max_domains
    )  # domains with an adapter of their own (trainer/loop/domains.py); 0: one general adapter
    ngram_tokens: int = 32_768  # latest output tokens a version's n-gram index is built from (0: ship none)
    # Idle rounds: once no record has come for `idle_after_s`, a lineage that has promoted a version trains
    # on its buffer again (a round as long as max_round_steps, gated as any), until `idle_rejections` idle
    # rounds in a row did not promote; a new record starts it over. None: never.
    idle_after_s: float | None = TrainerSettings.idle_after_s
    idle_rejections: int = 2

    def __post_init__(self) -> None:
        if self.min_new_records < 1 or self.round_steps < 1:
            raise ValueError("min_new_records and round_steps must be >= 1")
        if self.max_round_steps < self.round_steps:
            raise ValueError(f"max_round_steps ({self.max_round_steps}) must be >= round_steps ({self.round_steps})")


def _part(part: str, name: str) -> property:
    """A read-only attribute of the trainer that one of its parts keeps: _part("intake", "duplicates")."""
    return property(lambda trainer: getattr(getattr(trainer, part), name))


class OnlineTrainer:
    """Consumes `stream`, trains a LoRA adapter on `draft_model` and writes promoted versions to
    `settings.adapters_dir`; with `settings.checkpoint_dir`, resumes from the checkpoint found there.

    Its public surface is the loop's verbs (run, poll, drain, train_round, checkpoint, ...) and the
    figures reports and tests read, each answered by the part that keeps it (`_part`)."""

    def __init__(
        self,
        draft_model,
        stream: CorrectionStream,
        settings: OnlineSettings,
        *,
        on_promote: Callable[[AdapterVersion], None] | None = None,
        champion_source: RegistryChampion | None = None,  # None: the trainer's own champion is final
    ) -> None:
        self.settings, self.stream, self.gate = settings, stream, settings.gate
        self.checkpoint_dir = Path(settings.checkpoint_dir) if settings.checkpoint_dir is not None else None
        self.versions = VersionDirs(settings.adapters_dir)
        self.checkpoint_seq = 0
        self._polled = False  # records came since the last checkpoint
        self._polled_at = time.monotonic()  # the loop's last poll
        self._record_at = time.monotonic()  # the last poll that brought records (idle rounds wait on it)

        state, checkpoint = latest_checkpoint(self.checkpoint_dir)
        screen = RecordScreen(settings.target_id, settings.draft_id, vocab_size(draft_model))
        self.trainer = trainer_for(draft_model)(
            draft_model,
            settings.lora,
            init_adapter=checkpoint / "adapter" if checkpoint else None,
            target_id=settings.target_id,
            draft_id=settings.draft_id,
        )
        self.lineages = DomainLineages(settings, self.trainer, self.versions, champion_source)
        self.general, self.champion = self.lineages.general, self.lineages.general.champion
        self.intake = StreamIntake(
            stream,
            self.lineages,
            self.trainer.settings.max_seq_len,
            screen=screen,
            ack_at_once=self.checkpoint_dir is None,
            read_count=settings.read_count,
            reclaim_idle_ms=settings.reclaim_idle_ms,
        )
        self.buffer, self.holdout, self.adapters_dir = self.intake.buffer, self.intake.holdout, self.versions.root
        self.rounds_part = Rounds(
            settings,
            self.trainer,
            self.lineages,
            self.versions,
            self.intake,
            TrainerStatus(stream.redis, stream.consumer),  # for operators: log and dashboard
            on_promote=on_promote,
            checkpoint=self.checkpoint if self.checkpoint_dir is not None else None,
        )
        if state is not None and checkpoint is not None:  # each part takes its share back (trainer/loop/checkpoint.py)
            restore_parts(
                state,
                checkpoint,
                stream.consumer,
                lineages=self.lineages,
                intake=self.intake,
                rounds=self.rounds_part,
                versions=self.versions,
            )
            self.checkpoint_seq = state.checkpoint_seq
            log.info("resumed from %s: %s", checkpoint, self.progress())
        self.stream.ensure_group()

    # ---------------------------------------------------------------- the loop

    def run(
        self,
        stop: threading.Event,
        budget_s: float | None = None,
        checkpoint_every_s: float = 30.0,
        poll_block_ms: int = 1000,
    ) -> dict:
        """Poll, train a round whenever enough new records are in, checkpoint every `checkpoint_every_s`.

        Returns (with the counters()) once `stop` is set or `budget_s` of wall time is spent,
        checked between steps of the loop, so a round under way finishes first. On a clean exit
        it checkpoints a last time (if anything changed). If it raises, nothing after the last
        checkpoint is acknowledged, and a restarted trainer reads those entries again. While
        Redis is unreachable it keeps its state and retries every second. A round that raises is
        logged and its records set aside (trainer/loop/rounds.py `Rounds.failed`); the loop goes on.
        """
        started = time.monotonic()
        deadline = started + budget_s if budget_s is not None else math.inf
        last_checkpoint = started
        redis_down = False
        log.info("online trainer %s started: %s", self.stream.consumer, self.progress())
        while not stop.is_set() and time.monotonic() < deadline:
            block_ms = int(min(poll_block_ms, max(1.0, (deadline - time.monotonic()) * 1000)))
            try:
                self.poll(block_ms=block_ms)
                self.drain()
            except (redis.ConnectionError, redis.TimeoutError) as error:  # Redis down: keep what we have, retry
                if not redis_down:
                    log.warning("correction stream unavailable (%s); retrying", error)
                redis_down = True
                stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            redis_down = False
            lineage = self.next_lineage()
            idle = self.idle_lineage() if lineage is None else None
            if lineage is not None:
                try:
                    self.train_round(lineage, keep_training=self._while_waiting(lineage, stop, deadline))
                except Exception as error:  # logged, its records set aside; the loop goes on
                    self.rounds_part.failed(lineage, error)
            elif idle is not None:
                self._idle_round(idle, self._while_waiting(idle, stop, deadline))
            elif self.rounds == 0:  # before the first round, say what it waits for (later, the last round's result)
                first = max(self.lineages.every(), key=lambda lineage: lineage.new_records)  # the nearest to a round
                waiting = self.rounds_part.waiting(first) or "waiting for records"
                self.rounds_part.report(RoundResult(False, False, waiting, domain=first.domain))
            elif self.status.rejected != self.rejected and self.last_result is not None:
                self.rounds_part.report(self.last_result)  # records were rejected since its last word: say so
            if time.monotonic() - last_checkpoint >= checkpoint_every_s:
                if self.checkpoint_dir is not None and self._dirty():
                    self.checkpoint()
                last_checkpoint = time.monotonic()
                log.info("progress: %s", self.progress())
        if self.checkpoint_dir is not None and self._dirty():
            self.checkpoint()
        log.info("online trainer stopped after %.0f s: %s", time.monotonic() - started, self.progress())
        return self.counters()

    def poll(self, block_ms: int | None = 1000) -> int:
        """Take what the stream has for this consumer into the held-out set or the buffer; returns how
        many records came. Waits up to `block_ms` for new entries only when nothing pending came first."""
        received = self.intake.poll(block_ms)
        self._polled_at = time.monotonic()
        self._polled |= bool(received)
        if received:
            self._record_at = self._polled_at
            for lineage in self.lineages.every():  # new traffic: idle rounds may try again later
                lineage.idle_rejections = 0
        return received

    def _idle_round(self, lineage: Lineage, keep_training: Callable[[], bool]) -> None:
        """A round on the buffer again while no record comes (OnlineSettings.idle_after_s): a head gains
        first-token match for hundreds of steps on the same records (benchmarks/head_ablation.py), and a
        quiet trainer would otherwise stop at its last round. The gate judges it as any round."""
        try:
            result = self.rounds_part.train(lineage, keep_training, idle=True)
        except Exception as error:  # logged, its records set aside; the loop goes on
            self.rounds_part.failed(lineage, error)
            lineage.idle_rejections = self.settings.idle_rejections  # not again until new records
            return
        if result.trained:  # a candidate carried on counts as none: the held-out set will not grow meanwhile
            lineage.idle_rejections = 0 if result.promoted else lineage.idle_rejections + 1

    def idle_lineage(self, quiet: bool = False) -> Lineage | None:
        """The lineage an idle round would train now (the one with the largest buffer), or None: no record
        for `idle_after_s` (or `quiet`: take the traffic as quiet already), a promoted version to refine,
        fewer than `idle_rejections` idle rounds in a row that got nowhere, and a gate ready to judge."""
        after = self.settings.idle_after_s
        if after is None or (not quiet and time.monotonic() - self._record_at < after):
            return None
        ready = [
            lineage
            for lineage in self.lineages.every()
            if not lineage.champion.is_base_draft
            and lineage.idle_rejections < self.settings.idle_rejections
            and self.rounds_part.waiting(lineage, idle=True) is None
        ]
        return max(ready, key=lambda lineage: len(lineage.buffer)) if ready else None

    @property
    def nothing_to_train(self) -> bool:
        """No lineage is due a round, and none would take an idle one once the traffic is quiet."""
        return self.next_lineage() is None and self.idle_lineage(quiet=True) is None

    def drain(self) -> int:
        """After a poll, keep reading without waiting while reads come back full (a backlog), for up to
        `drain_s`; returns how many records came. Without it the loop took `read_count` records per
        round: 64 per 39 s round with the default model, 1.65 records/s for a whole fleet. Intake
        alone takes about 2800 records/s (benchmarks/intake.py), so a backlog of a few thousand goes
        in one pass and the replay buffer keeps the most recent."""
        deadline, taken = time.monotonic() + self.settings.drain_s, 0
        while time.monotonic() < deadline:
            received = self.poll(block_ms=None)
            taken += received
            if received < self.settings.read_count:
                break
        return taken

    def _while_waiting(self, lineage: Lineage, stop: threading.Event, deadline: float) -> Callable[[], bool]:
        """For run(): after round_steps, keep training while the next round would still wait for records
        (polled without blocking between steps), until stopped or past the deadline."""

        def keep_training() -> bool:
            if stop.is_set() or time.monotonic() >= deadline:
                return False
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):  # the loop retries after the round
                self.poll(block_ms=None)
            return lineage.new_records < self.settings.min_new_records

        return keep_training

    def train_round(
        self, lineage: Lineage | None = None, keep_training: Callable[[], bool] | None = None
    ) -> RoundResult:
        """A round of the lineage (the general one by default): `round_steps` steps from its champion,
        more while `keep_training()` says so, then the gate (trainer/loop/rounds.py).

        Why longer rounds on slow traffic: one user at a time brings about 8 records a minute, so with
        16 records per round of 20 steps the trainer waited three quarters of the time, and a head
        gains about 0.2 of first-token match per 50 steps (benchmarks/head_ablation.py): a round of
        20 moved it too little for the gate to see it, and rejected rounds are rolled back."""
        return self.rounds_part.train(lineage or self.general, keep_training)

    def sync_registry(self) -> bool:
        """Adopt the registry's champion if an operator moved it (trainer/promotion/champion.py); True when
        the champion changed. Never raises for the registry."""
        return self.champion.sync()

    def next_lineage(self) -> Lineage | None:
        """The lineage run() trains next, or None (trainer/loop/domains.py `DomainLineages.next`)."""
        return self.lineages.next(self.rounds_part.waiting)

    # ---------------------------------------------------------------- checkpoints

    def checkpoint(self) -> Path:
        """Write the champion, buffer, held-out set and every part's state atomically, then acknowledge
        the entries they contain (trainer/loop/checkpoint.py `write_parts`). Returns the checkpoint directory."""
        if self.checkpoint_dir is None:
            raise ValueError("this trainer has no checkpoint_dir")
        self.checkpoint_seq += 1
        path = write_parts(
            self.checkpoint_dir,
            self.checkpoint_seq,
            self.stream.consumer,
            self.trainer.save,
            lineages=self.lineages,
            intake=self.intake,
            rounds=self.rounds_part,
            versions=self.versions,
            base_version=self.settings.base_version,
        )
        self._polled = False
        return path

    def _dirty(self) -> bool:
        return self._polled or parts_changed(self.lineages, self.intake, self.rounds_part)

    # ---------------------------------------------------------------- reports

    def counters(self) -> dict:
        """Figures for reports (bench-drift's records_consumed, tokens_consumed, train_s, adapters_promoted)."""
        return {
            **self.intake.counters(),
            **self.rounds_part.state()["counters"],
            "buffer_records": len(self.buffer),
            "holdout_records": len(self.holdout),
            "unacknowledged": len(self.intake.unacked),
            "corrupt": self.stream.corrupt,
            "trimmed": self.stream.trimmed,
            "champion_version": self.champion_version,
            "next_version": self.next_version,
            "adoptions": self.adoptions,
            "registry_champion": self.registry_champion,
            "domains": self.lineages.counters(),
        }

    def progress(self) -> str:
        last = self.last_result
        return (
            f"{self.records_consumed} records ({self.tokens_consumed} tokens) consumed, {len(self.buffer)} buffered, "
            f"{len(self.holdout)} held out, {len(self.intake.unacked)} unacknowledged, {self.rounds} rounds in "
            f"{self.train_s:.1f} s, {self.adapters_promoted} promoted, {self._champions()}"
            + (f", rejected {self.rejected}" if self.rejected else "")
            + (f", {self.rounds_part.rounds_failed} rounds failed" if self.rounds_part.rounds_failed else "")
            + (f", last round {versus(last.candidate, last.champion)}, loss {last.loss:.4f}" if last else "")
        )

    def _champions(self) -> str:
        """With one adapter "champion v0002"; with domains "champions: general base draft, python v0001"."""
        if not len(self.lineages):
            return f"champion {self.champion.name()}"
        names = (f"{lineage.label} {lineage.champion.name()}" for lineage in self.lineages.every())
        return "champions: " + ", ".join(names)

    @property
    def progressed_at(self) -> float:
        """The main loop's last poll or optimiser step, monotonic (the lease lapses when it stalls)."""
        return max(self._polled_at, self.rounds_part.stepped_at)

    @property
    def status(self) -> TrainerStatus:
        return self.rounds_part.status

    @status.setter
    def status(self, status: TrainerStatus) -> None:  # a benchmark silences it (benchmarks/intake.py)
        self.rounds_part.status = status

    # What reports and tests read, answered by the part that keeps it.
    records_consumed = _part("intake", "records_consumed")  # distinct records taken from the stream
    tokens_consumed = _part("intake", "tokens_consumed")  # their output tokens
    duplicates = _part("intake", "duplicates")  # records dropped because their request id was already kept
    rejected = _part("intake", "rejected")  # records the screen refused, by reason (trainer/intake/screening.py)
    rounds_failed = _part("rounds_part", "rounds_failed")  # rounds that raised
    records_set_aside = _part("rounds_part", "records_set_aside")  # the records they were reading
    rounds = _part("rounds_part", "rounds")  # rounds trained
    train_s = _part("rounds_part", "train_s")  # seconds of optimiser steps
    adapters_promoted = _part("rounds_part", "adapters_promoted")
    promote_errors = _part("rounds_part", "promote_errors")  # on_promote raised
    last_result = _part("rounds_part", "last_result")
    rng = _part("rounds_part", "rng")
    next_version = _part("versions", "next")
    champion_version = _part("champion", "version")  # None: the base draft
    champion_sha256 = _part("champion", "sha256")
    champion_path = _part("champion", "path")  # the champion's version directory; None for the base draft
    registry_champion = _part("champion", "registry_champion")
    registry_versions = _part("champion", "registry_versions")
    adoptions = _part("champion", "adoptions")
