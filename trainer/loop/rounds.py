"""A round of the online trainer: what one round did (`RoundResult`), and the part that trains a
lineage's round, looks at the gate, and promotes or rolls back (`Rounds`).

    rounds = Rounds(settings, draft_trainer, lineages, versions, intake, status, on_promote=pending.submit)
    result = rounds.train(lineage, keep_training)    # a RoundResult; `waiting(lineage)` says why not yet

A round: `round_steps` optimiser steps from the lineage's champion on its buffer (more, up to
`max_round_steps`, while `keep_training()` says the next round would still wait for records); then
candidate and champion are scored on one snapshot of its held-out set and the gate decides. While the
lineage's champion is the base draft, held-out records that arrive during the round bring a look at
the gate (`FirstLook`), and the round ends at the look that promotes. A winner becomes the next
version and the lineage's champion; a candidate ahead but not yet certain is carried into the
lineage's next round; anything else is rolled back. The registry has the last word: before the round
and before a promotion the lineages adopt what an operator moved the alias to, and a candidate whose
champion moved meanwhile is discarded.

The part owns its counters, its sampler and the last result, and saves and restores them itself
(`state`, `load_state`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from adaptive_spec.contracts import version_dir_name
from adaptive_spec.drafters.ngram_index import build_ngram_index
from adaptive_spec.formats.record import CorrectionRecord
from trainer.evaluation.gate import GateFigures
from trainer.intake.buffer import ReplayBuffer
from trainer.intake.intake import StreamIntake, target_tokens
from trainer.loop.domains import DomainLineages, Lineage
from trainer.promotion.champion import agreement
from trainer.promotion.versions import AdapterVersion, VersionDirs

log = logging.getLogger("trainer.loop.online")

COUNTERS = ("train_s", "adapters_promoted", "rounds", "promote_errors", "rounds_failed", "records_set_aside")


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
    domain: str | None = None  # whose lineage (trainer/loop/domains.py); None: the general adapter


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


class Rounds:
    """Trains rounds, judges them and promotes the winners; what it counts is its own state."""

    def __init__(
        self,
        settings,  # the loop's OnlineSettings
        trainer,  # the DraftTrainer or HeadTrainer: the model, its optimiser, save/restore of weights
        lineages: DomainLineages,
        versions: VersionDirs,
        intake: StreamIntake,
        status,  # the TrainerStatus operators read
        *,
        on_promote: Callable[[AdapterVersion], None] | None = None,
        checkpoint: Callable[[], object] | None = None,  # called after a promotion, before on_promote
    ) -> None:
        self.settings, self.trainer, self.gate = settings, trainer, settings.gate
        self.lineages, self.versions, self.intake, self.status = lineages, versions, intake, status
        self.on_promote, self.checkpoint = on_promote, checkpoint
        self.batch_tokens = settings.batch_tokens or trainer.settings.batch_tokens
        self.rng = np.random.default_rng(trainer.settings.seed)
        self.train_s = 0.0
        self.adapters_promoted = 0
        self.rounds = 0
        self.promote_errors = 0  # on_promote raised
        self.rounds_failed = 0  # rounds that raised (the loop logs them and goes on: `failed`)
        self.records_set_aside = 0  # the records those rounds were reading, taken out of the buffers
        self.reading: list = []  # what the round under way reads now (records or examples): set aside if it raises
        self.stepped_at = time.monotonic()  # the last optimiser step (the loop's progress, trainer/process/leader.py)
        self.last_result: RoundResult | None = None
        self.changed = False  # a round ran since the last checkpoint

    # ---------------------------------------------------------------- one round

    def train(
        self, lineage: Lineage, keep_training: Callable[[], bool] | None = None, idle: bool = False
    ) -> RoundResult:
        """A round of `lineage`: train, gate, promote or roll back (the module docstring says how). An
        `idle` round runs without new records: the traffic went quiet, and it trains on the buffer again."""
        # one snapshot for both sides of the gate, and its revision: a long round polls, so the held-out
        # set may grow before the candidate is promoted with the figures it scored on this snapshot
        heldout, revision = lineage.holdout.records, lineage.holdout.revision
        self.reading = heldout
        waiting = self.waiting(lineage, heldout, idle)
        if waiting:
            return self.report(RoundResult(False, False, waiting, domain=lineage.domain))
        if self.lineages.sync(lineage):  # the gate must compare against what is served, and start from it
            lineage.carried = None
        champion = lineage.champion.figures(heldout, revision)
        if lineage.domain is not None:
            lineage.champion.roll_back()  # its weights into the model (the figures may come from the cache)
        if lineage.carried is not None:  # the last round's candidate, ahead but not yet certain: train on from it
            self.trainer.restore(lineage.carried)
        new_records, lineage.new_records = lineage.new_records, 0
        look = FirstLook(self, lineage, revision) if lineage.champion.is_base_draft else None
        losses, trained_ids, train_s = self._steps(lineage.buffer, keep_training, look)
        if look is not None and look.heldout is not None:  # the held-out set grew: the gate decides on all of it
            heldout, revision, champion = look.heldout, look.revision, look.champion
        self.reading = heldout
        # the round ended at a look that promotes: the weights are those it scored, on this snapshot
        candidate = look.candidate if look is not None and look.promotes else agreement(self.trainer, heldout)
        accepted, reason = self.gate.decide(candidate, champion)
        if idle:
            reason = f"idle round (no new records; the buffer again): {reason}"
        if look is not None and look.looks:
            reason += f" (after {look.looks} look{'s' if look.looks > 1 else ''} at held-out records that arrived during the round)"
        lineage.carried = None
        if accepted and self.lineages.sync(lineage):  # adopting replaced the candidate's weights
            accepted = False
            reason = f"the registry's champion moved during the round; candidate discarded, training from {lineage.champion.name()}"
        elif not accepted and self._ahead(candidate, champion):
            lineage.carried = self.trainer.lora_state()
            reason += "; ahead of the champion, so the next round trains on from this candidate"
        self.rounds += 1
        self.changed = True
        loss = float(np.mean(losses))
        result = RoundResult(True, accepted, reason, self.rounds, len(losses), loss, losses[0], losses[-1],
                             new_records, train_s, candidate, champion, domain=lineage.domain)  # fmt: skip # one row, as the fields are declared
        if accepted:
            result = dataclasses.replace(result, version=self._promote(result, trained_ids, lineage, revision).version)
        else:
            lineage.champion.roll_back()
            if lineage.domain is not None:
                self.lineages.general.champion.roll_back()  # between rounds the model holds the general champion
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
        return self.report(result)

    def waiting(
        self, lineage: Lineage, heldout: list[CorrectionRecord] | None = None, idle: bool = False
    ) -> str | None:
        """Why it is not time for the lineage's round yet, or None; an `idle` round needs no new records."""
        heldout = lineage.holdout.records if heldout is None else heldout
        waiting = self._waiting_for(lineage, heldout, idle)
        return waiting if waiting is None or lineage.domain is None else f"{lineage.domain}: {waiting}"

    def report(self, result: RoundResult) -> RoundResult:
        """Tell operators (trainer/loop/status.py) what `result` says, naming its lineage's champion."""
        lineage = self.lineages.lineages.get(result.domain) if result.domain is not None else None
        self.status.report(result, (lineage or self.lineages.general).champion.name(), self.intake.rejected)
        return result

    def failed(self, lineage: Lineage, error: Exception) -> None:
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
            self.lineages.general.champion.roll_back()  # between rounds the model holds the general champion
        self.changed = True
        reason = (
            f"a round of the {lineage.label} adapter failed ({type(error).__name__}: {error}); "
            f"{set_aside} records it was reading set aside, training goes on"
        )
        log.exception("%s: %s", reason, sorted(ids)[:8])
        self.status.round_failed(reason, self.rounds_failed)
        self.report(RoundResult(False, False, reason, self.rounds, domain=lineage.domain))

    def _waiting_for(self, lineage: Lineage, heldout: list[CorrectionRecord], idle: bool = False) -> str | None:
        new_records, needed = lineage.new_records, self.settings.min_new_records
        if (new_records < needed and not idle) or not len(lineage.buffer):
            return f"{new_records} new training records, need {needed}"
        positions = sum(len(record.output_ids) for record in heldout)
        waiting = getattr(self.gate, "waiting_for", None)
        if waiting is not None:
            return waiting(len(heldout), positions)
        if positions < self.gate.min_positions:
            return f"held-out set has {positions} positions, the gate needs {self.gate.min_positions}"
        return None

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

    def _steps(
        self,
        buffer: ReplayBuffer,
        keep_training: Callable[[], bool] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> tuple[list[float], set[str], float]:
        """`round_steps` optimiser steps on batches sampled from `buffer`, then more while `keep_training()`
        says so, up to `max_round_steps`, unless `ready()` ends the round early: (losses, request ids,
        seconds)."""
        losses: list[float] = []
        trained_ids: set[str] = set()
        started = time.perf_counter()
        settings = self.settings
        while len(losses) < settings.round_steps or (
            keep_training is not None and len(losses) < settings.max_round_steps and keep_training()
        ):
            batch = self.reading = buffer.sample_batch(self.rng, self.batch_tokens)
            losses.append(self.trainer.train_step(batch))
            self.stepped_at = time.monotonic()
            trained_ids.update(example.request_id for example in batch)
            if ready is not None and len(losses) >= settings.round_steps and ready():
                break
        train_s = time.perf_counter() - started
        self.train_s += train_s
        return losses, trained_ids, train_s

    # ---------------------------------------------------------------- a promotion

    def _promote(self, result: RoundResult, trained_ids: set[str], lineage: Lineage, revision: int) -> AdapterVersion:
        """Save the candidate as the next version, make it the lineage's champion (its figures scored on
        held-out `revision`), checkpoint, call on_promote."""
        general = self.lineages.general.champion
        parent_champion = lineage.champion if lineage.champion.version is not None else general
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
            records_consumed=self.intake.records_consumed,
            tokens_consumed=self.intake.tokens_consumed,
        )
        lineage.champion.promoted(promoted.version, promoted.sha256, result.candidate, revision)
        if lineage.domain is not None:
            general.roll_back()  # between rounds (and in checkpoints) the model holds the general champion
        self.adapters_promoted += 1
        if self.checkpoint is not None:  # a restart must not fall back to the champion before this one
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

    # ---------------------------------------------------------------- its state in a checkpoint

    def state(self) -> dict:
        return {
            "counters": {name: getattr(self, name) for name in COUNTERS},
            "rng": self.rng.bit_generator.state,
            "last_result": result_state(self.last_result) if self.last_result else None,
        }

    def load_state(self, counters: dict, rng: dict, last_result: dict | None) -> None:
        """Counters a checkpoint written before one existed lack it: it stays at 0."""
        for name in COUNTERS:
            if name in counters:
                setattr(self, name, counters[name])
        self.rng.bit_generator.state = rng
        if last_result:
            last = dict(last_result)
            for side in ("candidate", "champion"):
                last[side] = GateFigures(**last[side]) if last[side] else None
            self.last_result = RoundResult(**last)


class FirstLook:
    """An interim look at the gate during a lineage's first round (its champion the base draft): when
    held-out records arrive while the round keeps training, score the candidate as it is on the grown
    held-out set; `ready()` ends the round if the gate would promote it, and the round then decides on
    that snapshot (`heldout`, `revision`, `champion`). Only new evidence brings a look, never the same
    records again, which the gate's false-promotion check covers (tests/trainer/test_decision.py looks
    after every record). The base draft's figures need no weights swapped (adapters disabled), so a
    look leaves the model and the optimiser as they were. A first adapter then comes with the held-out
    record that makes it certain, not at the end of a round of up to `max_round_steps`."""

    def __init__(self, rounds: Rounds, lineage: Lineage, revision: int) -> None:
        self.rounds, self.lineage, self.revision = rounds, lineage, revision
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
        self.rounds.reading = self.heldout
        self.looks += 1
        self.champion = self.lineage.champion.figures(self.heldout, self.revision)
        self.candidate = agreement(self.rounds.trainer, self.heldout)
        self.promotes, _ = self.rounds.gate.decide(self.candidate, self.champion)
        return self.promotes
