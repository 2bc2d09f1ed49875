"""Per-domain lineages: one adapter per domain that has traffic, besides the general adapter.

    lineages = DomainLineages(settings, draft_trainer, versions, general_champion, registry_champion)
    lineages.route(record)           # the record's domain's Lineage (made on its first record), or None
    lineages.state()                 # {"sql": {"champion_version": 7, ..., "new_records": 3}} for state.json

A request carries a domain tag (`adaptive_spec.domain`, the prompt file's "domain"). The online
trainer (trainer/loop/online.py) keeps, for each of the first `max_domains` domains it sees, a lineage:
its own held-out split (with the warm-up of trainer/intake/buffer.py, so a new domain's first gate comes
after about a dozen of its records), its own replay buffer, and its own champion, registered under
the aliases `champion-<domain>` / `previous-<domain>` (adaptive_spec/contracts.py) that servers
follow into a slot of their own (adaptive_spec/drafters/slots.py).

- A domain's record is held out or trained on by its domain's split; a held-out one is held out of
  the general set too, so no adapter ever trains on a record its gate scores.
- Until a domain has a version of its own, its requests draft with the general adapter: that is
  its champion's `fallback`, what its first round trains from and what its first candidate must
  beat (trainer/promotion/champion.py). Its candidates are gated on its own held-out records only.
- The general adapter trains on every buffered record; its rounds are started by untagged records
  and those of rare domains (beyond `max_domains`, or with a name an MLflow alias cannot carry),
  so traffic that moves to a new domain trains that domain's adapter, not the general one, and a
  domain that returns finds its adapter as it left it.
- `max_domains=0`: no lineages; one general adapter for all traffic (the behaviour before them).

A lineage is never dropped while the trainer runs; the set is bounded by `max_domains`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from adaptive_spec.contracts import is_alias_domain
from adaptive_spec.formats.record import CorrectionRecord
from trainer.intake.buffer import HoldoutSplit, ReplayBuffer
from trainer.promotion.champion import Champion, RegistryChampion

log = logging.getLogger("trainer.loop.online")


@dataclass(eq=False)
class Lineage:
    """One adapter's line of versions: what it trains on, what it is gated on, what it must beat."""

    domain: str | None  # None: the general adapter
    holdout: HoldoutSplit
    buffer: ReplayBuffer
    champion: Champion
    new_records: int = 0  # training records since its last round
    # A candidate that scored ahead of the champion but not yet with the gate's confidence: its
    # weights (`lora_state()`), which the lineage's next round trains on from (trainer/loop/online.py).
    carried: dict | None = None
    # Idle rounds (trainer/loop/online.py) in a row, since its last new record, that did not promote; at
    # OnlineSettings.idle_rejections the lineage waits for new records again.
    idle_rejections: int = 0

    @property
    def label(self) -> str:
        return "general" if self.domain is None else self.domain

    def state(self) -> dict:
        return {**self.champion.state(), "new_records": self.new_records}


class DomainLineages:
    """The domains' lineages, made on a domain's first record: a split and a buffer as the trainer's
    settings say (OnlineSettings), a champion standing on `general` and following `source` for the
    domain's alias."""

    def __init__(self, settings, trainer, versions, source: RegistryChampion | None) -> None:
        if settings.max_domains < 0:
            raise ValueError(f"max_domains must be >= 0, got {settings.max_domains}")
        self.settings, self.max_domains = settings, settings.max_domains
        self.trainer, self.versions, self.source = trainer, versions, source
        self.lineages: dict[str, Lineage] = {}
        self.general = self.make(None)  # every record is kept here too: held out, or buffered for training

    def make(self, domain: str | None) -> Lineage:
        settings = self.settings
        holdout = HoldoutSplit(
            settings.holdout_fraction,
            settings.holdout_records,
            warmup_records=min(settings.holdout_warmup, settings.holdout_records),
        )
        source = self.source.for_domain(domain) if self.source is not None and domain is not None else self.source
        general = None if domain is None else self.general.champion
        champion = Champion(self.trainer, self.versions, source, settings.registry_retry_s, fallback=general)
        if domain is not None:
            log.info("domain %r gets an adapter lineage of its own (%d of %d)", domain, len(self) + 1, self.max_domains)
        return Lineage(domain, holdout, ReplayBuffer(settings.buffer_tokens), champion)

    def next(self, waiting) -> Lineage | None:
        """The lineage to train next: of those with `min_new_records` new records, the one with most
        whose `waiting(lineage)` is None (its gate is ready), else the first (its round says what it waits for)."""
        due = [lineage for lineage in self.every() if lineage.new_records >= self.settings.min_new_records]
        ready = [lineage for lineage in due if waiting(lineage) is None]
        return max(ready, key=lambda lineage: lineage.new_records) if ready else (due[0] if due else None)

    def counters(self) -> dict:
        return {
            lineage.domain: {
                "champion_version": lineage.champion.version,
                "buffer_records": len(lineage.buffer),
                "holdout_records": len(lineage.holdout),
                "new_records": lineage.new_records,
            }
            for lineage in self
        }

    def __iter__(self):
        return iter(self.lineages.values())

    def every(self) -> tuple[Lineage, ...]:
        """The general lineage, then each domain's."""
        return (self.general, *self.lineages.values())

    def __len__(self) -> int:
        return len(self.lineages)

    def sync(self, lineage: Lineage) -> bool:
        """Adopt what an operator moved the aliases to (trainer/promotion/champion.py): the general
        champion's, then the lineage's own; True when either champion changed (a domain without a
        version of its own stands on the general one)."""
        moved = self.general.champion.sync()
        if lineage.domain is not None:
            moved |= lineage.champion.sync()
        return moved

    def route(self, record: CorrectionRecord) -> Lineage | None:
        """The lineage a record belongs to; None for untagged records and rare domains (the general adapter's)."""
        return None if record.domain is None else self.lineage(record.domain)

    def lineage(self, domain: str) -> Lineage | None:
        found = self.lineages.get(domain)
        if found is None and len(self.lineages) < self.max_domains and is_alias_domain(domain):
            found = self.lineages[domain] = self.make(domain)
        return found

    def state(self) -> dict:
        return {domain: lineage.state() for domain, lineage in self.lineages.items()}

    def load_state(self, state: dict) -> None:
        """Restore each domain's champion (its weights from its version directory) and counter."""
        for domain, kept in state.items():
            lineage = self.lineage(domain)
            if lineage is not None:
                lineage.champion.load_state(kept)
                lineage.new_records = kept.get("new_records", 0)
