"""The champion follower: the registry has the last word on which adapter the trainer trains from.

    champion = Champion(draft_trainer, VersionDirs(data_dir / "adapters"), RegistryChampion(registry, pending))
    champion.figures(heldout, revision)    # what a candidate must beat (cached)
    champion.promoted(5, sha256, figures, revision)   # the trainer's own promotion, v0005, is the champion
    champion.roll_back()                   # a rejected candidate: the champion's weights back in the model
    champion.sync()                        # True when an operator moved `champion` and it was adopted

Before each round and again before each promotion the trainer asks which version the `champion`
alias names. If it is not the trainer's champion (and none of the trainer's own promotions is still
on its way there), an operator moved it: a rollback, a promotion of an older version, or the alias
removed (the base draft). The trainer then adopts it: it loads that version's LoRA weights
(optimiser moments cleared; for the base draft the LoRA is re-initialised to its zero delta) and
makes it the champion the gate compares against. Example: the trainer promoted v0005 (registry
version 5); an operator rolls back to 4; the next round logs "champion moved in the registry from
5 to 4 by cli:alice@host; training from 4", trains from 4's weights, and its candidate is promoted
only if it beats 4 by the gate's margin, so 5 cannot come back without earning it.

MLflow down: the trainer keeps its champion and asks again `retry_s` later. A version that cannot
be adopted (corrupt, untagged, another LoRA shape) is not tried again until the alias moves
elsewhere and back. An adopted version that is not already a local directory is installed as the next vNNNN with
`registry_version` in its metadata. `registry_versions` maps the trainer's directories to registry versions, for
the log and for the lineage a promotion records (`parent_registry_version`).

Tests (MLflow on sqlite, real Redis): `.venv/bin/python -m pytest tests/trainer/test_rollback_aware.py -q`.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from adaptive_spec.contracts import SHA_TAG, version_dir_name
from adaptive_spec.formats.adapters import AdapterDir, AdapterError, sha256_file
from adaptive_spec.formats.record import CorrectionRecord
from registry.client import AdapterRegistry, ServedChampion
from trainer.evaluation.gate import GateFigures, draft_agreement
from trainer.learning.distill import DraftTrainer
from trainer.promotion.pending import PendingRegistrations
from trainer.promotion.versions import VersionDirs

log = logging.getLogger(__name__)


class RegistryChampion:
    """What the registry serves, for the trainer.

        source = RegistryChampion(registry, pending)
        source.served()      # ServedChampion("4", "9f2c...", "cli:alice@host"), or None while pending is not empty
        source.download("4", Path("/tmp/x"))   # the version's adapter directory
        source.version_of("9f2c...")           # "4": the version holding these weights (for the log)

    While some of the trainer's own promotions still wait in `pending`, the registry lags behind the
    trainer and says nothing about operators: `served()` answers None and the trainer keeps its
    champion. Once the queue is empty, a champion other than the trainer's is someone else's doing
    (or a registration that could not promote) and the trainer adopts it. Raises RegistryUnavailable
    when MLflow is down.
    """

    def __init__(
        self, registry: AdapterRegistry, pending: PendingRegistrations | None = None, domain: str | None = None
    ) -> None:
        self.registry = registry
        self.pending = pending
        self.domain = domain  # None: the `champion` alias; "sql": `champion-sql`

    def for_domain(self, domain: str) -> RegistryChampion:
        return RegistryChampion(self.registry, self.pending, domain)

    def served(self) -> ServedChampion | None:
        if self.pending is not None and self.pending.pending():
            return None
        return self.registry.served(domain=self.domain)

    def download(self, version: str, destination: Path) -> Path:
        return self.registry.download(version, destination)

    def check_signature(self, downloaded: Path) -> None:
        """AdapterError unless the version is signed with the deployment's key (when it has one)."""
        self.registry.check_signature(downloaded)

    def version_of(self, sha256: str) -> str | None:
        """The oldest version holding these weights, or None."""
        return self.registry.version_of(sha256)


