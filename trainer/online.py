"""The online trainer: read correction records, distil them into the draft's LoRA adapter, and
promote a new adapter version only when it beats the one served on held-out recent traffic.

    settings = OnlineSettings(data_dir / "adapters", checkpoint_dir=data_dir / "trainer",
                              target_id="smollm2-135m-instruct", draft_id="early-exit:4")
    trainer = OnlineTrainer(build_early_exit(target, 4), CorrectionStream(redis_url, consumer="trainer-1"),
                            settings, on_promote=pending.submit,                    # trainer/pending.py
                            champion_source=RegistryChampion(registry, pending))    # trainer/champion.py
    trainer.run(stop_event, budget_s=600)          # poll -> train_round -> checkpoint + ack, until stopped

Small CPU check (tiny random models, a real redis-server): `.venv/bin/python -m pytest tests/trainer/test_online.py -q`.

The loop (`run`), one verb each:

- `poll()` takes records from the stream into held-out sets and replay buffers (trainer/intake.py,
  which also says when entries are acknowledged): the general adapter's, and each tagged domain's
  own (trainer/domains.py: one adapter per domain, up to `max_domains`);
- `train_round(lineage)`, for the lineage `next_lineage()` names once `min_new_records` new training
  records of its own have arrived: `round_steps` optimiser steps from its champion on its buffer
  (more, up to `max_round_steps`, while the next round would still be waiting for records),
  then candidate and champion (the base draft with adapters disabled before any version; for a
  domain without one, the general adapter) are scored with `draft_agreement` on one snapshot of its
  held-out set, and the gate judges (trainer/decision.py). While the lineage's champion is the base
  draft, held-out records that arrive during the round bring a look at the gate, and the round ends
  at the look where it would promote (`_FirstLook`), so a first adapter does not wait for the end of
  a long round. A winner becomes `adapters_dir/vNNNN`
  (trainer/versions.py; a domain's carries `"domain"` in its metadata; each ships the n-gram index of
  its lineage's latest outputs, `ngram_tokens`) and the lineage's champion;
- `checkpoint()` makes the state durable (trainer/checkpoint.py, trainer/resume.py), then
  acknowledges what it covers.

No record stops the loop. The intake screens each one against this trainer's target, draft and
vocabulary (trainer/screening.py) and drops, acknowledges and counts (`rejected`) what it cannot
train on. A round that raises anyway is logged with its traceback; the records it was reading (the
batch of the step under way, or the held-out snapshot it was scoring) are set aside, the champion's
weights go back in the model, and the loop goes on (`rounds_failed`, `records_set_aside`).

The registry has the last word: before each round and again before each promotion the trainer
adopts the version an operator moved the lineage's alias to (`champion`, `champion-<domain>`;
trainer/champion.py). A candidate whose round saw its champion move is discarded. A rejected
candidate is rolled back (the champion's weights, optimiser moments cleared): a round that
overfits costs its own steps only, and between rounds (and in checkpoints) the model holds the
general champion's weights.

The draft is an early-exit draft (trainer/distill.py) or a head (`TrainableHead(target)`,
trainer/head_distill.py, `lora` then a `HeadSettings`); the gate, versions, checkpoints and registry
are the same for both.

Not thread-safe: one thread drives poll, train_round and checkpoint (run() does). The trainer
owns `draft_model`: PEFT injects the LoRA layers into it in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis

from adaptive_spec.contracts import version_dir_name
from adaptive_spec.drafters.ngram_index import build_ngram_index
from adaptive_spec.record import CorrectionRecord
from trainer.buffer import ReplayBuffer
from trainer.champion import RegistryChampion, agreement
from trainer.checkpoint import latest_checkpoint, write_checkpoint
from trainer.decision import StatisticalGate
from trainer.distill import DraftTrainer, LoraSettings
from trainer.domains import DomainLineages, Lineage
from trainer.gate import Gate, GateFigures
from trainer.head_distill import HeadTrainer
from trainer.head_model import TrainableHead
from trainer.intake import StreamIntake, target_tokens
from trainer.resume import COUNTERS, restore_trainer, trainer_state
from trainer.rounds import RoundResult, TrainerStatus, versus
from trainer.screening import RecordScreen, vocab_size
from trainer.stream import CorrectionStream
from trainer.versions import AdapterVersion, VersionDirs

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
    gate: StatisticalGate | Gate = field(default_factory=StatisticalGate)  # or the fixed rule of trainer/gate.py
    holdout_fraction: float = 0.1  # of records, by a hash of their request id
    holdout_records: int = 256  # the most recent held-out records the gate scores
    holdout_warmup: int = 8  # until this many are held out, 1 record in 3 is (trainer/buffer.py HoldoutSplit)
    buffer_tokens: int = 200_000  # replay buffer size, in input tokens
    min_new_records: int = 16  # new training records before a round
    round_steps: int = 20  # optimiser steps per round
    # While traffic is slow, a round run() drives keeps training until min_new_records new records are in,
    # up to this many steps: time the trainer would otherwise spend waiting (round_steps: never longer).
    max_round_steps: int = 100
    batch_tokens: int | None = None  # input tokens sampled per step; lora.batch_tokens if None
    read_count: int = 64  # entries per XREADGROUP / XAUTOCLAIM
    drain_s: float = 5.0  # between rounds, keep reading a backlog (full reads) for up to this long
    reclaim_idle_ms: int = 60_000  # another consumer's pending entries are taken over after this long
    registry_retry_s: float = 30.0  # while the registry is unreachable, ask it again after this long
    max_domains: int = 8  # domains with an adapter of their own (trainer/domains.py); 0: one general adapter
    ngram_tokens: int = 32_768  # latest output tokens a version's n-gram index is built from (0: ship none)

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
    `settings.adapters_dir`; with `settings.checkpoint_dir`, resumes from the checkpoint found there."""

    def __init__(
        self,
        draft_model,
        stream: CorrectionStream,
        settings: OnlineSettings,
        *,
        on_promote: Callable[[AdapterVersion], None] | None = None,
        champion_source: RegistryChampion | None = None,  # None: the trainer's own champion is final
    ) -> None:
        self.settings = settings
        self.stream = stream
        self.gate = settings.gate
        self.on_promote = on_promote
        self.checkpoint_dir = Path(settings.checkpoint_dir) if settings.checkpoint_dir is not None else None
        self.versions = VersionDirs(settings.adapters_dir)
        self.train_s = 0.0
        self.adapters_promoted = 0
        self.rounds = 0
        self.promote_errors = 0  # on_promote raised
        self.rounds_failed = 0  # rounds that raised (run() logs them and goes on)
        self.records_set_aside = 0  # the records those rounds were reading, taken out of the buffers
        self.reading: list = []  # what the round under way reads now (records or examples): set aside if it raises
        self.progressed_at = time.monotonic()  # the main loop's last poll or optimiser step (trainer/leader.py)
        self.last_result: RoundResult | None = None
        self.checkpoint_seq = 0
        self._changed = False  # anything to checkpoint since the last checkpoint

        state, checkpoint = latest_checkpoint(self.checkpoint_dir)
        screen = RecordScreen(settings.target_id, settings.draft_id, vocab_size(draft_model))
        trainer_class = HeadTrainer if isinstance(draft_model, TrainableHead) else DraftTrainer
        self.trainer = trainer_class(
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
        self.status = TrainerStatus(stream.redis, stream.consumer)  # for operators: log and dashboard
        self.batch_tokens = settings.batch_tokens or self.trainer.settings.batch_tokens
        self.rng = np.random.default_rng(self.trainer.settings.seed)
        if state is not None:
            restore_trainer(self, state, checkpoint)
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
        logged and its records set aside (`_round_failed`); the loop goes on.
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
            if lineage is not None:
                try:
                    self.train_round(lineage, keep_training=self._while_waiting(lineage, stop, deadline))
                except Exception as error:
                    self._round_failed(lineage, error)
            elif self.rounds == 0:  # before the first round, say what it waits for (later, the last round's result)
                first = max(self.lineages.every(), key=lambda lineage: lineage.new_records)  # the nearest to a round
                waiting = self._waiting(first, first.holdout.records) or "waiting for records"
                self._report(RoundResult(False, False, waiting, domain=first.domain))
            elif self.status.rejected != self.rejected and self.last_result is not None:
                self._report(self.last_result)  # records were rejected since its last word: the dashboard counts them
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
        self.progressed_at = time.monotonic()
        if received:
            self._changed = True
        return received

    def drain(self) -> int:
        """After a poll, keep reading without waiting while reads come back full (a backlog), for up to
        `drain_s`; returns how many records came. Without it the loop took `read_count` records per
        round: 64 per 39 s round with the default model, 1.65 records/s for a whole fleet. Intake
        alone takes about 2800 records/s (service/benchmarks/intake.py), so a backlog of a few
        thousand goes in one pass and the replay buffer keeps the most recent."""
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
        """Train `round_steps` steps from the lineage's champion (the general one by default), then more,
        up to `max_round_steps`, while `keep_training()` says so; gate the candidate on its held-out
        records, promote it or roll it back.

        Why longer rounds on slow traffic: one user at a time brings about 8 records a minute, so with
        16 records per round of 20 steps the trainer waited three quarters of the time, and a head
        gains about 0.2 of first-token match per 50 steps (service/benchmarks/head_ablation.py): a
        round of 20 moved it too little for the gate to see it, and rejected rounds are rolled back."""
        lineage = lineage or self.general
        # one snapshot for both sides of the gate, and its revision: a long round polls, so the held-out
        # set may grow before the candidate is promoted with the figures it scored on this snapshot
        heldout, revision = lineage.holdout.records, lineage.holdout.revision
        self.reading = heldout
        waiting = self._waiting(lineage, heldout)
        if waiting:
            return self._report(RoundResult(False, False, waiting, domain=lineage.domain))
        if self._sync(lineage):  # the gate must compare against what is served, and training start from it
            lineage.carried = None
        champion = lineage.champion.figures(heldout, revision)
        if lineage.domain is not None:
            lineage.champion.roll_back()  # its weights into the model (the figures may come from the cache)
        if lineage.carried is not None:  # the last round's candidate, ahead but not yet certain: train on from it
            self.trainer.restore(lineage.carried)
        new_records, lineage.new_records = lineage.new_records, 0
        look = _FirstLook(self, lineage, revision) if lineage.champion.is_base_draft else None
        losses, trained_ids, train_s = self._train(lineage.buffer, keep_training, look)
        if look is not None and look.heldout is not None:  # the held-out set grew: the gate decides on all of it
            heldout, revision, champion = look.heldout, look.revision, look.champion
        self.reading = heldout
        # the round ended at a look that promotes: the weights are those it scored, on this snapshot
        candidate = look.candidate if look is not None and look.promotes else agreement(self.trainer, heldout)
        accepted, reason = self.gate.decide(candidate, champion)
        if look is not None and look.looks:
            reason += f" (after {look.looks} look{'s' if look.looks > 1 else ''} at held-out records that arrived during the round)"
        lineage.carried = None
        if accepted and self._sync(lineage):  # adopting replaced the candidate's weights
            accepted = False
            reason = f"the registry's champion moved during the round; candidate discarded, training from {lineage.champion.name()}"
        elif not accepted and self._ahead(candidate, champion):
            lineage.carried = self.trainer.lora_state()
            reason += "; ahead of the champion, so the next round trains on from this candidate"
        self.rounds += 1
        self._changed = True
        loss = float(np.mean(losses))
        result = RoundResult(
            True,
            accepted,
            reason,
            self.rounds,
            len(losses),
            loss,
            losses[0],
            losses[-1],
            new_records,
            train_s,
            candidate,
            champion,
            domain=lineage.domain,
        )
        if accepted:
            result = dataclasses.replace(result, version=self._promote(result, trained_ids, lineage, revision).version)
        else:
            lineage.champion.roll_back()
            if lineage.domain is not None:
                self.champion.roll_back()  # between rounds the model holds the general champion
        self.last_result = result
        log.info(
            "round %d (%s): %d steps in %.1f s, loss %.4f -> %.4f; held-out %s: %s",
            result.round,
            lineage.label,
            result.steps,
            train_s,
            result.first_loss,
            result.last_loss,
            versus(candidate, champion),
            f"promoted v{result.version:04d}"
            if accepted
            else f"{'kept' if lineage.carried else 'rolled back'} ({reason})",
        )
        return self._report(result)

    def _ahead(self, candidate: GateFigures, champion: GateFigures) -> bool:
        """The candidate did better than the champion on the same held-out positions, by more than the
        gate's margin in greedy match and not worse in expected acceptance, but the gate was not yet
        sure of it. Rolled back, its round's steps were lost: after python's first adapter, one
        bench-drift --scenario run rolled back four rounds in a row whose candidates stood +0.10 to
        +0.21 above the champion at 95-98% confidence (the gate needs 99%), each trained afresh from
        the champion. Carried, the next round trains on from it, and the gate judges it again on a
        held-out set that has grown meanwhile; it never trains on a held-out record, so carrying it
        changes which weights are judged, not what judging them means."""
        return (
            candidate.positions == champion.positions > 0
            and candidate.greedy_match - champion.greedy_match > self.gate.margin
            and candidate.expected_acceptance >= champion.expected_acceptance
        )

    def _report(self, result: RoundResult) -> RoundResult:
        lineage = self.lineages.lineages.get(result.domain) if result.domain is not None else None
        self.status.report(result, (lineage or self.general).champion.name(), self.rejected)
        return result

    def _round_failed(self, lineage: Lineage, error: Exception) -> None:
        """A round raised: not for a record the screen knows (those never reach a round), so for one it
        does not, or for something else (a full disk, a bug). Log it with its traceback, set aside the
        records it was reading (`reading`: the batch of its step, or the held-out snapshot it scored),
        put the champions' weights back and go on. The next checkpoint holds none of those records and
        acknowledges their entries, so a restarted trainer does not meet them again. The lineage waits
        for `min_new_records` new records before its next round, so a fault that stays does not spin."""
        ids = {item.request_id for item in self.reading}
        set_aside = self.intake.set_aside(ids)
        self.rounds_failed += 1
        self.records_set_aside += set_aside
        self.reading, lineage.carried, lineage.new_records = [], None, 0
        lineage.champion.roll_back()
        if lineage.domain is not None:
            self.champion.roll_back()  # between rounds the model holds the general champion
        self._changed = True
        reason = (f"a round of the {lineage.label} adapter failed ({type(error).__name__}: {error}); "
                  f"{set_aside} records it was reading set aside, training goes on")  # fmt: skip
        log.exception("%s: %s", reason, sorted(ids)[:8])
        self.status.round_failed(reason, self.rounds_failed)
        self._report(RoundResult(False, False, reason, self.rounds, domain=lineage.domain))

    def sync_registry(self) -> bool:
        """Adopt the registry's champion if an operator moved it (trainer/champion.py); True when the
        champion changed. Never raises for the registry."""
        moved = self.champion.sync()
        self._changed |= moved
        return moved

    def _sync(self, lineage: Lineage) -> bool:
        """sync_registry, then the domain's own alias; True when either champion changed (a domain
        without a version of its own stands on the general one)."""
        moved = self.sync_registry()
        if lineage.domain is not None:
            moved |= lineage.champion.sync()
            self._changed |= moved
        return moved

    # ---------------------------------------------------------------- lineages (trainer/domains.py)

    def next_lineage(self) -> Lineage | None:
        """The lineage run() trains next, or None (trainer/domains.py `DomainLineages.next`)."""
        return self.lineages.next(lambda lineage: self._waiting(lineage, lineage.holdout.records))

    def checkpoint(self) -> Path:
        """Write the champion, buffer, held-out set and counters atomically, then acknowledge the
        entries they contain. Returns the checkpoint directory."""
        if self.checkpoint_dir is None:
            raise ValueError("this trainer has no checkpoint_dir")
        covered = self.intake.unacked  # everything routed so far is in what is written below
        self.checkpoint_seq += 1
        path = write_checkpoint(
            self.checkpoint_dir,
            self.checkpoint_seq,
            self.trainer.save,  # between rounds the weights are the champion's
            self.intake.encoded_buffer(),
            (record.encode() for record in self.holdout.records),
            trainer_state(self),
        )
        self._changed = False
        for lineage in self.lineages.every():
            lineage.champion.changed = False
        self.intake.ack(covered)
        return path

    def counters(self) -> dict:
        """Figures for reports (bench-drift's records_consumed, tokens_consumed, train_s, adapters_promoted)."""
        return {
            **{name: getattr(self, name) for name in COUNTERS},
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

    # What reports and tests read, answered by the part that keeps it.
    records_consumed = _part("intake", "records_consumed")  # distinct records taken from the stream
    tokens_consumed = _part("intake", "tokens_consumed")  # their output tokens
    duplicates = _part("intake", "duplicates")  # records dropped because their request id was already kept
    rejected = _part("intake", "rejected")  # records the screen refused, by reason (trainer/screening.py)
    next_version = _part("versions", "next")
    champion_version = _part("champion", "version")  # None: the base draft
    champion_sha256 = _part("champion", "sha256")
    champion_path = _part("champion", "path")  # the champion's version directory; None for the base draft
    registry_champion = _part("champion", "registry_champion")
    registry_versions = _part("champion", "registry_versions")
    adoptions = _part("champion", "adoptions")

    # ---------------------------------------------------------------- the champion and new versions

    def _waiting(self, lineage: Lineage, heldout: list[CorrectionRecord]) -> str | None:
        """Why it is not time for the lineage's round yet, or None."""
        waiting = self._waiting_for(lineage, heldout)
        return waiting if waiting is None or lineage.domain is None else f"{lineage.domain}: {waiting}"

    def _waiting_for(self, lineage: Lineage, heldout: list[CorrectionRecord]) -> str | None:
        new_records, needed = lineage.new_records, self.settings.min_new_records
        if new_records < needed or not len(lineage.buffer):
            return f"{new_records} new training records, need {needed}"
        positions = sum(len(record.output_ids) for record in heldout)
        waiting = getattr(self.gate, "waiting_for", None)
        if waiting is not None:
            return waiting(len(heldout), positions)
        if positions < self.gate.min_positions:
            return f"held-out set has {positions} positions, the gate needs {self.gate.min_positions}"
        return None

    def _train(
        self, buffer: ReplayBuffer, keep_training: Callable[[], bool] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> tuple[list[float], set[str], float]:  # fmt: skip
        """`round_steps` optimiser steps on batches sampled from `buffer`, then more while `keep_training()`
        says so, up to `max_round_steps`, unless `ready()` ends the round early: (losses, request ids,
        seconds)."""
        losses, trained_ids = [], set()
        started = time.perf_counter()
        settings = self.settings
        while len(losses) < settings.round_steps or (
            keep_training is not None and len(losses) < settings.max_round_steps and keep_training()
        ):
            batch = self.reading = buffer.sample_batch(self.rng, self.batch_tokens)
            losses.append(self.trainer.train_step(batch))
            self.progressed_at = time.monotonic()
            trained_ids.update(example.request_id for example in batch)
            if ready is not None and len(losses) >= settings.round_steps and ready():
                break
        train_s = time.perf_counter() - started
        self.train_s += train_s
        return losses, trained_ids, train_s

    def _promote(self, result: RoundResult, trained_ids: set[str], lineage: Lineage, revision: int) -> AdapterVersion:
        """Save the candidate as the next version, make it the lineage's champion (its figures scored on
        held-out `revision`), checkpoint, call on_promote."""
        parent_champion = lineage.champion if lineage.champion.version is not None else self.champion
        parent = parent_champion.version
        promoted = self.versions.promote(
            self.trainer.save,
            target_tokens(lineage.buffer, lineage.holdout),
            ngrams=self._ngram_index(lineage),
            candidate=result.candidate,
            champion=result.champion,
            loss=result.loss,
            domain_mix=self.intake.domain_mix(trained_ids),
            parent_version=parent,
            parent_sha256=parent_champion.sha256,
            parent_registry_version=parent_champion.registry_versions.get(version_dir_name(parent or 0)),
            domain=lineage.domain,
            base_version=self.settings.base_version,
            round=result.round,
            round_steps=result.steps,
            first_loss=result.first_loss,
            last_loss=result.last_loss,
            gate={"reason": result.reason, "min_positions": self.gate.min_positions, "margin": self.gate.margin},
            records_consumed=self.records_consumed,
            tokens_consumed=self.tokens_consumed,
        )
        lineage.champion.promoted(promoted.version, promoted.sha256, result.candidate, revision)
        if lineage.domain is not None:
            self.champion.roll_back()  # between rounds (and in checkpoints) the model holds the general champion
        self.adapters_promoted += 1
        if self.checkpoint_dir is not None:  # a restart must not fall back to the champion before this one
            self.checkpoint()
        if self.on_promote is not None:
            try:
                self.on_promote(promoted)
            except Exception:  # the version is saved and is the champion; the callback owns its retries
                self.promote_errors += 1
                log.exception("on_promote failed for %s", promoted.path)
        return promoted

    def _ngram_index(self, lineage: Lineage) -> dict | None:
        """The n-gram index of the lineage's latest `ngram_tokens` output tokens, which `ngram+` drafts
        copy from (adaptive_spec/drafters/ngram_index.py; at most 4,096 n-grams); None when it is 0."""
        if not self.settings.ngram_tokens:
            return None
        return build_ngram_index(lineage.buffer.recent_outputs(self.settings.ngram_tokens))

    def progress(self) -> str:
        last = self.last_result
        return (
            f"{self.records_consumed} records ({self.tokens_consumed} tokens) consumed, {len(self.buffer)} buffered, "
            f"{len(self.holdout)} held out, {len(self.intake.unacked)} unacknowledged, {self.rounds} rounds in "
            f"{self.train_s:.1f} s, {self.adapters_promoted} promoted, {self._champions()}"
            + (f", rejected {self.rejected}" if self.rejected else "")
            + (f", {self.rounds_failed} rounds failed" if self.rounds_failed else "")
            + (f", last round {versus(last.candidate, last.champion)}, loss {last.loss:.4f}" if last else "")
        )

    def _champions(self) -> str:
        """With one adapter "champion v0002"; with domains "champions: general base draft, python v0001"."""
        if not len(self.lineages):
            return f"champion {self.champion.name()}"
        return "champions: " + ", ".join(f"{lineage.label} {lineage.champion.name()}"
                                         for lineage in self.lineages.every())  # fmt: skip

    def _dirty(self) -> bool:
        champions_changed = any(lineage.champion.changed for lineage in self.lineages.every())
        return self._changed or champions_changed or bool(self.intake.unacked)


class _FirstLook:
    """An interim look at the gate during a lineage's first round (its champion the base draft): when
    held-out records arrive while the round keeps training, score the candidate as it is on the grown
    held-out set; `ready()` ends the round if the gate would promote it, and the round then decides on
    that snapshot (`heldout`, `revision`, `champion`). Only new evidence brings a look, never the same
    records again, which the gate's false-promotion check covers (tests/trainer/test_decision.py looks
    after every record). The base draft's figures need no weights swapped (adapters disabled), so a
    look leaves the model and the optimiser as they were. A first adapter then comes with the held-out
    record that makes it certain, not at the end of a round of up to `max_round_steps`."""

    def __init__(self, trainer: OnlineTrainer, lineage: Lineage, revision: int) -> None:
        self.trainer, self.lineage, self.revision = trainer, lineage, revision
        self.heldout: list[CorrectionRecord] | None = None  # the last snapshot looked at; None: no look
        self.champion: GateFigures | None = None
        self.candidate: GateFigures | None = None
        self.promotes = False  # the last look would promote: the round ends there
        self.looks = 0

    def __call__(self) -> bool:
        holdout = self.lineage.holdout
        if holdout.revision == self.revision:
            return False
        self.heldout, self.revision = holdout.records, holdout.revision
        self.trainer.reading = self.heldout
        self.looks += 1
        self.champion = self.lineage.champion.figures(self.heldout, self.revision)
        self.candidate = agreement(self.trainer.trainer, self.heldout)
        self.promotes, _ = self.trainer.gate.decide(self.candidate, self.champion)
        return self.promotes