class Champion:
    """The adapter the trainer trains from and gates against: which version (`version`, a local vNNNN,
    None for the base draft), its weights, its figures on the held-out set, and what the registry says
    about it. `source` None: no registry; the trainer's own champion is final.

    A domain's champion (trainer/loop/domains.py) has a `fallback`, the general champion: until the domain
    has a version of its own (`version` None, no `champion-<domain>` alias), its requests draft with
    the general adapter, so that is what it trains from and what its candidates must beat. Its
    figures and `roll_back` put its weights into the model first; the caller puts the general
    champion's back after the domain's round."""

    def __init__(
        self,
        trainer: DraftTrainer,
        versions: VersionDirs,
        source: RegistryChampion | None = None,
        retry_s: float = 30.0,
        fallback: Champion | None = None,
    ) -> None:
        self.fallback = fallback
        self.trainer = trainer
        self.versions = versions
        self.source = source
        self.retry_s = retry_s  # while the registry is unreachable, ask it again after this long
        self.version: int | None = None
        self.sha256: str | None = None  # of the champion's weights; None for the base draft
        self.registry_champion: str | None = None  # the registry version last seen serving our champion
        self.registry_versions: dict[str, str] = {}  # local directory (v0004) -> registry version ("4")
        self.adoptions = 0  # champions taken over from the registry
        self.changed = False  # anything above changed since the trainer last checkpointed
        self._down = False
        self._retry_at = 0.0  # monotonic time before which an unreachable registry is not asked
        self._refused: dict[str, str] = {}  # registry version -> why it could not be adopted (not retried)
        self._weights = trainer.lora_state()  # what a rejected round or a failed adoption returns to
        self._figures: tuple[tuple, GateFigures] | None = None  # ((holdout revision, version), figures)

    @property
    def path(self) -> Path | None:
        return None if self.version is None else self.versions.path(self.version)

    @property
    def weights(self) -> dict:
        """The LoRA weights its requests draft with (the general champion's for a domain without its own)."""
        return self.fallback.weights if self.version is None and self.fallback is not None else self._weights

    @property
    def is_base_draft(self) -> bool:
        """Its requests draft with the base draft: no version of its own, nor a general one standing in."""
        return self._key() is None

    def _key(self) -> int | None:
        """Which weights: its version, else the fallback's while it stands in (version numbers are unique
        across lineages: one VersionDirs); None: the base draft."""
        return self.fallback._key() if self.version is None and self.fallback is not None else self.version

    def promoted(self, version: int, sha256: str, figures: GateFigures, revision: int) -> None:
        """The model's weights are the new champion `version`, scoring `figures` on held-out `revision`."""
        self.version, self.sha256 = version, sha256
        self._weights = self.trainer.lora_state()
        self._figures = ((revision, self._key()), figures)
        self.changed = True

    def figures(self, heldout: list[CorrectionRecord], revision: int) -> GateFigures:
        """The champion on the held-out snapshot, cached until the held-out set or the champion changes."""
        key = (revision, self._key())
        if self._figures is None or self._figures[0] != key:
            if self._key() is None:  # the base draft
                with self.trainer.base_draft():  # LoRA off, or an eagle3 head's untrained start
                    figures = agreement(self.trainer, heldout)
            else:  # between rounds the trained weights are the general champion's; a domain's go in first
                if self.fallback is not None:
                    self.roll_back()
                figures = agreement(self.trainer, heldout)
            self._figures = (key, figures)
        return self._figures[1]

    def roll_back(self) -> None:
        """The champion's weights back in the model, the optimiser's moments cleared."""
        self.trainer.restore(self.weights)

    def sync(self) -> bool:
        """Adopt the registry's champion if an operator moved it: its weights in the model (a zero LoRA
        delta for the base draft), a fresh optimiser. True when the champion changed. Never raises."""
        served = self._moved()
        if served is None:
            return False
        try:
            self._adopt(served)
        except (AdapterError, ValueError) as error:  # corrupt, untagged, or not shaped like our LoRA
            self._refused[served.version] = str(error)
            self.roll_back()  # a half-loaded adapter must not stay in the model
            log.error(
                "the registry's champion is %s (moved by %s) but it cannot be adopted: %s; training on from %s, "
                "whose promotions will not move the champion",
                served.version,
                served.by,
                error,
                self.name(),
            )
            return False
        except Exception as error:  # MLflow went away mid-download, a full disk: try again next time
            self.roll_back()
            log.warning(
                "could not adopt the registry's champion %s yet (%s); asking again before the next round",
                served.version,
                error,
            )
            return False
        self._weights = self.trainer.lora_state()
        self._figures = None
        return True

    def name(self) -> str:
        """E.g. v0004, or v0004 (registry version 4) once the registry is known to hold it, or base draft."""
        if self.version is None:
            return "base draft" if self.fallback is None else f"general adapter ({self.fallback.name()})"
        name = version_dir_name(self.version)
        registered = self.registry_versions.get(name)
        return f"{name} (registry version {registered})" if registered else name

    def state(self) -> dict:
        return {
            "champion_version": self.version,
            "champion_sha256": self.sha256,
            "registry_champion": self.registry_champion,
            "registry_versions": self.registry_versions,
            "adoptions": self.adoptions,
        }

    def load_state(self, state: dict) -> None:
        self.version = state["champion_version"]
        if "champion_sha256" in state:
            self.sha256 = state["champion_sha256"]
        elif self.path is not None:  # a format-1 checkpoint need not hold it: the weights tell
            self.sha256 = sha256_file(AdapterDir(self.path).weights)
        self.registry_champion = state.get("registry_champion")
        self.registry_versions = dict(state.get("registry_versions") or {})
        self.adoptions = state.get("adoptions", 0)
        self._figures = None  # scored for other weights, maybe on other held-out records
        if self.fallback is None:
            self._weights = self.trainer.lora_state()  # the checkpoint's adapter is the general champion's
        elif self.path is not None:  # a domain's champion is one of our version directories
            self.trainer.load(self.path)
            self._weights = self.trainer.lora_state()

    def _moved(self) -> ServedChampion | None:
        """The registry's champion when it is not ours, else None; cheap when nothing moved (one or two
        MLflow reads), and an unreachable registry reads as "nothing moved"."""
        if self.source is None or time.monotonic() < self._retry_at:
            return None
        try:
            served = self.source.served()
        except Exception as error:  # MLflow down or broken: training goes on from our champion
            if not self._down:
                log.warning(
                    "registry unavailable (%s); training on from %s, asking again in %.0f s",
                    error,
                    self.name(),
                    self.retry_s,
                )
            self._down = True
            self._retry_at = time.monotonic() + self.retry_s
            return None
        if self._down:
            log.info("registry reachable again")
            self._down = False
        if served is None:  # our own promotions are still on their way: the registry lags behind us
            return None
        if (served.version is None, served.sha256) == (self.version is None, self.sha256):
            if served.version != self.registry_champion:
                self.registry_champion = served.version
                if self.version is not None:
                    self.registry_versions[version_dir_name(self.version)] = served.version
                self.changed = True
            return None
        self._refused = {version: why for version, why in self._refused.items() if version == served.version}
        if served.version in self._refused:  # tried again once the alias has moved elsewhere and back
            return None
        return served

    def _adopt(self, served: ServedChampion) -> None:
        ours = self._registry_version()  # maps the champion we leave, for the log line
        moved_from = served.moved_from or ours
        if served.version is None:
            if self.fallback is None:
                self.trainer.reset()
            local = None
        else:
            if not served.sha256:
                raise AdapterError(f"version {served.version} has no {SHA_TAG} tag: nothing to verify it against")
            with tempfile.TemporaryDirectory(prefix=".adopt-", dir=self.versions.root) as staging:
                downloaded = self.source.download(served.version, Path(staging))
                AdapterDir(downloaded).verify(expected_sha256=served.sha256)  # as a server verifies it
                self.source.check_signature(downloaded)  # never train (and sign) from a forged version
                self.trainer.load(downloaded)  # checks the LoRA's shape; a fresh optimiser
                local = self.versions.find(served.sha256) or self._install(downloaded, served)
            self.registry_versions[version_dir_name(local)] = served.version
        self.version, self.sha256 = local, served.sha256
        self.registry_champion = served.version
        self.adoptions += 1
        self.changed = True
        log.warning(
            "champion moved in the registry from %s to %s by %s; training from %s (local %s)",
            _registry_name(moved_from),
            _registry_name(served.version),
            served.by,
            _registry_name(served.version),
            "base draft" if local is None else version_dir_name(local),
        )

    def _install(self, downloaded: Path, served: ServedChampion) -> int:
        """Copy an adopted version in as the next vNNNN, its registry version added to its metadata."""
        number = self.versions.take()
        self.versions.install(
            number,
            downloaded,
            registry_version=served.version,
            adopted_at=time.time(),
            adopted_by=served.by,
            adopted_as=number,
        )
        return number

    def _registry_version(self) -> str | None:
        """The registry version of our champion (asked by sha256 if our last promotion is not mapped yet)."""
        if self.version is None:
            return None
        name = version_dir_name(self.version)
        if name not in self.registry_versions and self.sha256 and self.source is not None:
            try:
                found = self.source.version_of(self.sha256)
            except Exception as error:  # only for the log line
                log.debug("no registry version for %s: %s", name, error)
                found = None
            if found is not None:
                self.registry_versions[name] = found
        return self.registry_versions.get(name, self.registry_champion)


def agreement(trainer: DraftTrainer, heldout: list[CorrectionRecord]) -> GateFigures:
    """How well the trainer's draft, as it is now, agrees with the target on the held-out records."""
    return draft_agreement(trainer.model, heldout, trainer.settings.batch_tokens, trainer.settings.max_seq_len)


def _registry_name(version: str | None) -> str:
    return "the base draft" if version is None else version
